"""The decode-step fast paths of the cache equal the general ones they stand in for."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.cache import LayerKV

B, H, D, P = 3, 2, 8, 3


def _layer(seed: int) -> LayerKV:
    """A layer holding a ragged prefill (lengths 5, 2, 7) and a policy score, built from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerKV.empty(B, H, D, P, torch.float32, "cpu")
    q = 7
    layer.append(
        torch.randn(B, H, q, D, generator=g),
        torch.randn(B, H, q, D, generator=g),
        torch.randint(0, 50, (B, q, P), generator=g),
        torch.randint(0, 3, (B, q), generator=g).to(torch.int8),
        torch.tensor([5, 2, 7]),
    )
    layer.scores["s"] = torch.rand(B, H, layer.capacity, generator=g)
    return layer


@pytest.mark.parametrize("steps", [1, 9])
def test_one_row_append_equals_general_append(steps):
    fast, slow = _layer(0), _layer(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
        ones = torch.ones(B, dtype=torch.long)
        got = fast.append(k, v, pos, mod, ones)  # order=None: the one-row path
        want = slow.append(k, v, pos, mod, ones, order=slow.next_order[:, None].clone())  # general path
        assert torch.equal(got, want)
    assert torch.equal(fast.lengths, slow.lengths) and torch.equal(fast.next_order, slow.next_order)
    n = int(fast.lengths.max())
    valid = fast.valid_mask()[:, None, :n]
    for name in ("slots", "order", "modality"):
        a, b = getattr(fast, name)[:, :, :n], getattr(slow, name)[:, :, :n]
        assert torch.equal(a[valid.expand_as(a)], b[valid.expand_as(b)]), name
    pv = valid[..., None].expand(B, H, n, P)
    assert torch.equal(fast.positions[:, :, :n][pv], slow.positions[:, :, :n][pv])
    sv = valid.expand(B, H, n)
    assert torch.equal(fast.scores["s"][:, :, :n][sv], slow.scores["s"][:, :, :n][sv])
    for a, b in zip(fast.attention_kv(), slow.attention_kv()):
        assert torch.equal(a[valid[..., None].expand_as(a)], b[valid[..., None].expand_as(b)])


def test_append_returns_lengths_the_cache_does_not_alias():
    layer = _layer(2)
    past = layer.append(
        torch.randn(B, H, 1, D),
        torch.randn(B, H, 1, D),
        torch.zeros(B, 1, P, dtype=torch.long),
        torch.zeros(B, 1, dtype=torch.int8),
        torch.ones(B, dtype=torch.long),
    )
    before = past.clone()
    layer.lengths[0] += 4  # e.g. a link writes into sample 0
    assert torch.equal(past, before) and past.tolist() == [5, 2, 7]


def test_pool_read_equals_advanced_indexing():
    layer = _layer(3)
    pool = layer.pool
    g = torch.Generator().manual_seed(4)
    cap = pool.capacity(0)
    ids = torch.randint(0, cap, (4, H, 81), generator=g)  # repeats and any order
    k, v = pool.read(0, ids)
    heads = torch.arange(H)[None, :, None]
    assert torch.equal(k, pool.keys[0][heads, ids]) and torch.equal(v, pool.values[0][heads, ids])
    assert k.shape == (4, H, 81, D)


def _batch_rows(seed: int) -> list[LayerKV]:
    """Three single-sample layers on one shared pool, holding 5, 2 and 7 entries and a score."""
    from vlkv.runtime.cache import private_pool

    g = torch.Generator().manual_seed(seed)
    pool = private_pool(1, H, D, torch.float32, "cpu")
    rows = []
    for n in (5, 2, 7):
        layer = LayerKV(pool, 0, 1, P)
        layer.append(
            torch.randn(1, H, n, D, generator=g),
            torch.randn(1, H, n, D, generator=g),
            torch.randint(0, 50, (1, n, P), generator=g),
            torch.zeros(1, n, dtype=torch.int8),
            torch.tensor([n]),
        )
        layer.scores["s"] = torch.rand(1, H, layer.capacity, generator=g)
        rows.append(layer)
    return rows


@pytest.mark.parametrize("steps", [1, 9])
def test_batch_view_one_row_append_equals_per_request_append(steps):
    from vlkv.runtime.kv.batch import LayerBatch

    fast, slow = LayerBatch(_batch_rows(5)), LayerBatch(_batch_rows(5))
    g = torch.Generator().manual_seed(6)
    for _ in range(steps):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
        ones = torch.ones(B, dtype=torch.long)
        got = fast.append(k, v, pos, mod, ones)  # the batched one-row path
        order = torch.cat([r.next_order for r in slow.rows])[:, None]
        want = slow.append(k, v, pos, mod, ones, order=order)  # per request, general path
        assert torch.equal(got, want)
    for a, b in zip(fast.rows, slow.rows):
        n = int(a.lengths)
        assert n == int(b.lengths) and torch.equal(a.next_order, b.next_order)
        for name in ("slots", "order", "modality", "positions"):
            assert torch.equal(getattr(a, name)[:, :, :n], getattr(b, name)[:, :, :n]), name
        assert torch.equal(a.scores["s"][:, :, :n], b.scores["s"][:, :, :n])
    for x, y in zip(fast.attention_kv(), slow.attention_kv()):
        assert torch.equal(x, y)
