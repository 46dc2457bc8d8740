"""AttentionPack's decode steps on the Triton path read their pre-RoPE factors in place
(``StepContext.reads_factors_paged`` → ``triton_paged_lowrank``, the forced-Triton engine under the
interpreter): an attnpack request batched beside a full and an h2o request gives the logits (every step's,
within the dtype's tolerance: the kernel sums the values in the rank space where the rebuild rounds each
row) and tokens it gave when its factored rows were rebuilt densely (``LowRank.fill``, ``PAGED_FACTORS``
off), and so do its neighbours; 1-D RoPE (tiny-llava) and M-RoPE (tiny-qwen2-vl)."""

from __future__ import annotations

import pytest
import torch

import vlkv.runtime.step_context as step_context
from vlkv.plugins.ops import FORCE_TRITON_ENV
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

NEW = 4
# logits of the paged read against the dense rebuild (fp32 models): the values' rank-space sum differs
# from the rounded rows' in the last bits, through every layer; measured within 1e-5 on both models
LOGIT_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4)}
SPECS = (("attnpack", {"rank": 4, "exact": True}), ("full", {}), ("h2o", {"budget": 0.5}))


@pytest.fixture(scope="module")
def triton_engines():
    """name → an Engine behind the forced-Triton backend (HF layers, not the device layer: its glue
    kernels under the interpreter are test_device_layer.py's subject), built on first use."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models import device_layer
    from vlkv.runtime.models.registry import load_model

    mp = pytest.MonkeyPatch()
    mp.setenv(FORCE_TRITON_ENV, "1")
    mp.setattr(device_layer, "DEVICE_LAYER", False)
    built: dict = {}
    yield lambda name: built.setdefault(name, Engine(load_model(name)))
    mp.undo()


def _tokens(engine, images, specs=SPECS, new: int = NEW) -> tuple[list[list[int]], list]:
    """Each request's tokens, and every backend step's logits in order."""
    logits, real = [], engine.backend.step

    def step(inputs, cache, stats=None):
        out = real(inputs, cache, stats)
        logits.append(out.logits.detach().clone())
        return out

    engine.backend.step = step
    try:
        return _run(engine, images, specs, new), logits
    finally:
        del engine.backend.step  # the instance attribute off: the class's method again


def _run(engine, images, specs=SPECS, new: int = NEW) -> list[list[int]]:
    sched = Scheduler(engine)
    # one image (the factored one): the interpreter's launches cost by the columns they walk
    prompts = [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("What is a cache?"),
        Prompt("Write a short poem about caches."),
    ]
    reqs = [
        sched.submit(Request(p, make_policy(name, **kw), new, stop_at_eos=False))
        for p, (name, kw) in zip(prompts, specs)
    ]
    sched.run()
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return [list(r.tokens) for r in reqs]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_attnpack_beside_full_and_h2o_reads_its_factors_paged_with_the_same_tokens(
    name, triton_engines, images, monkeypatch
):
    import vlkv.plugins.triton_paged_lowrank as tpl
    from vlkv.runtime.kv import lowrank

    engine = triton_engines(name)
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    launches, real = [], tpl.paged_lowrank_probs_triton
    monkeypatch.setattr(
        tpl, "paged_lowrank_probs_triton", lambda *a, **k: launches.append(1) or real(*a, **k)
    )
    fills, fill = [], lowrank.LowRank.fill
    monkeypatch.setattr(lowrank.LowRank, "fill", lambda *a, **k: fills.append(1) or fill(*a, **k))
    monkeypatch.setattr(step_context, "PAGED_FACTORS", False)
    dense, dense_logits = _tokens(engine, images)
    assert not launches
    rebuilt = len(fills)
    fills.clear()
    monkeypatch.setattr(step_context, "PAGED_FACTORS", True)
    paged, paged_logits = _tokens(engine, images)
    # every decode step after the first reads each layer's factors through the kernel (statistics: attnpack
    # asks for them every step); the dense rebuild is left to the factoring itself
    layers = engine.backend.num_layers
    assert len(launches) >= (NEW - 1) * layers
    assert len(fills) <= rebuilt - (NEW - 1) * layers
    assert paged == dense
    assert len(paged_logits) == len(dense_logits) >= NEW
    dtype = paged_logits[0].dtype
    for step, (got, want) in enumerate(zip(paged_logits, dense_logits)):
        torch.testing.assert_close(got, want, **LOGIT_TOL[dtype], msg=f"step {step}")
    assert all(len(t) == NEW for t in paged)


POST_SPECS = (("attnpack", {"rank": 4, "exact": True, "path": "b"}), ("full", {}), ("h2o", {"budget": 0.5}))
POST_NEW = 3  # two decode steps after the first token: each reads every layer's factors


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_path_b_reads_its_post_rope_factors_paged_with_the_rank_space_logits(
    name, triton_engines, images, monkeypatch
):
    """AttentionPack path (b) beside full + h2o: with ``PAGED_FACTORS`` off its decode steps attend in
    the rank space eagerly (``_rank_space_one_row``); on, through the low-rank kernel's rank-space
    logits, and every step's logits agree within 1e-4 (fp32: the same sums in another order)."""
    import vlkv.plugins.triton_paged_lowrank as tpl

    engine = triton_engines(name)
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    launches, real = [], tpl.paged_lowrank_probs_triton
    monkeypatch.setattr(
        tpl, "paged_lowrank_probs_triton", lambda *a, **k: launches.append(a[6]) or real(*a, **k)
    )
    eager, rank_space = [], step_context._rank_space_one_row
    monkeypatch.setattr(
        step_context, "_rank_space_one_row", lambda *a, **k: eager.append(1) or rank_space(*a, **k)
    )
    monkeypatch.setattr(step_context, "PAGED_FACTORS", False)
    want, want_logits = _tokens(engine, images, POST_SPECS, POST_NEW)
    assert not launches and len(eager) >= (POST_NEW - 1) * engine.backend.num_layers
    eager.clear()
    monkeypatch.setattr(step_context, "PAGED_FACTORS", True)
    got, got_logits = _tokens(engine, images, POST_SPECS, POST_NEW)
    assert not eager and len(launches) >= (POST_NEW - 1) * engine.backend.num_layers
    assert all(bool(f.post_rope.any()) for f in launches)  # the kernel was told: path (b)
    assert got == want
    assert len(got_logits) == len(want_logits) >= POST_NEW
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        torch.testing.assert_close(a, b, **LOGIT_TOL[a.dtype], msg=f"step {step}")
