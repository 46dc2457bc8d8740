"""Elastic Cache: hand-computed merge, the cache-length rule while decoding, new-token positions."""

from __future__ import annotations

import math

import pytest
import torch

from vlkv.plugins import AttnStats
from vlkv.runtime.cache import KVCache
from vlkv.runtime.edits import apply_edits
from vlkv.runtime.policies import PolicyContext, make_policy
from vlkv.runtime.policies.elastic import STATE_P, nearest_anchor
from vlkv.runtime.prompt import Prompt, Spans


def _one_layer_cache(n: int, heads: int = 2) -> KVCache:
    cache = KVCache.empty(1, 1, heads, 1, 1, torch.float32)
    slot = torch.arange(n, dtype=torch.float32)
    k = slot[None, None, :, None].expand(1, heads, n, 1)  # key = slot index
    v = (slot**2)[None, None, :, None].expand(1, heads, n, 1)  # value = slot index squared
    pos = torch.arange(n)[None, :, None]
    cache.layers[0].append(k, v, pos, torch.zeros(1, n, dtype=torch.int8), torch.tensor([n]))
    cache.prompt_lengths = torch.tensor([n])
    cache.processed = torch.tensor([n])
    return cache


def test_nearest_anchor_ties_go_low():
    anchors = torch.tensor([2, 5, 7])
    thrown = torch.tensor([1, 3, 4, 6, 8])
    assert nearest_anchor(thrown, anchors).tolist() == [0, 0, 1, 1, 2]


def test_merge_matches_hand_computation():
    # n = 10, budget 0.6 → f = 4 forgotten; candidates [1, 9) keep |C| - 1 - f = 3 anchors.
    n = 10
    importance = torch.tensor([9.0, 1, 5, 2, 3, 8, 1, 7, 2, 9])  # top-3 in C: slots 5, 7, 2
    cache = _one_layer_cache(n)
    stats = [
        AttnStats(
            colsum=importance[None, None].expand(1, 4, n).clone(), below=None, visible=torch.zeros(1, 4)
        )
    ]
    ctx = PolicyContext([Spans(n, [])], torch.tensor([n]), num_heads=4, num_kv_heads=2)
    policy = make_policy("elastic", budget=0.6, distance=-2)
    apply_edits(cache, policy.after_prefill(cache, stats, ctx))
    layer = cache.layers[0]
    # kept: BOS, anchors 2, 5, 7, last token 9 → n - f - 1 = 5 entries
    assert layer.lengths.tolist() == [5]
    assert layer.positions[0, 0, :, 0].tolist() == [0, 2, 5, 7, 9]
    # buckets: 2 ← {1, 2, 3}; 5 ← {4, 5, 6} (6 ties between 5 and 7 → lower); 7 ← {7, 8}
    expected_k = torch.tensor([0.0, 2.0, 5.0, 7.5, 9.0])
    expected_v = torch.tensor([0.0, 14 / 3, 77 / 3, 56.5, 81.0])
    for h in range(2):
        torch.testing.assert_close(layer.keys[0, h, :5, 0], expected_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.values[0, h, :5, 0], expected_v, rtol=0, atol=1e-5)
    # fixed point P = (n - f) + distance
    assert cache.policy_state[STATE_P].tolist() == [10 - 4 - 2]
    assert layer.kv_bytes() == 2 * 2 * 5 * 1 * 4  # really reallocated to 5 entries


def test_reference_quirks_changes_anchor_identity_not_count():
    n = 12
    # a 3-cycle over the candidates: argsort positions differ from ranks
    importance = torch.tensor([5.0, 2, 3, 1, 6, 4, 5, 9, 7, 8, 10, 0])
    clean = make_policy("elastic", budget=0.5)._plan(importance, n)
    quirk = make_policy("elastic", budget=0.5, reference_quirks=True)._plan(importance, n)
    assert clean[0].numel() == quirk[0].numel()
    assert clean[0].tolist() != quirk[0].tolist()


def _expected_lengths(n: int, budget: float, steps: int) -> list[int]:
    f = min(math.floor(n * (1 - budget) + 1e-6), (n - 2) - 2)
    length, out = n - f - 1, []
    out.append(length)
    for t in range(1, steps + 1):
        length += 1
        if math.floor(length - (n + t) * budget + 1e-6) >= 1:
            length -= 1
        out.append(length)
    return out


@pytest.mark.parametrize("budget", [0.5, 0.2])
def test_decode_length_rule_and_positions(budget, engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Tell me about this image please.", [images[0]])])
    n = int(batch.lengths[0])
    for mode in ("compacted", "original"):
        policy = make_policy("elastic", budget=budget, positions=mode)
        cache = engine.new_cache(batch)
        out = engine.prefill(batch, policy, cache)
        lengths = [int(cache.layers[0].lengths[0])]
        token = out.logits.argmax(-1)
        for t in range(1, 13):
            expected_pos = int(cache.layers[0].lengths[0]) if mode == "compacted" else n + t - 1
            out = engine.decode(token, batch, policy, cache, t)
            layer = cache.layers[0]
            # the newest entry is the token just fed; its stored position follows the mode
            assert int(layer.positions[0, 0, layer.lengths[0] - 1, 0]) == expected_pos
            lengths.append(int(layer.lengths[0]))
            token = out.logits.argmax(-1)
        assert lengths == _expected_lengths(n, budget, 12)
        assert all(torch.equal(layer.lengths, cache.layers[0].lengths) for layer in cache.layers)


def test_ablation_options():
    # n = 12, budget 0.5 → f = 6 forgotten, n - f - 1 = 5 entries
    n = 12
    importance = torch.tensor([9.0, 8, 1, 7, 1, 1, 6, 1, 1, 1, 1, 9])
    base = make_policy("elastic", budget=0.5)._plan(importance, n)
    assert base[0].tolist() == [0, 1, 3, 6, 11]  # BOS, top-3 of [1, 11), last token
    assert base[1].tolist() == [0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 4]  # 4 ties between 3 and 6 → 3
    # merge=False: same anchors, thrown entries dropped instead of averaged
    evict = make_policy("elastic", budget=0.5, merge=False)._plan(importance, n)
    assert evict[0].tolist() == base[0].tolist()
    assert evict[1].tolist() == [0, 1, -1, 2, -1, -1, 3, -1, -1, -1, -1, 4]
    # recent=3: slots 8..10 stay as they are; the 7 candidates [1, 8) would keep 7 - 1 - 6 = 0
    # anchors, so f is clamped to 5 (one anchor always stays) and the cache holds 6 entries
    tail = make_policy("elastic", budget=0.5, recent=3)._plan(importance, n)
    assert tail[0].tolist() == [0, 1, 8, 9, 10, 11]
    assert tail[2] == 5
    assert tail[0].tolist()[:2] == [0, 1]  # slot 1 is the best candidate
    assert tail[1][8:].tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("field", ["start", "recent"])
def test_negative_counts_rejected(field):
    with pytest.raises(ValueError, match=field):
        make_policy("elastic", budget=0.5, **{field: -1})
