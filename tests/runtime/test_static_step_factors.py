"""Decode steps of an AttentionPack request (pre-RoPE low-rank factors, path (a)) through the static step
(``runtime/static_step.py`` + ``static_factors.py``) against the eager step, on the Triton path under the
interpreter: attnpack beside a full and an h2o request (a statistics step, every step: attnpack asks for
statistics), 1-D RoPE (tiny LLaVA, fp32 and bf16) and M-RoPE (tiny Qwen2-VL, fp32), and beside a kvzip
(per-head holes in another request) and a full request (tiny LLaVA fp32): the same logits,
attended counts, statistics, tokens, tables and K/V rows; two attnpack requests (the second's rows at an
offset past the first's) beside a full one, the first finishing mid-run; the policy's factor edit runs eagerly between
steps (the stacks copied again only where it changed them); the device half reads nothing back."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_static_step import (
    TOL,
    _admit_all,
    _assert_same_state,
    _engine,
    _recorded,
    _torch_path,
)
from tests.runtime.test_static_step_stats import _assert_stats_equal
from vlkv.runtime.kv.paged_factors import paged_lowrank_tables
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.static_factors import factors_key
from vlkv.runtime.static_step import StaticDecode, forward, layer_pools, prepare, reads_of, refusal

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 3
ATTNPACK, FULL, H2O = ("attnpack", {"rank": 4, "exact": True}), ("full", {}), ("h2o", {"budget": 0.5})
KVZIP = ("kvzip", {"budget": 0.5})  # per-head holes in another request: a "holes+rope" step
TEXTS = ("Describe the picture.", "Hi", "What colour is the sky today? Tell me more about it.")
CASES = [
    ("tiny-llava", torch.float32, (FULL, H2O)),
    ("tiny-llava", torch.bfloat16, (FULL, H2O)),
    ("tiny-qwen2-vl", torch.float32, (FULL, H2O)),
    ("tiny-llava", torch.float32, (KVZIP, FULL)),
]


def _factored_running(engine, beside: tuple = (FULL, H2O)) -> tuple[Scheduler, list[Request]]:
    """A fixed-pool scheduler running an attnpack request over one image (factored at its prefill)
    beside two text requests under ``beside``'s policies (prefills on the PyTorch path)."""
    sched = Scheduler(engine, pool_bytes=1 << 23)
    images = ([make_image(0)], [], [])
    reqs = [
        sched.submit(Request(Prompt(t, im), make_policy(p, **kw), 16, stop_at_eos=False))
        for t, im, (p, kw) in zip(TEXTS, images, (ATTNPACK, *beside))
    ]
    with _torch_path():
        _admit_all(sched, reqs)
    assert all(la.lowrank is not None for la in reqs[0].cache.layers)  # factored: path (a), pre-RoPE
    assert not any(f.post_rope for la in reqs[0].cache.layers for f in la.lowrank.samples if f is not None)
    return sched, reqs


def _paired_groups(engine, eager, static_sched, static, outs: list) -> list[tuple]:
    """One scheduler step of each side, every group of the static side's taken by ``static`` (one group
    here, whatever the scheduler's grouping): ``[(eager's output, the static one's)]`` per group."""
    engine.backend.static = None
    n = len(outs)
    eager.step()
    want = outs[n:]
    engine.backend.static, taken = static, static.taken
    n = len(outs)
    static_sched.step()
    got = outs[n:]
    assert static.taken - taken == len(got) == len(want) > 0, static.refused
    return list(zip(want, got))


@pytest.mark.parametrize(
    "name,dtype,beside",
    CASES,
    ids=lambda x: str(x) if not isinstance(x, tuple) else "-".join(p for p, _ in x),
)
def test_an_attnpack_step_equals_the_eager_step(name, dtype, beside, monkeypatch):
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    eager, eager_reqs = _factored_running(engine, beside)
    static_sched, static_reqs = _factored_running(engine, beside)
    holes = any(p == "kvzip" for p, _ in beside)
    static = StaticDecode(engine.backend, capacity_step=64)
    for step in range(STEPS):
        for want, got in _paired_groups(engine, eager, static_sched, static, outs):
            torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
            assert torch.equal(got.attended, want.attended), step
            _assert_stats_equal(got.stats, want.stats, f"step {step}")
        (bufs,) = (b for key, b in static._bufs.items() if len(key) > 3)  # attnpack's group
        assert bufs.reads == ("holes+rope" if holes else "rope") and bufs.factors is not None
        has = bufs.factors.has[-1]  # one request holds factors: its columns, and only its, name rows
        assert int(has.sum()) == 1 and torch.equal((bufs.factors.frow >= 0).any(2).any(1), has)
        # the factored columns are the rotated ones (pre-RoPE keys rebuilt, then rotated by position)
        assert torch.equal(bufs.rot[..., 0] >= 0, bufs.factors.frow >= 0)
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)
    # the factors themselves: the policy's edits (eager, between steps) left the same ranks on both sides
    for a, b in zip(eager_reqs[0].cache.layers, static_reqs[0].cache.layers):
        fa, fb = a.lowrank.samples[0], b.lowrank.samples[0]
        assert torch.equal(fa.rank_k, fb.rank_k) and torch.equal(fa.rank_v, fb.rank_v)


ATTNPACK2 = ("attnpack", {"rank": 2, "exact": True})


