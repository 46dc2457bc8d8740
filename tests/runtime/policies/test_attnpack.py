"""The ``attnpack`` policy: full rank gives the full cache's tokens, low ranks hold fewer bytes,
importance picks the rows reconstructed at full rank, recompression and eviction compose, bad
settings are refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.cli_refusal import (
    refused as _refused,
)  # the no_model_compute fixture: tests/runtime/conftest.py
from vlkv.runtime.cache import Modality
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.attnpack import SCORE
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl"]


def _prompts(images):
    return [
        Prompt("Just text, no picture.", []),
        Prompt("What is in the picture?", [make_image(7, 96)]),
        Prompt("Compare the two pictures.", [images[0], make_image(8, 160)]),
    ]


@pytest.mark.parametrize("name", MODELS)
def test_full_rank_gives_the_full_cache_tokens(name, engines, images):
    engine = engines[name]
    prompts = _prompts(images)
    want = engine.generate(prompts, make_policy("full"), 12, stop_at_eos=False)
    got = engine.generate(prompts, make_policy("attnpack", rank=10**6, exact=True), 12, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_low_rank_holds_fewer_bytes_and_marks_important_rows(name, engines, images):
    engine = engines[name]
    prompts = _prompts(images)
    batch = engine.encode(prompts)
    policy = make_policy("attnpack", rank=4, rank_lo=1, top_fraction=0.25)
    full = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), full)
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    assert cache.kv_bytes() < full.kv_bytes()
    for layer in cache.layers:
        img = (layer.modality == int(Modality.IMAGE)) & layer.valid_mask()[:, None, :]
        assert bool((layer.slots[img] < 0).all()) and bool(
            (layer.slots[~img & layer.valid_mask()[:, None, :]] >= 0).all()
        )
        for s, f in enumerate(layer.lowrank.samples):
            if s == 0:
                assert f is None
                continue
            hi = f.rank_v == 4
            assert int(hi.sum()) == -(-f.rows // 4)  # ceil(top_fraction · rows)
            # the rows at full rank are those the last query row attended to most
            named = (layer.slots[s] < 0) & layer.valid_mask()[s][None, :]
            imp = torch.full((f.rows,), float("-inf")).scatter_reduce_(
                0, -layer.slots[s][named] - 1, layer.scores[SCORE][s][named], "amax"
            )
            assert float(imp[hi].min()) >= float(imp[~hi].max())


def test_decode_updates_importance_by_ema(engines, images):
    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe it.", [images[2]])]
    policy = make_policy("attnpack", rank=8, alpha=0.5)
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    before = cache.layers[0].scores[SCORE][0, 0, : int(cache.layers[0].lengths[0])].clone()
    out = engine.decode(torch.tensor([5]), batch, policy, cache, 1)
    after = cache.layers[0].scores[SCORE][0, 0, : before.numel()]
    assert out is not None and not torch.equal(before, after)
    # EMA with α = 0.5: every entry moves at most half-way towards a weight in [0, 1]
    assert bool((after >= 0.5 * before - 1e-6).all()) and bool((after <= 0.5 * before + 0.5 + 1e-6).all())


def test_compress_text_recompresses_every_t_new_tokens(engines, images):
    engine = engines["tiny-llava"]
    prompt = [Prompt("Tell me a story about it.", [images[0]])]
    policy = make_policy("attnpack", rank=16, compress_text=True, recompress_every=4)
    res = engine.generate(prompt, policy, 10, stop_at_eos=False)
    # every processed token is kept (the last generated one is never run through the model)
    assert res.samples[0].kept_per_layer[0] == res.samples[0].prompt_tokens + 9
    batch = engine.encode(prompt)
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    tok = torch.tensor([7])
    for step in range(1, 7):
        engine.decode(tok, batch, policy, cache, step)
        layer = cache.layers[0]
        dense = int(((layer.slots >= 0) & layer.valid_mask()[:, None, :])[0, 0].sum())
        assert dense == step % 4


def test_evict_then_factor_composes(engines, images):
    engine = engines["tiny-llava"]
    prompts = _prompts(images)
    policy = make_policy("attnpack", rank=2, evict="h2o", budget=0.5)
    res = engine.generate(prompts, policy, 8, stop_at_eos=False)
    alone = engine.generate(prompts, make_policy("h2o", budget=0.5), 8, stop_at_eos=False)
    assert [s.kept_per_layer for s in res.samples] == [s.kept_per_layer for s in alone.samples]
    assert res.kv_bytes_used < alone.kv_bytes_used


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("rank=0", "rank must be >= 1, got 0"),
        ("rank_lo=65", "rank_lo must be in [1, rank=64], got 65"),
        ("top_fraction=0", "top_fraction must be in (0.0, 1.0], got 0"),
        ("top_fraction=1.5", "top_fraction must be in (0.0, 1.0], got 1.5"),
        ("alpha=1", "alpha must be in [0, 1), got 1"),
        ("recompress_every=0", "recompress_every must be >= 1, got 0"),
        ("path=c", "path must be 'a' (reconstruct) or 'b' (rank space), got 'c'"),
    ],
)
def test_bad_settings_are_one_line(capsys, no_model_compute, setting, needle):  # noqa: F811
    assert needle in _refused(capsys, "--policy", "attnpack", "--set", setting)


def test_the_policy_decides_and_the_engine_factors(engines, images):
    """The seam: ``after_prefill`` returns edits (evict, then factor) and leaves the K/V, the slot
    table and the pool alone; ``apply_edits`` does the factoring."""
    from vlkv.runtime.backend import StepStats
    from vlkv.runtime.edits import apply_edits
    from vlkv.runtime.policies import FactorEdit, LayerEdit

    engine = engines["tiny-llava"]
    batch = engine.encode(_prompts(images))
    policy = make_policy("attnpack", rank=4, evict="snapkv", budget=0.6)
    cache = engine.new_cache(batch)
    ctx = engine.context(batch)
    rows = batch.input_ids.shape[1]
    from vlkv.runtime.backend import StepInputs

    embeds = engine.backend.embed(batch)
    inputs = StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, embeds)
    out = engine.backend.step(inputs, cache, policy.prefill_request(ctx, rows))
    before = ([layer.slots.clone() for layer in cache.layers], cache.pool.used_bytes(), cache.kv_bytes())
    edits = policy.after_prefill(cache, StepStats(out.stats, out.stats.extra), ctx)
    assert all(torch.equal(a, layer.slots) for a, layer in zip(before[0], cache.layers))
    assert (cache.pool.used_bytes(), cache.kv_bytes()) == before[1:]
    assert all(layer.lowrank is None for layer in cache.layers)
    assert all(isinstance(e, LayerEdit) and isinstance(f, FactorEdit) for e, f in edits)
    apply_edits(cache, edits)
    assert cache.kv_bytes() < before[2] and any(layer.lowrank is not None for layer in cache.layers)
    with pytest.raises(ValueError, match="rank_lo"):
        FactorEdit(rank=4, importance=SCORE, rank_lo=8)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # image-only: decode steps never due (their generated entries are not factored)
        {"compress_text": True, "recompress_every": 3},  # due every 3 steps
        {"compress_text": True, "recompress_every": 3, "evict": "h2o", "budget": 0.5},  # fewer than the bound
        {
            "compress_text": True,
            "recompress_every": 3,
            "evict": "elastic",
            "budget": 0.5,
        },  # merged at prefill
    ],
    ids=["image", "text", "text-h2o", "text-elastic"],
)
def test_the_host_knows_which_samples_are_due(kw, engines, images, monkeypatch):
    """A decode step's factor edit carries the samples due, decided on the host (no read back): at every
    edit of a generation, the same samples the table's counts make due."""
    from vlkv.runtime.kv import lowrank

    real, seen = lowrank.factor_due, []

    def checked(layer, edit):
        if edit.due is not None:
            counted = lowrank.factorable(layer, edit.modalities).sum(-1).amax(-1) >= edit.threshold
            assert list(edit.due) == counted.tolist(), (len(seen), edit.due)
            seen.append(edit.due)
        real(layer, edit)

    monkeypatch.setattr(lowrank, "factor_due", checked)  # edits.py imports it when it applies
    engine = engines["tiny-llava"]
    policy = make_policy("attnpack", rank=4, **kw)
    engine.generate(_prompts(images), policy, 8, stop_at_eos=False)
    batch = engine.encode(_prompts(images))  # and a batch of three (ragged, one without an image)
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    for step in range(1, 7):
        engine.decode(torch.full((3,), 7), batch, policy, cache, step)
    assert seen and any(len(d) == 3 for d in seen)  # the decode steps' edits were decided on the host
    assert any(any(d) for d in seen) == bool(kw)  # text: recompressed through the host's decision


