"""The runtime through the Triton kernels (interpreter on CPU) equals the runtime through the
references: prefill statistics and A-VL's core-only decode attention."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins.ops import FORCE_TRITON_ENV
from vlkv.runtime.backend import StatsRequest, StepInputs
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")


def _prompts(images):
    return [
        Prompt("What is in this picture?", [images[0]]),
        Prompt("Compare these two.", [images[1], images[2]]),
    ]


def _prefill_stats(engine, prompts):
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    rows = torch.arange(batch.input_ids.shape[1])[None, :] >= (batch.lengths - 6)[:, None]
    inputs = StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
    )
    return engine.backend.step(inputs, cache, StatsRequest(rows=rows, threshold=0.05)).stats


def _avl_trace(engine, prompts, tokens):
    """Logits of A-VL decode steps fed the same tokens; steps 1-2 attend to the core only."""
    policy = make_policy("avl", budget=0.6, core=0.3, interval=3)
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    logits = [engine.prefill(batch, policy, cache).logits]
    attended = []
    for t in range(1, 4):
        out = engine.decode(tokens[t - 1], batch, policy, cache, t)
        logits.append(out.logits)
        attended.append(out.attended)
    return logits, attended


def test_stats_and_core_attention_match_references(engines, images, monkeypatch):
    engine = engines["tiny-llava"]
    prompts = _prompts(images)
    tokens = [torch.tensor([5, 6]), torch.tensor([7, 8]), torch.tensor([9, 10])]
    ref_stats = _prefill_stats(engine, prompts)
    ref_logits, ref_attended = _avl_trace(engine, prompts, tokens)

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    ker_stats = _prefill_stats(engine, prompts)
    ker_logits, ker_attended = _avl_trace(engine, prompts, tokens)

    for layer, (r, k) in enumerate(zip(ref_stats, ker_stats)):
        torch.testing.assert_close(k.colsum, r.colsum, rtol=1e-4, atol=1e-5, msg=f"layer {layer}")
        assert torch.equal(k.below, r.below) and torch.equal(k.visible, r.visible)
    for step, (r, k) in enumerate(zip(ref_logits, ker_logits)):
        torch.testing.assert_close(k, r, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    # the core-only steps really computed over fewer entries than the cache holds
    assert all(torch.equal(a, b) for a, b in zip(ker_attended, ref_attended))
    assert bool((ref_attended[0] < ref_attended[2]).any())