def test_two_attnpack_requests_one_finishing_mid_run_equal_the_eager_step(monkeypatch):
    """Two attnpack requests (different images, ranks 4 and 2) beside a full one: the second's factor
    rows start past the first's (``offset > 0``: ``frow = offset - 1 - slot`` and the position scatter at
    ``start - 1 - slot``). The first stops after one decode step, so from then on the second's rows start
    at 0. Each step's logits, and the last layer's ``frow`` and rotated positions, are the eager step's
    (``kv/paged_factors.paged_lowrank_tables`` as the eager step built them)."""
    import vlkv.runtime.step_context as step_context

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    outs = _recorded(engine)
    built = []
    real = step_context.paged_lowrank_tables

    def record(layer):
        built.append(real(layer))
        return built[-1]

    monkeypatch.setattr(step_context, "paged_lowrank_tables", record)

    def running() -> tuple[Scheduler, list[Request]]:
        sched = Scheduler(engine, pool_bytes=1 << 23)
        specs = ((ATTNPACK, [make_image(0)], 16), (ATTNPACK2, [make_image(1)], 16), (FULL, [], 16))
        reqs = [
            sched.submit(Request(Prompt(t, im), make_policy(p, **kw), n, stop_at_eos=False))
            for t, ((p, kw), im, n) in zip(TEXTS, specs)
        ]
        with _torch_path():
            for _ in range(2 * len(reqs)):
                if len(sched.running) == len(reqs):
                    break
                sched.step()
        assert len(sched.running) == len(reqs)
        reqs[0].max_new_tokens = len(reqs[0].tokens) + 1  # its next token (decode step 0) is its last
        return sched, reqs

    eager, eager_reqs = running()
    static_sched, static_reqs = running()
    static = StaticDecode(engine.backend, capacity_step=64)
    for step in range(STEPS):
        holders = 2 if step == 0 else 1
        built.clear()
        pairs = _paired_groups(engine, eager, static_sched, static, outs)
        _, _, _, rope, _, want = built[-1]  # the eager step's last layer
        for w, g in pairs:
            torch.testing.assert_close(g.logits, w.logits, **TOL[torch.float32], msg=f"step {step}")
        (bufs,) = (
            b for key, b in static._bufs.items() if len(key) > 3 and key[0] == holders + 1
        )  # this step's group: three requests, then two
        has = bufs.factors.has[-1]
        assert int(has.sum()) == holders, step
        n = want.frow.shape[2]
        assert torch.equal(bufs.factors.frow[..., :n], want.frow), step
        assert not bool((bufs.factors.frow[..., n:] >= 0).any())
        assert torch.equal(bufs.rot[..., :n, 0], rope["rot"]), step
        if holders == 2:  # the second request's rows follow the first's
            assert int(bufs.factors.offset[-1, 1]) > 0
            assert int(want.frow[1].max()) >= int(bufs.factors.offset[-1, 1])
    assert eager_reqs[0].done and static_reqs[0].done
    _assert_same_state(eager, static_sched, eager_reqs[1:], static_reqs[1:], torch.float32)


def test_an_attnpack_steps_device_half_reads_nothing_back_and_its_stacks_follow_the_edits(monkeypatch):
    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, reqs = _factored_running(engine)
    engine.backend.static = static = StaticDecode(engine.backend, capacity_step=64)
    sched.step()
    assert static.taken == 1, static.refused  # one group: attnpack, full and h2o
    ((key, bufs),) = ((k, b) for k, b in static._bufs.items() if len(k) > 3)
    fac = bufs.factors
    engine.backend.static = None
    (group,) = (g for g in sched.plan().groups if factors_key(g.batch) is not None)
    assert reads_of(group.inputs, group.batch) == "rope" and factors_key(group.batch) == key[3]
    assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None
    ptrs = [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.rot, fac.kbar, fac.dk, fac.rank_k, fac.frow)]
    got = prepare(bufs, group.inputs, group.batch, lambda n: pytest.fail(f"new buffers for {n}"))
    assert got is not None and got[0] is bufs
    assert [
        t.data_ptr() for t in (bufs.ints, bufs.table, bufs.rot, fac.kbar, fac.dk, fac.rank_k, fac.frow)
    ] == ptrs
    # the stacks hold each layer's factors: rows at the request's offset, ranks as the last edit set them
    for i, la in enumerate(group.batch.layers):
        at = next(b for b, r in enumerate(la.rows) if r.lowrank is not None)
        f = la.rows[at].lowrank.samples[0]
        start = int(fac.offset[i, at])
        assert torch.equal(fac.kbar[i, start : start + f.rows, : f.kbar.shape[1]], f.kbar)
        assert torch.equal(fac.rank_k[i, start : start + f.rows], f.rank_k)
        assert torch.equal(fac.dv[i, at, : f.dv.shape[0]], f.dv)
    with count_ops() as c:
        forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    # the last layer's frow and rotated positions, derived from the read table, are the eager builder's
    # (kv/paged_factors, over the tables as the append left them)
    _, _, _, rope, _, want = paged_lowrank_tables(group.batch.layers[-1])
    n = want.frow.shape[2]
    assert bool((want.frow >= 0).any())
    assert torch.equal(fac.frow[..., :n], want.frow) and not bool((fac.frow[..., n:] >= 0).any())
    assert torch.equal(bufs.rot[..., :n, 0], rope["rot"])  # 1-D RoPE: a position is the table's row


def test_factors_the_static_step_cannot_read_are_refused_with_a_reason(monkeypatch):
    import vlkv.runtime.step_context as step_context

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, reqs = _factored_running(engine)
    (group,) = (g for g in sched.plan().groups if factors_key(g.batch) is not None)
    monkeypatch.setattr(step_context, "PAGED_FACTORS", False)
    assert "densely" in refusal(engine.backend, group.inputs, group.batch, group.stats)
    monkeypatch.setattr(step_context, "PAGED_FACTORS", True)
    f = next(r for r in group.batch.layers[0].rows if r.lowrank is not None).lowrank.samples[0]
    f.post_rope = True
    try:  # post-RoPE factors (path (b)) are taken: test_static_step_factors_post.py
        assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None
    finally:
        f.post_rope = False
    assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None
