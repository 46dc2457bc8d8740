"""``knorm`` — the one-file scoring policy: keeps, per KV head, the smallest key norms (a brute-force
reference over ragged samples, sinks and ties), in a real run too; composes with the allocators;
its settings are checked where the CLI and the server check them."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.backend import StepStats
from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.base import PolicyContext
from vlkv.runtime.policies.settings import SettingError, check_compresses, check_setting_types
from vlkv.runtime.prompt import Prompt


def _brute(keys: torch.Tensor, n: int, keep: int, sinks: int) -> list[int]:
    """Kept columns of one (sample, head): the sinks, then the smallest norms (ties: lower column)."""
    norms = keys[:n].float().norm(dim=-1).tolist()
    forced = list(range(min(sinks, n)))
    rest = sorted((c for c in range(n) if c not in forced), key=lambda c: (norms[c], c))
    return sorted(forced + rest[: keep - len(forced)])


def _cache(seed: int, lengths: list[int], layers: int = 2, heads: int = 2, d: int = 4) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    b, q = len(lengths), max(lengths)
    cache = KVCache.empty(layers, b, heads, d, 1, torch.float32)
    for layer in cache.layers:
        k = torch.randn(b, heads, q, d, generator=g)
        if q > 1:
            k[:, :, 0 : q - 1 : 5] = k[:, :, 1::5].flip(-1)  # equal norms: ties between columns
        layer.append(
            k,
            torch.randn(b, heads, q, d, generator=g),
            torch.arange(q).expand(b, q)[..., None],
            torch.zeros(b, q, dtype=torch.int8),
            torch.tensor(lengths),
        )
    return cache


@pytest.mark.parametrize("lengths", [[1], [9], [81, 40], [30, 7, 19]])
@pytest.mark.parametrize("budget,sinks", [(0.5, 0), (0.3, 2), (0.1, 0), (1.0, 4)])
def test_keeps_the_smallest_key_norms_per_kv_head(lengths, budget, sinks):
    cache = _cache(len(lengths) + sinks, lengths)
    policy = make_policy("knorm", budget=budget, sinks=sinks)
    n = torch.tensor(lengths)
    ctx = PolicyContext([], n, num_heads=4, num_kv_heads=2)
    keys = [layer.keys for layer in cache.layers]
    edits = policy.after_prefill(cache, StepStats([None] * len(cache.layers)), ctx)
    keep = policy.prompt_keep(n, sinks + 1)
    for layer_keys, edit in zip(keys, edits):
        if edit is None:  # within budget: every entry stays
            assert bool((keep == n).all())
            continue
        for b, m in enumerate(lengths):
            k = int(edit.keep_len[b])
            assert k == int(keep[b])
            for h in range(2):
                got = edit.index[b, h, :k].tolist()
                assert got == _brute(layer_keys[b, h], m, k, sinks), (b, h)


@pytest.mark.parametrize("lengths", [[9], [81, 40], [30, 7, 19]])
@pytest.mark.parametrize("budget,sinks", [(0.5, 0), (0.2, 2)])
def test_adaptive_heads_share_one_ranking_per_layer(lengths, budget, sinks):
    """``heads="adaptive"`` (the shared per-head budgets): a layer's heads keep, together, its
    ``H_kv · k`` smallest norms (at least one each), each head its own best; the rest are holes."""
    heads = 3
    cache = _cache(7 + sinks, lengths, heads=heads)
    policy = make_policy("knorm", budget=budget, sinks=sinks, heads="adaptive")
    n = torch.tensor(lengths)
    keys = [layer.keys for layer in cache.layers]
    edits = policy.after_prefill(cache, StepStats([None] * 2), PolicyContext([], n, 6, heads))
    keep = policy.prompt_keep(n, sinks + 1)
    counts_differ = False
    for layer_keys, edit in zip(keys, edits):
        for b, m in enumerate(lengths):
            k = int(keep[b])
            # one ranking over (head, column): sinks first, then the smallest norms, ties by position
            norms = layer_keys[b, :, :m].float().norm(dim=-1)
            cells = sorted(
                ((h, c) for h in range(heads) for c in range(m)),
                key=lambda hc: (hc[1] >= sinks, float(norms[hc]), hc[0], hc[1]),
            )
            count = [sum(1 for h, _ in cells[: k * heads] if h == head) for head in range(heads)]
            count = [min(max(c, 1), m) for c in count]
            counts_differ |= len(set(count)) > 1
            width = int(edit.keep_len[b])
            for h in range(heads):
                held = [
                    c
                    for c, hole in zip(edit.index[b, h, :width].tolist(), edit.holes[b, h, :width])
                    if not hole
                ]
                assert held == _brute(layer_keys[b, h], m, count[h], sinks), (b, h)
    assert counts_differ  # the heads really got different budgets


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_a_run_keeps_the_smallest_norms_of_the_full_cache(name, engines, images):
    """The kept entries of a real prefill are the smallest-norm keys of the uncompressed cache."""
    engine = engines[name]
    prompt = Prompt("Describe the picture.", [images[0]])
    seen = {}

    def watch(policy, tag):
        ask = policy.decode_request

        def record(cache, ctx):
            if tag not in seen:
                seen[tag] = [
                    (
                        layer.order[0, :, : layer.max_length].clone(),
                        layer.attention_kv(layer.max_length)[0][0],
                    )
                    for layer in cache.layers
                ]
            return ask(cache, ctx)

        policy.decode_request = record
        return policy

    engine.generate([prompt], watch(make_policy("full"), "full"), 2, stop_at_eos=False)
    engine.generate([prompt], watch(make_policy("knorm", budget=0.4), "knorm"), 2, stop_at_eos=False)
    for (order, _), (_, full_keys) in zip(seen["knorm"], seen["full"]):
        n = full_keys.shape[1]
        k = round(0.4 * n)
        assert order.shape[1] == k
        for h in range(order.shape[0]):
            assert order[h].tolist() == _brute(full_keys[h], n, k, 0)


def test_composes_with_allocators_and_refuses_cadence(engines, images):
    from vlkv.runtime.policies.allocators import STATE_FRACTIONS, keep_counts

    policy = make_policy("knorm", budget=0.4, allocator="pyramid", allocator_beta=4.0)
    assert policy.name == "knorm+pyramid"
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Describe it.", [images[0]]), Prompt("Two words, then a third.")])
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    want = keep_counts(cache.policy_state[STATE_FRACTIONS], batch.lengths)  # (L, B)
    assert len(set(want[:, 0].tolist())) > 1  # the pyramid really gives layers different budgets
    for layer, k in zip(cache.layers, want):
        assert layer.lengths.tolist() == k.tolist()
    with pytest.raises(ValueError, match="evict_every"):
        make_policy("knorm", budget=0.4, evict_every=2)  # it compresses once: no decode eviction


def test_settings_are_checked():
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        make_policy("knorm", sinks=-1)
    with pytest.raises(SettingError, match="sinks must be an integer"):
        check_setting_types("knorm", {"sinks": "4"}, prefix="--set ")
    policy = make_policy("knorm", budget=0.5, sinks=12)
    with pytest.raises(SettingError, match="keeps all 10 entries"):
        check_compresses(policy, {"sinks": 12}, prompt_tokens=10, prefix="--set ")
    check_compresses(policy, {"sinks": 12}, prompt_tokens=40)
