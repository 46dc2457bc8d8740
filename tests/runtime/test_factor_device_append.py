"""The Triton path's device append (``fused_append.device_decode_append``) on a decode step whose factors
are read in place (AttentionPack, ``StepContext.reads_factors_paged``) against the cache's own append
(``StepContext.update``, ``fused_append.DEVICE_APPEND`` off), under the interpreter: two attnpack
requests (ranks 4 and 2, the second's factor rows at an offset) beside an h2o request, tiny LLaVA fp32.
The same logits bit for bit at every step, the same attended counts, tokens, tables, K/V rows and
factors (``kbar``, ``dk``, ``vbar``, ``dv``, ranks), and the device append taken in every decode layer."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_static_step import _admit_all, _engine, _layer_state, _recorded, _torch_path
from vlkv.runtime import fused_append
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 3
SPECS = (
    ("attnpack", {"rank": 4, "exact": True}, [0]),
    ("attnpack", {"rank": 2, "exact": True}, [1]),
    ("h2o", {"budget": 0.5}, []),
)
TEXTS = ("Describe the picture.", "What is in it?", "Hi")
_BY_ROWS = fused_append._append_by_rows  # the real one (each run spies on it)


def _run(engine, outs: list, device_append: bool, monkeypatch) -> tuple:
    """``STEPS`` decode steps of the three requests (prefills on the PyTorch path): each step's outputs,
    the requests, the layers whose append the device append took, and the scheduler."""
    monkeypatch.setattr(fused_append, "DEVICE_APPEND", device_append)
    taken = []

    def spy(step, layer_idx, rows, *a, **k):
        if any(r.lowrank is not None for r in rows):
            taken.append(layer_idx)
        return _BY_ROWS(step, layer_idx, rows, *a, **k)

    monkeypatch.setattr(fused_append, "_append_by_rows", spy)
    sched = Scheduler(engine, pool_bytes=1 << 23)
    reqs = [
        sched.submit(
            Request(Prompt(t, [make_image(i) for i in im]), make_policy(p, **kw), 16, stop_at_eos=False)
        )
        for t, (p, kw, im) in zip(TEXTS, SPECS)
    ]
    with _torch_path():
        _admit_all(sched, reqs)
    assert all(la.lowrank is not None for r in reqs[:2] for la in r.cache.layers)
    n = len(outs)
    for _ in range(STEPS):
        sched.step()
    return outs[n:], reqs, taken, sched


def test_the_device_append_of_a_factored_step_equals_the_caches_own_append(monkeypatch):
    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    outs = _recorded(engine)
    want, want_reqs, off, want_sched = _run(engine, outs, False, monkeypatch)
    got, got_reqs, on, got_sched = _run(engine, outs, True, monkeypatch)
    layers = engine.backend.num_layers
    assert off == [] and on == list(range(layers)) * STEPS  # taken in every decode layer
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(b.logits, a.logits), step
        assert torch.equal(b.attended, a.attended), step
    assert [r.tokens for r in got_reqs] == [r.tokens for r in want_reqs]
    for a, b in zip(want_reqs, got_reqs):
        for layer, ((ta, kva), (tb, kvb)) in enumerate(
            zip(_layer_state(a, want_sched.pool), _layer_state(b, got_sched.pool))
        ):
            assert all(torch.equal(x, y) for x, y in zip(ta, tb)), layer
            assert all(torch.equal(x, y) for x, y in zip(kva, kvb)), layer
        for la, lb in zip(a.cache.layers, b.cache.layers):
            if la.lowrank is None:
                assert lb.lowrank is None
                continue
            fa, fb = la.lowrank.samples[0], lb.lowrank.samples[0]
            for name in ("kbar", "dk", "vbar", "dv", "rank_k", "rank_v"):
                assert torch.equal(getattr(fa, name), getattr(fb, name)), name
