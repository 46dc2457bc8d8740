"""``local`` (StreamingLLM) holds the sinks and the most recent entries, at prefill and every decode
step, ragged samples and per-layer budgets included, and cuts without touching the pool's K/V."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.allocators import STATE_FRACTIONS
from vlkv.runtime.prompt import Prompt


def _check(cache, target, sinks: int) -> None:
    """Each layer and sample holds ``min(target, N)`` entries: the first ``sinks`` and the latest,
    in sequence order (``N`` entries processed, ``target`` from the policy's own rounding)."""
    for i, layer in enumerate(cache.layers):
        for b in range(layer.batch):
            n, held = int(cache.processed[b]), int(layer.lengths[b])
            want = min(int(target[i][b]), n)
            assert held == want, f"layer {i} sample {b}: {held} entries held, expected {want}"
            order = layer.order[b, :, :held]
            expect = list(range(min(sinks, held))) + list(range(n - (held - min(sinks, held)), n))
            assert all(order[h].tolist() == expect for h in range(layer.kv_heads)), f"layer {i} sample {b}"


@pytest.mark.parametrize("extra", [{}, {"allocator": "pyramid"}])
def test_local_holds_the_sinks_and_the_latest_entries(extra, engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode(
        [
            Prompt("Describe it.", [images[0]]),
            Prompt("What is in this picture, and why is it there?", [images[1]]),
        ]
    )
    pol = make_policy("local", budget=0.3, sinks=3, **extra)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, pol, cache)
    n_layers = len(cache.layers)
    fractions = cache.policy_state.get(STATE_FRACTIONS)  # (L, B) with an allocator

    def targets(keep_of):  # (L, B) entries each layer may hold
        if fractions is None:
            return [keep_of(pol)] * n_layers
        views = []
        for f in fractions:
            view = make_policy("local", budget=0.3, sinks=3)
            view.budget = f  # the allocator's per-sample fractions for this layer
            views.append(keep_of(view))
        return views

    _check(cache, targets(lambda p: p.prompt_keep(batch.lengths, min_keep=4)), 3)
    keys_before = cache.pool.keys[0].clone()
    token = out.logits.argmax(-1)
    for t in range(1, 9):
        out = engine.decode(token, batch, pol, cache, t)
        token = out.logits.argmax(-1)
        _check(cache, targets(lambda p: p.decode_target(cache, min_keep=4)), 3)
    # a cut moves table entries, never pool rows: the prompt's surviving K/V rows are where they were
    layer = cache.layers[0]
    for b in range(layer.batch):
        slots = layer.slots[b, :, :3]  # the sinks
        heads = torch.arange(layer.kv_heads)[:, None]
        assert torch.equal(cache.pool.keys[0][heads, slots], keys_before[heads, slots])


@pytest.mark.parametrize("seed", range(4))
def test_the_cut_keeps_what_the_shared_top_k_of_its_score_keeps(seed):
    """``local`` is a score (recency, sinks protected); its cut is a fast form of the shared selection."""
    from vlkv.runtime.cache import KVCache
    from vlkv.runtime.policies.scorer import ScorePolicy

    g = torch.Generator().manual_seed(seed)
    b, h, d = 3, 2, 4
    cache = KVCache.empty(3, b, h, d, 1, torch.float32)
    lens = [[12, 5, 9], [12, 5, 9], [7, 7, 3]]
    for layer, n in zip(cache.layers, lens):
        q = max(n)
        k, v = torch.randn(b, h, q, d, generator=g), torch.randn(b, h, q, d, generator=g)
        layer.append(
            k,
            v,
            torch.arange(q).expand(b, q)[..., None],
            torch.zeros(b, q, dtype=torch.int8),
            torch.tensor(n),
        )
    pol = make_policy("local", budget=0.5, sinks=seed % 3)
    keep = [torch.tensor([6, 4, 2]), torch.tensor([3, 5, 9]), torch.tensor([4, 4, 4])]
    cuts = pol.select(cache, [None] * 3, None, keep)
    tops = ScorePolicy.select(pol, cache, [None] * 3, None, keep)
    for layer, cut, top in zip(cache.layers, cuts, tops):
        assert (cut is None) == (top is None)
        if cut is None:
            continue
        for s in range(b):
            n = int(layer.lengths[s])
            start, count = int(cut.start[s]), int(cut.count[s])
            want = [c for c in range(n) if not start <= c < start + count]
            for head in range(h):
                assert top.index[s, head, : int(top.keep_len[s])].tolist() == want, (s, head)
