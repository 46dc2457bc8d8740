"""Decode steps of an AttentionPack ``path="b"`` request (post-RoPE low-rank factors, read in the rank
space by the low-rank kernel) through the static step (``runtime/static_factors.py``: its ``post`` flag)
against the eager step, on the Triton path under the interpreter, beside a full and an h2o request: the
same logits, attended counts, statistics, tokens, tables and K/V rows; path (b)'s factored columns take
no rotary position."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_static_step import TOL, _assert_same_state, _engine, _recorded, _torch_path
from tests.runtime.test_static_step_factors import TEXTS, _paired_groups
from tests.runtime.test_static_step_stats import _assert_stats_equal
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.static_step import StaticDecode

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 2
SPECS = (("attnpack", {"rank": 4, "exact": True, "path": "b"}), ("full", {}), ("h2o", {"budget": 0.5}))


def _running(engine) -> tuple[Scheduler, list[Request]]:
    """A fixed-pool scheduler running a path (b) attnpack request over one image beside two text ones."""
    sched = Scheduler(engine, pool_bytes=1 << 23)
    images = ([make_image(0)], [], [])
    reqs = [
        sched.submit(Request(Prompt(t, im), make_policy(p, **kw), 16, stop_at_eos=False))
        for t, im, (p, kw) in zip(TEXTS, images, SPECS)
    ]
    with _torch_path():
        for _ in range(len(reqs)):
            if len(sched.running) == len(reqs):
                break
            sched.step()
    assert len(sched.running) == len(reqs)
    assert all(la.lowrank is not None and la.lowrank.post_rope for la in reqs[0].cache.layers)
    return sched, reqs


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_a_path_b_step_equals_the_eager_step(name, monkeypatch):
    dtype = torch.float32
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    eager, eager_reqs = _running(engine)
    static_sched, static_reqs = _running(engine)
    static = StaticDecode(engine.backend, capacity_step=64)
    for step in range(STEPS):
        for want, got in _paired_groups(engine, eager, static_sched, static, outs):
            torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
            assert torch.equal(got.attended, want.attended), step
            _assert_stats_equal(got.stats, want.stats, f"step {step}")
        (bufs,) = (b for key, b in static._bufs.items() if len(key) > 3)  # attnpack's group
        fac = bufs.factors
        assert torch.equal(fac.post[-1], fac.has[-1]) and int(fac.has[-1].sum()) == 1
        named = fac.frow >= 0
        assert bool(named.any())
        if bufs.rot is not None:  # path (b)'s factored columns rotate by no position
            assert not bool((bufs.rot[..., 0] >= 0)[named].any())
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)
