"""A-VL: validation, hand-checked core refresh and text H2O, prefill filter, exactness at 100%."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.policies.reference import eager_attentions, filtered_forward
from vlkv.plugins import AttnStats
from vlkv.runtime.backend import RowFilter, StatsRequest, StepInputs, StepStats
from vlkv.runtime.cache import KVCache, LayerKV, Modality
from vlkv.runtime.edits import apply_edits
from vlkv.runtime.policies import PolicyContext, make_policy
from vlkv.runtime.policies.avl import CORE, LAST
from vlkv.runtime.prompt import Prompt, Spans


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(secondary=0.3, core=0.5), "core must be <= secondary"),
        (dict(budget=0.2, core=0.3), "core must be <= secondary"),
        (dict(interval=0), "interval"),
        (dict(interval=-2), "interval"),
        (dict(secondary=0.0), "secondary"),
        (dict(text=1.5), "text"),
        (dict(prefill_keep=0.0), "prefill_keep"),
        (dict(filter_layer=0), "filter_layer"),
        (dict(text_min=-1), "text_min"),
        (dict(heavy_ratio=2.0), "heavy_ratio"),
        (dict(positions="compacted"), "positions"),
    ],
)
def test_avl_rejects_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_policy("avl", **kwargs)


# ------------------------------------------------------------ hand-checked toy cache
# 1 layer, 1 sample, 2 query heads sharing 1 KV head; tokens: system 0-1, vision 2-7, text 8+.
SPANS = Spans(10, [(2, 8)])


def _toy(n: int) -> tuple[KVCache, PolicyContext]:
    layer = LayerKV.empty(1, 1, 2, 1, torch.float32, "cpu")
    k = torch.randn(1, 1, n, 2, generator=torch.Generator().manual_seed(0))
    layer.append(
        k, k.clone(), torch.arange(n)[None, :, None], torch.zeros(1, n, dtype=torch.int8), torch.tensor([n])
    )
    cache = KVCache([layer], torch.tensor([[n]]), torch.tensor([n]), torch.tensor([n]))
    return cache, PolicyContext([Spans(n, SPANS.image_spans)], torch.tensor([n]), 2, 1)


def _st(values: dict[int, float], cache: KVCache) -> AttnStats:
    """Stats whose head-mean column at the slot holding token t is ``values[t]`` (both heads equal)."""
    layer = cache.layers[0]
    tokens = layer.positions[0, 0, : layer.max_length, 0].tolist()
    col = torch.tensor([values.get(t, 0.0) for t in tokens])[None, None].expand(1, 2, -1).clone()
    return AttnStats(col, None, torch.ones(1, 2, dtype=torch.long))


def _tokens(cache: KVCache) -> list[int]:
    layer = cache.layers[0]
    return layer.positions[0, 0, : int(layer.lengths[0]), 0].tolist()


def _core(cache: KVCache) -> set[int]:
    layer = cache.layers[0]
    flags = layer.scores[CORE][0, 0, : int(layer.lengths[0])]
    return {t for t, f in zip(_tokens(cache), flags.tolist()) if f}


def _decode(policy, cache, ctx, step: int, col: dict[int, float]) -> list[int] | None:
    """One decode step on the toy cache; returns the past tokens the step attends (None = all)."""
    ctx.step = step
    plan = policy.decode_attend(cache, ctx)
    attended = None
    if plan is not None and plan[0] is not None:
        idx, n = plan[0].indices[0, 0], int(plan[0].lengths[0, 0])
        attended = [_tokens(cache)[i] for i in idx[:n].tolist()]
    t = int(cache.next_position[0, 0])
    cache.layers[0].append(
        torch.zeros(1, 1, 1, 2),
        torch.zeros(1, 1, 1, 2),
        torch.tensor([[[t]]]),
        torch.full((1, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.tensor([1]),
    )
    cache.processed += 1
    cache.next_position += 1
    apply_edits(cache, policy.after_decode(cache, StepStats([_st(col, cache)]), ctx))
    return attended


VISION_LAST_ROW = {2: 0.05, 3: 0.30, 4: 0.10, 5: 0.25, 6: 0.02, 7: 0.20}
STEP_COLS = [
    {3: 0.1, 5: 0.05, 7: 0.4},
    {3: 0.0, 5: 0.5, 7: 0.3},
    {3: 0.2, 5: 0.1, 7: 0.0},
    {3: 0.0, 5: 0.6, 7: 0.1},
]


def _prefill_toy(interval: int):
    # S = 50% of 6 vision tokens -> 3 kept, C = 1/3 -> 2 core; text kept whole
    policy = make_policy("avl", secondary=0.5, core=1 / 3, interval=interval, text=1.0)
    cache, ctx = _toy(10)
    stats = StepStats([_st({}, cache)], {LAST: [_st(VISION_LAST_ROW, cache)]})
    apply_edits(cache, policy.after_prefill(cache, stats, ctx))
    return policy, cache, ctx


def test_prefill_splits_vision_into_core_secondary_minor():
    _, cache, _ = _prefill_toy(interval=2)
    assert _tokens(cache) == [0, 1, 3, 5, 7, 8, 9]  # minor 2, 4, 6 evicted; system and text kept
    assert _core(cache) == {3, 5}


def test_interval_two_alternates_core_only_and_refresh_steps():
    policy, cache, ctx = _prefill_toy(interval=2)
    seen = [_decode(policy, cache, ctx, t, col) for t, col in enumerate(STEP_COLS, start=1)]
    # t=1: core {3,5}, vision 7 idle; t=2 full secondary, core -> top2 of {3:.0,5:.5,7:.3} = {5,7}
    # t=3: core-only over {5,7}; t=4 full, core -> {5,7} from {3:0,5:.6,7:.1}
    assert seen[0] == [0, 1, 3, 5, 8, 9]
    assert seen[1] is None
    assert seen[2] == [0, 1, 5, 7, 8, 9, 10, 11]
    assert seen[3] is None
    assert _core(cache) == {5, 7}
    assert _tokens(cache) == [0, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13]  # no secondary eviction while decoding


def test_interval_one_refreshes_the_core_every_step_from_that_steps_attention():
    policy, cache, ctx = _prefill_toy(interval=1)
    expect = [{3, 7}, {5, 7}, {3, 5}, {5, 7}]
    for t, (col, core) in enumerate(zip(STEP_COLS, expect), start=1):
        assert _decode(policy, cache, ctx, t, col) is None  # every step attends all secondary
        assert _core(cache) == core, f"step {t}"


def test_text_h2o_keeps_heavy_and_recent_text():
    policy = make_policy("avl", secondary=1.0, text=0.5, text_min=0, heavy_ratio=0.5)
    cache, ctx = _toy(12)
    text_rows = {8: 0.3, 9: 0.9, 10: 0.1, 11: 0.2}
    stats = StepStats([_st(text_rows, cache)], {LAST: [_st({}, cache)]})
    apply_edits(cache, policy.after_prefill(cache, stats, ctx))
    # 4 text tokens, rank round(0.5*4) = 2: the last one plus the heaviest older one (9)
    assert _tokens(cache)[8:] == [9, 11]
    # t=1: 5 text tokens seen, rank round(2.5) = 2 (half to even); scores 9: 1.8, 11: 0.4 + 1.0
    _decode(policy, cache, ctx, 1, {9: 0.0, 11: 0.5, 12: 0.1})
    assert _tokens(cache)[8:] == [9, 12]
    _decode(policy, cache, ctx, 2, {})  # rank 3, holds 3
    _decode(policy, cache, ctx, 3, {})  # rank round(3.5) = 4, holds 4
    assert _tokens(cache)[8:] == [9, 12, 13, 14]
    _decode(policy, cache, ctx, 4, {})  # rank 4, holds 5: recent 14, 15 + heaviest 9, 12
    assert _tokens(cache)[8:] == [9, 12, 14, 15]
    assert _tokens(cache)[:8] == list(range(8))  # system and vision untouched


# ------------------------------------------------------------ on tiny models
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_full_fractions_reproduce_full_cache(name, engines, images):
    engine = engines[name]
    prompts = [Prompt("What is shown?", [images[0], images[1]]), Prompt("Plain text prompt.")]
    base = engine.generate(prompts, make_policy("full"), max_new_tokens=6)
    for interval in (1, 2, -1):
        policy = make_policy("avl", budget=0.3, secondary=1.0, core=1.0, text=1.0, interval=interval)
        res = engine.generate(prompts, policy, max_new_tokens=6)
        assert [s.token_ids for s in res.samples] == [s.token_ids for s in base.samples]
        assert res.extras["kv_used_fraction"] == res.extras["kv_stored_fraction"] == 1.0


def test_core_only_decoding_uses_less_than_it_stores(engines, images):
    engine = engines["tiny-llava-next"]
    prompts = [Prompt("Describe it.", [images[0]]), Prompt("And these two?", [images[1], images[2]])]
    policy = make_policy("avl", budget=0.5, core=0.2, interval=3, text_min=4)
    batch = engine.encode(prompts)
    res = engine.generate(prompts, policy, max_new_tokens=6)
    ex = res.extras
    assert ex["kv_used_fraction"] < ex["kv_stored_fraction"] < 0.75
    for i, (sample, spans) in enumerate(zip(res.samples, batch.spans)):
        n_img = spans.post_vision - spans.first_image
        n_text = sample.prompt_tokens - spans.post_vision + res.decode_steps
        held_text = max(round(0.5 * n_text), 4)
        expect = spans.first_image + int(0.5 * n_img) + min(held_text, n_text)
        assert sample.kept_per_layer == [expect] * engine.backend.num_layers, f"sample {i}"


@pytest.mark.parametrize("extra", [{}, {"prefill_keep": 0.5}])
def test_a_core_as_large_as_the_secondary_set_leaves_no_vision_entry_idle(extra, engines, images):
    """With ``core`` defaulting to ``secondary`` every held vision entry is core at every step: no core
    flags are kept (no ``CORE`` table to rank, refresh or zero per appended column), every vision entry
    the prefill kept stays through decoding and ``decode_attend`` attends to everything without building
    per-layer masks."""
    from vlkv.runtime.policies.avl import REGION, VISION

    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Describe it.", [images[0]]), Prompt("And this, in detail?", [images[1]])])
    policy = make_policy("avl", budget=0.4, interval=2, **extra)
    assert not policy.tracks_core and make_policy("avl", budget=0.4, core=0.2).tracks_core
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    token = out.logits.argmax(-1)

    def vision_held() -> list[list[int]]:  # per layer, each sample's held vision entries (head 0)
        counts = []
        for layer in cache.layers:
            n = int(layer.lengths.max())
            vision = (layer.scores[REGION][:, 0, :n] == VISION) & layer.valid_mask(n)
            counts.append(vision.sum(-1).tolist())
        return counts

    kept = vision_held()
    assert all(min(row) > 0 for row in kept), "a layer holds no vision entry: the check would be empty"
    for t in range(1, 6):
        out = engine.decode(token, batch, policy, cache, t)
        token = out.logits.argmax(-1)
        assert all(CORE not in layer.scores for layer in cache.layers), f"step {t}"
        assert vision_held() == kept, f"step {t}"
        ctx = engine.context(batch)
        ctx.step = 1  # a core-only step (not a refresh)
        assert policy.decode_attend(cache, ctx) is None


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_prefill_filter_runs_later_layers_on_kept_rows(name, engines, loaded_models, images):
    engine = engines[name]
    batch = engine.encode([Prompt("Where is the light coming from?", [images[2]])])
    n, spans = int(batch.lengths[0]), batch.spans[0]
    emb = engine.backend.embed(batch)
    # the policy's choice: top-P vision rows by layer 1's last-row head-mean attention (eager)
    policy = make_policy("avl", prefill_keep=0.5, filter_layer=2)
    cache = engine.new_cache(batch)
    ctx = engine.context(batch)
    flt = policy.prefill_filter(cache, ctx)
    att = eager_attentions(loaded_models[name], emb, batch.positions)[1][0].mean(0)[-1]  # (n,)
    v0, v1 = spans.first_image, spans.post_vision
    top = torch.sort(att[v0:v1], descending=True, stable=True).indices[: int(0.5 * (v1 - v0))] + v0
    keep = sorted(set(range(n)) - set(range(v0, v1)) | set(top.tolist()))
    out = engine.backend.step(
        StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb, row_filter=flt),
        cache,
        policy.prefill_request(ctx, n),
    )
    assert cache.policy_state["avl_filter_rows"][0].nonzero().squeeze(-1).tolist() == keep
    assert cache.lengths()[:, 0].tolist() == [n, n] + [len(keep)] * (engine.backend.num_layers - 2)
    kept_pos = cache.layers[-1].positions[0, 0, : len(keep)]
    assert torch.equal(kept_pos, batch.positions[0, keep])  # original positions, holes included
    ref = filtered_forward(engine, emb, batch.positions, keep, after_layer=1)
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)


def test_row_filter_keeping_everything_changes_nothing(engines, images):
    engine = engines["tiny-qwen2-vl"]
    batch = engine.encode([Prompt("Hi.", [images[0]]), Prompt("Longer text without images here.")])
    emb = engine.backend.embed(batch)

    def run(flt):
        cache = engine.new_cache(batch)
        inputs = StepInputs(
            batch.input_ids, batch.positions, batch.modality, batch.lengths, emb, row_filter=flt
        )
        return engine.backend.step(inputs, cache, StatsRequest()).logits, cache

    keep_all = RowFilter(0, lambda stats, layer: torch.ones(batch.input_ids.shape, dtype=torch.bool))
    (a, ca), (b, cb) = run(None), run(keep_all)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(ca.lengths(), cb.lengths())


def test_prefill_filter_in_a_mixed_batch(engines, images):
    engine = engines["tiny-llava"]
    prompts = [
        Prompt("One.", [images[0]]),
        Prompt("Two of them.", [images[1], images[2]]),
        Prompt("No image."),
    ]
    batch = engine.encode(prompts)
    policy = make_policy("avl", secondary=1.0, core=1.0, text=1.0, prefill_keep=0.5, filter_layer=1)
    res = engine.generate(prompts, policy, max_new_tokens=3)
    for sample, spans in zip(res.samples, batch.spans):
        full = sample.prompt_tokens + res.decode_steps
        n_img = spans.num_image_tokens and spans.post_vision - spans.first_image
        filtered = full - (n_img - int(0.5 * n_img))
        assert sample.kept_per_layer == [full] + [filtered] * (engine.backend.num_layers - 1)
