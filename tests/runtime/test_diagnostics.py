"""CacheHitRate (VL-Cache Def. 3.1): hand-checked arithmetic, token matching, and the true attention."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.policies.reference import eager_attentions
from vlkv.runtime.diagnostics import cache_hit_rate, first_decode_attention, hit_rates, kept_tokens
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def test_hit_rates_by_hand():
    # 1 layer, 1 sample, 2 KV heads, 6 prompt tokens (+ 2 padding columns)
    true = torch.tensor(
        [[[0.1, 0.5, 0.0, 0.3, 0.05, 0.05, 0.0, 0.0], [0.4, 0.1, 0.1, 0.1, 0.2, 0.1, 0.0, 0.0]]]
    )
    kept = torch.tensor([[[1, 1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 1, 0, 0]]], dtype=torch.bool)
    n = torch.tensor([6])
    # k = kept count (3): head 0 top3 {1,3,0} ∩ {0,1,5} = 2; head 1 top3 {0,4,1} ∩ {0,3,5} = 1
    assert hit_rates([true], [kept], n)[0, 0].item() == pytest.approx((2 / 3 + 1 / 3) / 2)
    # k = 1: head 0 top {1} kept; head 1 top {0} kept
    assert hit_rates([true], [kept], n, k=1)[0, 0].item() == 1.0
    # k = 0.5 -> 3 of 6 tokens, same as the kept count here
    assert hit_rates([true], [kept], n, k=0.5)[0, 0].item() == pytest.approx(0.5)
    # ties go to the lower index: head 1 scores 0.1 at tokens 1, 2, 3, 5
    assert hit_rates([true], [kept], n, k=4)[0, 0].item() == pytest.approx((2 / 4 + 1 / 4) / 2)
    with pytest.raises(ValueError, match="k must be"):
        hit_rates([true], [kept], n, k=1.5)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_true_attention_is_the_first_decode_querys_eager_attention(name, engines, loaded_models, images):
    engine = engines[name]
    batch = engine.encode([Prompt("What is this?", [images[0]])])
    true, tok = first_decode_attention(engine, batch)
    n = int(batch.lengths[0])
    emb = engine.backend.embed(batch)
    full_emb = torch.cat([emb, engine.backend.adapter.embed_tokens(tok[:, None])], 1)
    pos = torch.cat([batch.positions, (batch.positions.max(1).values + 1)[:, None]], 1)
    g = engine.backend.num_heads // engine.backend.num_kv_heads
    for layer, att in enumerate(eager_attentions(loaded_models[name], full_emb, pos)):
        last = att[0, :, -1, :n]  # (H, n)
        ref = last.view(-1, g, n).sum(1)
        torch.testing.assert_close(true[layer][0, :, :n], ref, atol=1e-5, rtol=1e-4)


def test_kept_tokens_follow_original_mrope_positions(engines, images):
    engine = engines["tiny-qwen2-vl"]
    batch = engine.encode([Prompt("Look.", [images[0], images[1]]), Prompt("Words only, nothing else.")])
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("snapkv", budget=0.4, window=4), cache)
    for layer, mask in zip(cache.layers, kept_tokens(cache, batch)):
        for b, p in enumerate(batch.prompts):
            for h in range(mask.shape[1]):
                toks = mask[b, h].nonzero().squeeze(-1)
                m = int(layer.lengths[b])
                assert torch.equal(p.positions[toks], layer.positions[b, h, :m])


def test_cache_hit_rate_api_and_generate_extras(engines, images):
    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe.", [images[0]]), Prompt("Compare.", [images[1], images[2]])]
    layers = engine.backend.num_layers
    assert cache_hit_rate(engine, prompts, make_policy("full")) == [1.0] * layers
    rates = cache_hit_rate(engine, prompts, make_policy("vlcache", budget=0.2))
    assert len(rates) == layers and all(0.0 <= r <= 1.0 for r in rates) and min(rates) < 1.0
    res = engine.generate(prompts, make_policy("vlcache", budget=0.2), max_new_tokens=2, cache_hit_rate=True)
    report = res.extras["cache_hit_rate"]
    assert report["per_layer"] == pytest.approx(rates)
    assert len(report["per_sample"]) == 2 and report["mean"] == pytest.approx(sum(rates) / layers)
    fixed = engine.generate(
        prompts, make_policy("h2o", budget=0.2), max_new_tokens=2, cache_hit_rate=True, hit_rate_k=5
    )
    assert fixed.extras["cache_hit_rate"]["k"] == 5


def test_hit_rates_agree_with_the_eval_metric():
    from vlkv.eval.metrics import cache_hit_rate as metric

    gen = torch.Generator().manual_seed(0)
    true = torch.rand(1, 3, 40, generator=gen)
    kept = torch.zeros(1, 3, 40, dtype=torch.bool)
    for h in range(3):
        kept[0, h, torch.randperm(40, generator=gen)[:12]] = True
    idx = torch.stack([kept[0, h].nonzero().squeeze(-1) for h in range(3)])
    for k in (1, 7, 12, 30):
        ours = hit_rates([true], [kept], torch.tensor([40]), k=k)[0, 0].item()
        assert ours == pytest.approx(metric(idx, true[0], k))