@pytest.mark.parametrize("name", MODELS)
def test_path_b_at_full_rank_gives_the_full_cache_tokens(name, engines, images):
    """Post-RoPE factors attended in the rank space: lossless at full rank, M-RoPE included."""
    engine = engines[name]
    prompts = _prompts(images)
    want = engine.generate(prompts, make_policy("full"), 10, stop_at_eos=False)
    got = engine.generate(
        prompts, make_policy("attnpack", rank=10**6, exact=True, path="b"), 10, stop_at_eos=False
    )
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]


@pytest.mark.parametrize("evict", ["", "snapkv"])
def test_path_b_equals_reconstructing_the_same_factors(evict, engines, images, monkeypatch):
    """At low rank (and attention-aware ranks per row), decode steps that attend in the rank space
    give the logits and importance scores of reconstructing the same post-RoPE factors densely, and
    never rebuild the image K/V; per-head evictions (snapkv first) keep each head to its own rows."""
    import copy

    import vlkv.runtime.kv.lowrank as lowrank
    from vlkv.runtime.step_context import StepContext

    engine = engines["tiny-llava"]
    prompts = _prompts(images)
    batch = engine.encode(prompts)
    kwargs = dict(evict=evict, budget=0.6) if evict else {}
    policy = make_policy("attnpack", rank=6, rank_lo=2, path="b", **kwargs)
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    assert all(layer.lowrank is not None and layer.lowrank.post_rope for layer in cache.layers)
    other = copy.deepcopy(cache)
    fills = []
    real_fill = lowrank.LowRank.fill
    monkeypatch.setattr(lowrank.LowRank, "fill", lambda *a: fills.append(1) or real_fill(*a))

    def steps(c, pol):
        tok, logits = torch.tensor([5, 9, 11]), []
        for step in range(1, 4):
            out = engine.decode(tok, batch, pol, c, step)
            logits.append(out.logits)
            tok = out.logits.argmax(-1)
        return torch.stack(logits), [lay.scores[SCORE].clone() for lay in c.layers]

    pol_b = copy.deepcopy(policy)
    got, got_scores = steps(cache, pol_b)
    assert not fills  # the dense image K/V were never rebuilt
    monkeypatch.setattr(StepContext, "_rank_space", lambda self, layer: False)
    want, want_scores = steps(other, copy.deepcopy(policy))
    assert fills
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_scores, want_scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
