"""VL-Cache: post-vision rows, sparsity and scores against eager attention, selection, positions."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.policies.reference import eager_attentions, post_vision_brute
from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs
from vlkv.runtime.cache import Modality
from vlkv.runtime.diagnostics import kept_tokens
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.allocators import (
    STATE_FRACTIONS,
    keep_counts,
    layer_density,
    post_vision_mask,
    post_vision_rows,
    proportional_shares,
)
from vlkv.runtime.policies.vlcache import token_scores
from vlkv.runtime.prompt import Prompt, Spans

ATOL, RTOL = 1e-5, 1e-4  # float32 softmax sums over < 100 rows


@pytest.mark.parametrize(
    ("spans", "fallback", "expect"),
    [
        (Spans(20, [(5, 10)]), 50, (10, 20)),  # text first
        (Spans(20, [(0, 8)]), 50, (8, 20)),  # image first
        (Spans(30, [(2, 6), (9, 14)]), 50, (14, 30)),  # multi-image: after the last image
        (Spans(20, [(4, 20)]), 50, (0, 20)),  # image last: last 50 rows (all 20)
        (Spans(20, [(4, 20)]), 5, (15, 20)),  # image last: last 5 rows
        (Spans(12, []), 50, (0, 12)),  # no image: every row
    ],
)
def test_post_vision_rows(spans, fallback, expect):
    assert post_vision_rows(spans, spans.length, fallback) == expect


@pytest.mark.parametrize(
    ("text", "n_images", "case"),
    [
        ("USER: <image>\nWhat is it? ASSISTANT:", 1, "text-first"),
        ("<image>\nWhat is it?", 1, "image-first"),
        ("USER: <image>\nand <image>\ncompare them ASSISTANT:", 2, "multi-image"),
        ("USER: look <image>", 1, "image-last"),
    ],
)
def test_post_vision_rows_on_encoded_prompts(text, n_images, case, engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt(text, images[:n_images], raw=True)])
    ids, n = batch.input_ids[0], int(batch.lengths[0])
    rows = post_vision_mask(engine.context(batch), n, fallback=3)[0].nonzero().squeeze(-1)
    is_img = ids == engine.backend.adapter.image_token_id
    last_img = int(is_img.nonzero().max())
    if case == "image-last":
        assert last_img == n - 1 and rows.tolist() == [n - 3, n - 2, n - 1]
    else:
        assert rows.tolist() == list(range(last_img + 1, n))
        assert not bool(is_img[rows].any())
    if case == "multi-image":
        assert len(batch.spans[0].image_spans) == 2
    if case == "image-first":
        assert int(is_img.nonzero().min()) <= 1  # only BOS may precede the image


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_sparsity_scores_and_selection_match_eager(name, engines, loaded_models, images):
    engine = engines[name]
    batch = engine.encode([Prompt("What colour dominates this picture?", [images[0]])])
    n, ctx = int(batch.lengths[0]), engine.context(batch)
    policy = make_policy("vlcache", budget=0.3)
    emb = engine.backend.embed(batch)
    cache = engine.new_cache(batch)
    out = engine.backend.step(
        StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb),
        cache,
        policy.prefill_request(ctx, n),
    )
    start, _ = post_vision_rows(batch.spans[0], n)
    group = engine.backend.num_heads // engine.backend.num_kv_heads
    densities = []
    for layer, (st, att) in enumerate(
        zip(out.stats, eager_attentions(loaded_models[name], emb, batch.positions))
    ):
        d, s = post_vision_brute(att[0], range(start, n), 0.01, group)
        densities.append(d)
        torch.testing.assert_close(layer_density(st)[0], d, atol=1e-9, rtol=0, msg=f"density, layer {layer}")
        got = token_scores(st.colsum, engine.backend.num_kv_heads)[0, :, :n]
        torch.testing.assert_close(got, s, atol=ATOL, rtol=RTOL, msg=f"scores, layer {layer}")
        densities[-1] = (d, s)
    # the kept set: 10% recent window plus top-scored older tokens, k_l from Algorithm 1
    edits = policy.after_prefill(cache, out.stats, ctx)
    fr = proportional_shares(torch.stack([d for d, _ in densities])[:, None], 0.3, 0.01)
    torch.testing.assert_close(cache.policy_state[STATE_FRACTIONS], fr)
    keep = keep_counts(fr, batch.lengths)[:, 0]
    for layer, ((_, s), edit) in enumerate(zip(densities, edits)):
        k = int(keep[layer])
        w = int(0.1 * k)
        for h in range(s.shape[0]):
            older = torch.sort(s[h, : n - w], descending=True, stable=True).indices[: k - w]
            expect = sorted(older.tolist() + list(range(n - w, n)))
            assert edit.index[0, h, :k].tolist() == expect, f"layer {layer} head {h}"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.0), "threshold"),
        (dict(recent_ratio=1.5), "recent_ratio"),
        (dict(fallback_rows=0), "fallback_rows"),
        (dict(allocator="pyramidal"), "allocator"),
        (dict(heads="query"), "heads"),
        (dict(budget=0.0), "budget"),
    ],
)
def test_vlcache_rejects_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_policy("vlcache", **kwargs)


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2-vl"])
def test_evicted_cache_decodes_like_full_cache_attending_kept_entries(name, engines, images):
    """After eviction, decoding must equal the full cache restricted to the kept entries: K/V, their
    original (M-RoPE) positions and the new token's position all survive the compaction."""
    engine = engines[name]
    prompts = [Prompt("Describe both.", [images[0], images[1]]), Prompt("No picture, just words to read.")]
    batch = engine.encode(prompts)
    small, policy = engine.new_cache(batch), make_policy("vlcache", budget=0.3)
    out = engine.prefill(batch, policy, small)
    kept = kept_tokens(small, batch)
    full = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), full)
    tok, b = out.logits.argmax(-1), len(prompts)

    def step(cache, attend=None):
        inputs = StepInputs(
            tok[:, None],
            engine.decode_positions(policy, cache),
            torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8),
            torch.ones(b, dtype=torch.long),
            attend=attend,
        )
        return engine.backend.step(inputs, cache, StatsRequest())

    attend = []
    for mask in kept:
        counts = mask.sum(-1)
        idx = torch.sort(torch.where(mask, torch.arange(mask.shape[-1]), mask.shape[-1]), -1).values
        attend.append(AttendIndex(idx[..., : int(counts.max())].clamp(max=mask.shape[-1] - 1), counts))
    assert small.lengths().sum() < full.lengths().sum()
    got, ref = step(small), step(full, attend)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    # statistics of the attend path are over what was really attended, scattered back to slots
    for layer, (a, r, mask) in enumerate(zip(got.stats, ref.stats, kept)):
        for i in range(b):
            for h in range(mask.shape[1]):
                g = engine.backend.num_heads // mask.shape[1]
                slots = torch.cat([mask[i, h].nonzero().squeeze(-1), full.lengths()[layer, i, None] - 1])
                heads = slice(h * g, (h + 1) * g)
                n_small = int(small.lengths()[layer, i])
                torch.testing.assert_close(
                    r.colsum[i, heads, slots], a.colsum[i, heads, :n_small], atol=1e-5, rtol=1e-4
                )
                assert float(r.colsum[i, heads].sum()) == pytest.approx(
                    float(r.colsum[i, heads, slots].sum())
                )


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2-vl"])
def test_budget_one_is_the_full_cache(name, engines, images):
    engine = engines[name]
    prompts = [Prompt("Tell me about these.", [images[0], images[2]]), Prompt("Only text.")]
    base = engine.generate(prompts, make_policy("full"), max_new_tokens=5)
    for policy in ("vlcache", "pyramidkv", "avl"):
        res = engine.generate(prompts, make_policy(policy, budget=1.0), max_new_tokens=5)
        assert [s.token_ids for s in res.samples] == [s.token_ids for s in base.samples], policy
        assert res.kv_bytes_used == base.kv_bytes_used
