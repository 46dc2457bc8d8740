"""Cache state: appends, edits, and memory accounting that reflects the tensors really held."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.cache import GROW_SLOTS, KVCache, LayerKV
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def _storage_bytes(cache: KVCache) -> int:
    """Bytes the pool's K/V tensors really occupy."""
    pool = cache.pool
    return sum(t.untyped_storage().nbytes() for t in (*pool.keys, *pool.values))


def _check_accounting(cache: KVCache) -> None:
    # the cache is the pool's only owner: what it reports is what the pool has allocated, and the
    # pool's held bytes are its tensors' storage
    assert cache.kv_bytes() == cache.pool.used_bytes()
    assert cache.pool.held_bytes() == _storage_bytes(cache)
    assert cache.pool.used_bytes() <= cache.pool.held_bytes()


def test_append_left_aligns_ragged_rows():
    layer = LayerKV.empty(2, 1, 3, 1, torch.float32, "cpu")
    k = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 1, 4, 3)
    layer.append(
        k,
        k,
        torch.arange(4).expand(2, 4)[..., None],
        torch.zeros(2, 4, dtype=torch.int8),
        torch.tensor([4, 2]),
    )
    assert layer.lengths.tolist() == [4, 2]
    k2 = torch.full((2, 1, 1, 3), -1.0)
    past = layer.append(
        k2,
        k2,
        torch.tensor([[[4]], [[2]]]),
        torch.zeros(2, 1, dtype=torch.int8),
        torch.ones(2, dtype=torch.long),
    )
    assert past.tolist() == [4, 2]
    assert layer.lengths.tolist() == [5, 3]
    assert torch.equal(
        layer.keys[1, 0, :3], torch.cat([k[1, 0, :2], k2[1, 0]])
    )  # sample 1's new row follows its 2
    assert layer.positions[1, 0, :3, 0].tolist() == [0, 1, 2]
    assert layer.capacity >= 5 and layer.capacity <= 5 + GROW_SLOTS


def test_select_keeps_per_head_entries_and_reallocates():
    layer = LayerKV.empty(1, 2, 6, 1, torch.float32, "cpu")
    k = torch.arange(12, dtype=torch.float32).view(1, 2, 6, 1)
    layer.append(
        k, -k, torch.arange(6)[None, :, None], torch.zeros(1, 6, dtype=torch.int8), torch.tensor([6])
    )
    layer.ensure_score("s")[:] = torch.arange(12, dtype=torch.float32).view(1, 2, 6)
    index = torch.tensor([[[0, 3, 5], [1, 2, 4]]])
    layer.select(index, torch.tensor([3]))
    assert layer.capacity == 3
    assert layer.keys[0, :, :, 0].tolist() == [[0, 3, 5], [7, 8, 10]]
    assert layer.values[0, 1, :, 0].tolist() == [-7, -8, -10]
    assert layer.positions[0, :, :, 0].tolist() == [[0, 3, 5], [1, 2, 4]]
    assert layer.scores["s"][0].tolist() == [[0, 3, 5], [7, 8, 10]]


@pytest.mark.parametrize(
    "policy,budget", [("full", 1.0), ("snapkv", 0.2), ("h2o", 0.2), ("elastic", 0.2), ("local", 0.5)]
)
def test_reported_bytes_are_the_bytes_held(policy, budget, engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode(
        [
            Prompt("What is shown here?", [images[0]]),
            Prompt("And here, in this longer question?", [images[1]]),
        ]
    )
    pol = make_policy(policy, budget=budget)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, pol, cache)
    _check_accounting(cache)
    full_prompt = cache.full_kv_bytes()
    if budget < 1:
        # no padding or spare slots after a prefill edit: held bytes track the budget
        n = batch.lengths
        kept = pol.prompt_keep(n)
        assert cache.used_kv_bytes() <= int(kept.sum()) * full_prompt // int(n.sum()) + 1
        assert cache.kv_bytes() <= int(kept.max()) * len(n) * full_prompt // int(n.sum()) + 1
        assert cache.kv_bytes() < 0.6 * full_prompt
    token = out.logits.argmax(-1)
    for t in range(1, 4):
        out = engine.decode(token, batch, pol, cache, t)
        token = out.logits.argmax(-1)
        _check_accounting(cache)
    assert cache.used_kv_bytes() <= cache.kv_bytes()


def test_view_reads_equal_gathers_and_default_reads_are_copies(monkeypatch):
    """One ascending run of slots is read as a view of the pool (``view=True``); any other layout, and
    every default read, is a gather whose result no later pool write can change."""
    import vlkv.runtime.kv.packing as packing

    monkeypatch.setattr(packing, "PACK", False)  # the eviction below must leave its gap
    layer = LayerKV.empty(1, 2, 4, 1, torch.float32, "cpu")
    k = torch.randn(1, 2, 6, 4)
    layer.append(
        k, -k, torch.arange(6)[None, :, None], torch.zeros(1, 6, dtype=torch.int8), torch.tensor([6])
    )
    kv, vv = layer.attention_kv(view=True)
    kc, vc = layer.attention_kv()
    assert kv.data_ptr() != kc.data_ptr() and torch.equal(kv, kc) and torch.equal(vv, vc)
    assert kv.untyped_storage().data_ptr() == layer.pool.keys[0].untyped_storage().data_ptr()  # a view
    layer.pool.keys[0].add_(1.0)
    assert torch.equal(kc, k) and not torch.equal(kv, k)  # the copy kept its values
    # not one run (an eviction left a gap): the view request falls back to a gather
    layer.select(torch.tensor([0, 2, 3, 5])[None, None].expand(1, 2, 4).clone(), torch.tensor([4]))
    kv, _ = layer.attention_kv(view=True)
    torch.testing.assert_close(kv, k[:, :, [0, 2, 3, 5]] + 1.0)
    assert kv.untyped_storage().data_ptr() != layer.pool.keys[0].untyped_storage().data_ptr()
