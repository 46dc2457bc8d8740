"""The cache's lengths kept on the host: in step with the tensor through every write, and what a
decode step's appends and evictions read back (nothing per layer and request)."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.cache import LayerKV, private_pool
from vlkv.runtime.kv.batch import LayerBatch
from vlkv.runtime.kv.edits import prepare_selects
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies.ranking import _drop_lowest, top_entries

B, H, D, P = 3, 2, 8, 3


def _prefilled(seed: int, lengths=(5, 2, 7), layers: int = 1) -> list[LayerKV]:
    """``layers`` layers of one ``B``-sample cache holding ``lengths`` entries each."""
    g = torch.Generator().manual_seed(seed)
    pool = private_pool(layers, H, D, torch.float32, "cpu")
    out = []
    for i in range(layers):
        layer = LayerKV(pool, i, B, P)
        q = max(lengths)
        layer.append(
            torch.randn(B, H, q, D, generator=g),
            torch.randn(B, H, q, D, generator=g),
            torch.randint(0, 50, (B, q, P), generator=g),
            torch.zeros(B, q, dtype=torch.int8),
            torch.tensor(lengths),
        )
        out.append(layer)
    return out


def _in_step(layer: LayerKV) -> None:
    assert layer.host_lengths() == layer.lengths.tolist()
    assert layer.max_length == int(layer.lengths.max())


def test_host_lengths_follow_every_write():
    layer = _prefilled(0)[0]
    _in_step(layer)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # decode appends: the batch's one-row path
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        layer.append(
            k,
            v,
            torch.zeros(B, 1, P, dtype=torch.long),
            torch.zeros(B, 1, dtype=torch.int8),
            torch.ones(B, dtype=torch.long),
        )
        _in_step(layer)
    layer.cut(torch.tensor([1, 0, 2]), torch.tensor([2, 1, 0]))
    _in_step(layer)
    n = layer.host_lengths()
    keep = torch.tensor([min(n) - 1] * B)
    index = torch.arange(int(keep[0])).expand(B, H, -1)
    layer.select(index, keep)  # ragged lengths: the general path
    _in_step(layer)
    layer.lengths[1] += 1  # an in-place write: the kept copy is stale and not trusted
    _in_step(layer)
    layer.lengths = layer.lengths.clone()  # the plain setter drops it
    _in_step(layer)
    layer.offload()
    _in_step(layer)
    layer.reload()
    layer.release()
    assert layer.host_lengths() == [0] * B and layer.max_length == 0


def test_reading_lengths_after_a_write_that_kept_them_reads_nothing_back():
    layer = _prefilled(2)[0]
    with count_ops() as c:
        layer.host_lengths(), layer.max_length, layer.kv_bytes()
    assert c.syncs == 0, dict(c.modules)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("layers", [1, 4])
def test_a_batch_view_decode_step_reads_back_once_whatever_the_depth(layers, decode):
    """Every layer of a step appends the same rows: whether each request appends one is read once
    per step (nothing when a decode plan built the view), the rows' values and lengths never."""
    pool = private_pool(layers, H, D, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    caches = []
    for n in (5, 2, 7):
        rows = [LayerKV(pool, i, 1, P) for i in range(layers)]
        for r in rows:
            r.append(
                torch.randn(1, H, n, D, generator=g),
                torch.randn(1, H, n, D, generator=g),
                torch.randint(0, 50, (1, n, P), generator=g),
                torch.zeros(1, n, dtype=torch.int8),
                torch.tensor([n]),
            )
        caches.append(rows)
    memo: dict = {"decode": decode}
    view = [LayerBatch([c[i] for c in caches], memo) for i in range(layers)]
    pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
    ones = torch.ones(B, dtype=torch.long)
    with count_ops() as c:
        for lay in view:
            k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
            lay.append(k, v, pos, mod, ones)
            assert lay.max_length == 8
    assert c.syncs == (0 if decode else 1), dict(c.modules)
    assert all(r.host_lengths() == [n + 1] for rows, n in zip(caches, (5, 2, 7)) for r in rows)


@pytest.mark.parametrize("recycle", [True, False])
def test_prepared_selects_equal_per_layer_selects_in_one_read(recycle):
    """A step's uniform evictions of many layers, their checks read in one transfer, leave exactly
    the tables and pool of the same selects checked layer by layer."""
    g = torch.Generator().manual_seed(4)
    n, layers = 9, 4
    fast, slow = _prefilled(5, (n,) * B, layers), _prefilled(5, (n,) * B, layers)
    jobs, edits = [], []
    for i in range(layers):
        lo = n - 1 if i % 2 else 0  # near the end (in place) or anywhere (rebuilt)
        drop = torch.randint(lo, n, (B, H, 1), generator=g)
        keep = torch.ones(B, H, n, dtype=torch.bool).scatter_(2, drop, False)
        index = torch.nonzero(keep)[:, 2].view(B, H, n - 1)
        keep_len = torch.full((B,), n - 1)
        edits.append((index, keep_len))
        jobs.append((fast[i], index, keep_len, [n - 1] * B))
    with count_ops() as c:
        prepared = prepare_selects(jobs, 1, recycle)
    assert c.syncs == 1 and all(p is not None for p in prepared)
    for i, (index, keep_len) in enumerate(edits):
        with count_ops() as c:
            fast[i].select(index, keep_len, spare=1, recycle=recycle, kept=[n - 1] * B, prepared=prepared[i])
        assert c.syncs_in("vlkv.runtime.kv.edits", "vlkv.runtime.kv.entries") == 0, dict(c.modules)
        slow[i].select(index, keep_len, spare=1, recycle=recycle)
    for a, b in zip(fast, slow):
        assert a.host_lengths() == b.host_lengths() == [n - 1] * B
        for name in ("slots", "order", "modality", "positions"):
            assert torch.equal(getattr(a, name)[:, :, : n - 1], getattr(b, name)[:, :, : n - 1]), name
        assert (a.recycled is None) == (b.recycled is None)
        if a.recycled is not None:
            assert torch.equal(a.recycled, b.recycled)
    assert torch.equal(fast[0].pool._refs[0], slow[0].pool._refs[0])


def test_a_repeated_column_is_caught_by_the_prepared_checks():
    layer = _prefilled(6, (6,) * B)[0]
    index = torch.tensor([0, 1, 1, 3, 4]).expand(B, H, 5)  # column 1 twice: not a uniform select
    (prep,) = prepare_selects([(layer, index, torch.full((B,), 5), None)], 0, True)
    assert prep is not None and prep.checks[0] is False  # (distinct, sole)


@pytest.mark.parametrize("keep", [[9, 9, 9], [8, 9, 5], [2, 9, 1]])
def test_top_entries_with_host_counts_equals_without(keep):
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(B, H, 10, generator=g).round(decimals=1)  # ties
    valid = torch.ones(B, 1, 10, dtype=torch.bool)
    want = top_entries(scores, valid, torch.tensor(keep))
    with count_ops() as c:
        got = top_entries(scores, valid, torch.tensor(keep), kept=keep)
    assert c.syncs == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    drop = torch.tensor([10 - k for k in keep])
    bounds = (10 - min(keep), 10 - max(keep))
    assert torch.equal(_drop_lowest(scores, drop, bounds), _drop_lowest(scores, drop))
    with count_ops() as c:
        top_entries(scores, valid, torch.tensor(keep))
    assert c.syncs == 1  # the bounds of ``keep``, read together
