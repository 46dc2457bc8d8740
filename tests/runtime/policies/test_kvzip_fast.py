"""``kvzip`` / ``kvgrad`` fast scoring against the exact pass: same scores (fp32 rounding), same kept
sets; and scores that depend on nothing after the context (query-agnostic)."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.backend import StepInputs, StepStats
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Modality, Prompt
from vlkv.runtime.replay import replay_attention_max
from vlkv.runtime.replay_dtype import replay_layers
from vlkv.runtime.replay_fast import (
    ROW_BLOCK,
    _blocked_lse,
    attend_and_score,
    attention_with_lse,
    scores_from_lse,
)

TEXT = "The cat sat on the mat while the dog slept by the warm fire all night long."
# the fast scoring pass (exact=False) at the reference's precision and with its exact gradient: the
# defaults (a bf16 replay where the hardware has bf16 units, attn_grad="values") are approximations
# with their own stated bounds (test_replay_grad.py)
FP32_FULL = dict(replay_dtype="model", attn_grad="full")


def _prompts(images):
    return [Prompt(TEXT, [images[0]]), Prompt("Two pictures here.", [images[1], images[2]]), Prompt("Hi.")]


def _scores_and_edits(engine, prompts, name, **kw):
    policy = make_policy(name, **kw)
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), cache)
    ctx = engine.context(batch)
    stats = StepStats([None] * len(cache.layers))
    stats.replay = engine.replay(policy, ctx, batch, cache)
    return stats.replay, policy.after_prefill(cache, stats, ctx)


def _kept_sets(edits):
    """Per layer, sample and KV head the set of kept slots (holes excluded)."""
    out = []
    for e in edits:
        for b in range(e.index.shape[0]):
            n = int(e.keep_len[b])
            for h in range(e.index.shape[1]):
                idx = e.index[b, h, :n]
                if e.holes is not None:
                    idx = idx[~e.holes[b, h, :n]]
                out.append(set(idx.tolist()))
    return out


@pytest.mark.parametrize("model", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize(
    ("name", "chunk_size", "value_norm"),
    [
        ("kvzip", 5, False),
        ("kvzip", 4096, False),
        ("kvzip", 5, True),
        ("kvgrad", 4, False),
        ("kvgrad", 512, False),
    ],
)
def test_fast_scores_equal_the_exact_pass(engines, images, model, name, chunk_size, value_norm):
    engine = engines[model]
    kw = dict(budget=0.3, chunk_size=chunk_size, value_norm=value_norm)
    fast, _ = _scores_and_edits(engine, _prompts(images), name, **FP32_FULL, **kw)
    exact, _ = _scores_and_edits(engine, _prompts(images), name, exact=True, **kw)
    for layer, (f, e) in enumerate(zip(fast, exact)):
        assert float(e.max()) > 0
        # fp32: the same probabilities, exp(l - lse) against softmax(l)
        torch.testing.assert_close(f, e, atol=1e-6 * float(e.max()), rtol=1e-4, msg=f"layer {layer}")


@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
@pytest.mark.parametrize("heads", ["adaptive", "own", "shared"])
@pytest.mark.parametrize("budget", [0.5, 0.25, 0.1])
def test_fast_path_keeps_the_exact_sets(engines, images, name, heads, budget):
    engine = engines["tiny-llava"]
    kw = dict(budget=budget, heads=heads, chunk_size=6)
    _, fast = _scores_and_edits(engine, _prompts(images), name, **FP32_FULL, **kw)
    _, exact = _scores_and_edits(engine, _prompts(images), name, exact=True, **kw)
    assert _kept_sets(fast) == _kept_sets(exact)
    assert [e.keep_len.tolist() for e in fast] == [e.keep_len.tolist() for e in exact]


def _kept_after_question(engine, context: str, question: str, policy) -> tuple[int, list[set]]:
    """Prefill ``context``, compress with ``policy``, feed ``question`` teacher-forced: the context's
    length and per layer and KV head the context entries (by order) still held."""
    batch = engine.encode([Prompt(context)])
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    n = int(batch.lengths[0])
    ids = torch.tensor([engine.tokenizer(question, add_special_tokens=False)["input_ids"]], dtype=torch.long)
    t = ids.shape[1]
    pos = engine.decode_positions(policy, cache) + torch.arange(t)[None, :, None]
    modality = torch.full((1, t), int(Modality.GENERATED), dtype=torch.int8)
    engine.backend.step(StepInputs(ids, pos, modality, torch.tensor([t])), cache, None)
    out = []
    for layer in cache.layers:
        held = layer.valid_mask()[:, None, :].expand(-1, layer.order.shape[1], -1)
        if layer.holes is not None:
            held = held & ~layer.holes[:, :, : held.shape[2]]
        order = layer.order[:, :, : held.shape[2]]
        for h in range(order.shape[1]):
            kept = order[0, h][held[0, h]]
            out.append(set(kept[kept < n].tolist()))
    return n, out


@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
@pytest.mark.parametrize("exact", [False, True])
def test_scores_do_not_depend_on_the_question(engines, name, exact):
    engine = engines["tiny-llava"]
    a = _kept_after_question(
        engine, TEXT, " Where did the dog sleep?", make_policy(name, budget=0.3, exact=exact)
    )
    b = _kept_after_question(
        engine,
        TEXT,
        " Name every animal in the story and say what colour each one was.",
        make_policy(name, budget=0.3, exact=exact),
    )
    assert a == b
    n, kept = a
    # compressed (heads keep their own counts: the mean is the budget), before and after the question
    assert all(len(s) > 0 for s in kept) and sum(map(len, kept)) < 0.4 * n * len(kept)


def _random_case(b, h, hkv, r, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, r, d, generator=g)
    k = torch.randn(b, hkv, s + r, d, generator=g)
    v = torch.randn(b, hkv, s + r, d, generator=g)
    cache_len = torch.tensor([s, max(1, s // 2)][:b])
    new_len = torch.tensor([r, max(0, r - 3)][:b])
    return q, k, v, cache_len, new_len


def _mask(cache_len, new_len, s, r):
    from vlkv.runtime.replay import _replay_mask

    return _replay_mask(cache_len, new_len, s, r, torch.device("cpu"))[:, None]


@pytest.mark.parametrize("r", [1, 9, ROW_BLOCK + 1, 729])
def test_attention_with_lse_and_the_blocked_fallback(r):
    s, scale = 81, 0.125
    q, k, v, cache_len, new_len = _random_case(2, 4, 2, r, s, 16)
    mask = _mask(cache_len, new_len, s, r)
    out, lse = attention_with_lse(q, k, v, mask, scale)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    want_lse = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # the non-CPU form (SDPA + row-blocked log-sum-exp) gives the same row statistics
    torch.testing.assert_close(_blocked_lse(q, k, mask, scale), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("r", [1, 9, ROW_BLOCK + 1, 729])
def test_scores_from_lse_equal_the_reference(r):
    s, scale = 81, 0.125
    q, k, v, cache_len, new_len = _random_case(2, 4, 2, r, s, 16, seed=r)
    k[1, :, int(cache_len[1]) : s] = 1e4  # spare slots may hold anything (finite, as SDPA needs)
    mask = _mask(cache_len, new_len, s, r)
    _, lse = attention_with_lse(q, k, v, mask, scale)
    row = torch.rand(2, r)
    row[0, 0] = 0.0  # a zero gradient weight
    col = torch.rand(2, 4, s)
    for kw in ({}, dict(row_weight=row, col_weight=col)):
        got = scores_from_lse(q, k[:, :, :s], scale, lse, cache_len, new_len, **kw)
        want = replay_attention_max(q, k, scale, cache_len, new_len, **kw)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("r", [1, 9, ROW_BLOCK + 1, 729])
def test_attend_and_score_equal_sdpa_and_the_reference(r):
    s, scale = 81, 0.125
    q, k, v, cache_len, new_len = _random_case(2, 4, 2, r, s, 16, seed=r + 1)
    k[1, :, int(cache_len[1]) : s] = 1e4  # spare slots may hold anything finite
    mask = _mask(cache_len, new_len, s, r)
    out, scores = attend_and_score(q, k, v, scale, cache_len, new_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        scores, replay_attention_max(q, k, scale, cache_len, new_len), atol=1e-6, rtol=1e-4
    )


@pytest.mark.parametrize("value_norm", [False, True])
def test_kvzip_replay_builds_no_autograd_graph(engines, images, value_norm):
    """Only kvgrad needs gradients: kvzip's replay runs its layers without recording a graph."""
    engine = engines["tiny-llava"]
    seen = []
    # the layers the default replay runs: the model's, or their bf16 copy on hardware with bf16 units
    layers = replay_layers(engine.backend.adapter.layers, make_policy("kvzip").replay_dtype)
    hook = layers[-1].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).requires_grad)
    )
    try:
        with torch.enable_grad():
            _scores_and_edits(engine, _prompts(images), "kvzip", budget=0.3, value_norm=value_norm)
    finally:
        hook.remove()
    assert seen and not any(seen)
