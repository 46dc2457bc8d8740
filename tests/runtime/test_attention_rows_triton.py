"""A statistics decode step on the Triton path (``attention_rows._paged_one_row`` with the forced-Triton
engine): its output and probabilities come from ``paged_probs.triton_decode_probs`` (one in-place read),
and the tokens equal those of the two halves it replaced (``TRITON_PROBS`` off, the CPU kernel off)."""

from __future__ import annotations

import pytest

from vlkv.plugins.ops import FORCE_TRITON_ENV
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

NEW = 4
# per-step statistics policies; avl with a small text floor evicts on tiny prompts too
POLICIES = (("h2o", {"budget": 0.5}), ("avl", {"budget": 0.5, "text_min": 2}))


@pytest.fixture(scope="module")
def engine():
    """tiny LLaVA (fp32) behind the forced-Triton backend, shared by the tests (the env switch is read
    when the backend is built and when each op dispatches). The HF layer, not the device layer: its
    glue kernels under the interpreter would triple the time and are test_device_layer.py's subject."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models import device_layer
    from vlkv.runtime.models.registry import load_model

    mp = pytest.MonkeyPatch()
    mp.setenv(FORCE_TRITON_ENV, "1")
    mp.setattr(device_layer, "DEVICE_LAYER", False)
    yield Engine(load_model("tiny-llava"))
    mp.undo()


def test_triton_statistics_step_tokens_equal_the_halves(engine, images, monkeypatch):
    import vlkv.plugins.paged_cpu as paged_cpu
    import vlkv.plugins.paged_probs as paged_probs
    import vlkv.plugins.triton_paged_probs as tpp

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)  # the reference: the GPU path's two halves
    launches, real = [], tpp.paged_probs_triton
    monkeypatch.setattr(tpp, "paged_probs_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    prompts = [Prompt("Describe the picture.", [images[0]]), Prompt("Write a short poem about caches.")]
    for name, settings in POLICIES:
        monkeypatch.setattr(paged_probs, "TRITON_PROBS", True)
        launches.clear()
        fast = engine.generate(prompts, make_policy(name, **settings), NEW, stop_at_eos=False)
        assert launches, f"{name}: no decode step read its statistics through the Triton kernel"
        monkeypatch.setattr(paged_probs, "TRITON_PROBS", False)
        launches.clear()
        ref = engine.generate(prompts, make_policy(name, **settings), NEW, stop_at_eos=False)
        assert not launches
        assert [s.token_ids for s in fast.samples] == [s.token_ids for s in ref.samples], name
        assert all(len(s.token_ids) == NEW for s in fast.samples)


def test_exact_output_keeps_the_plain_read(engine, monkeypatch):
    """At budget 1 (``exact_output``) the step's output is the plain paged read's, bit for bit, and its
    statistics still come from the kernel: the tokens equal the full cache's."""
    import vlkv.plugins.triton_paged_probs as tpp

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    launches, real = [], tpp.paged_probs_triton
    monkeypatch.setattr(tpp, "paged_probs_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    prompts = [Prompt("Count the caches, then the pages.")]
    want = engine.generate(prompts, make_policy("full"), NEW, stop_at_eos=False)
    got = engine.generate(prompts, make_policy("h2o", budget=1.0), NEW, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert launches
