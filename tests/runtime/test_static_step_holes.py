"""Decode steps with per-head holes (kvzip's and an adaptive head budget's) through the static step
(``runtime/static_step.py``) against the eager step, on the Triton path under the interpreter: a ragged
batch mixing a hole request with a full and an h2o request gives the same logits, attended counts,
statistics, tokens, tables (holes included), K/V rows and running scores; the device half of a hole step
reads nothing back."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_static_step import TOL, _assert_same_state, _engine, _paired_step, _recorded, _running
from tests.runtime.test_static_step_stats import PROBS_TOL, _assert_stats_equal
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.static_step import StaticDecode, forward, layer_pools, prepare

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 3
KVZIP = ("kvzip", dict(budget=0.5))  # heads="adaptive" by default: per-head holes after its prefill
KNORM = ("knorm", dict(budget=0.5, heads="adaptive"))  # AdaKV-style head budgets: holes too
FULL, H2O = ("full", {}), ("h2o", dict(budget=0.5))
# (model, dtype, the batch's policies): a hole request beside a full and an h2o one (a statistics step);
# kvzip, full and knorm (a plain step with holes). ~10-20 s of Triton's interpreter each
CASES = [
    ("tiny-llava", torch.float32, (KVZIP, FULL, H2O)),
    ("tiny-llava", torch.bfloat16, (KVZIP, FULL, H2O)),
    ("tiny-qwen2-vl", torch.float32, (KNORM, FULL, H2O)),
    ("tiny-qwen2-vl", torch.bfloat16, (KVZIP, FULL, H2O)),
    ("tiny-llava", torch.float32, (KVZIP, FULL, KNORM)),
]


def _holes(req) -> torch.Tensor:
    """``(L,)`` int64 the request's hole count per layer (0 where it has no hole table)."""
    return torch.tensor(
        [
            0 if la.holes is None else int(la.holes[..., : la.host_lengths()[0]].sum())
            for la in req.cache.layers
        ]
    )


def _hole_tables(req) -> list:
    """Per layer the request's hole table over its length (None where it has none)."""
    return [
        None if la.holes is None else la.holes[0, :, : la.host_lengths()[0]].clone()
        for la in req.cache.layers
    ]


@pytest.mark.parametrize(
    "name,dtype,per", CASES, ids=lambda x: str(x) if not isinstance(x, tuple) else "-".join(p for p, _ in x)
)
def test_a_step_with_per_head_holes_equals_the_eager_step(name, dtype, per, monkeypatch):
    """Two schedulers decode the same ragged mixed batch, one eagerly and one through the static step:
    the hole request has holes (so the step is a hole step, not refused), and every step's logits,
    attended counts (holes excluded, a mean over heads) and statistics, then the tokens, tables, hole
    tables, K/V rows and running scores are the same."""
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    eager, eager_reqs = _running(engine, per=per)
    static_sched, static_reqs = _running(engine, per=per)
    assert _holes(eager_reqs[0]).sum() > 0 and torch.equal(_holes(eager_reqs[0]), _holes(static_reqs[0]))
    stats_step = any(p == "h2o" for p, _ in per)
    static = StaticDecode(engine.backend, capacity_step=2)
    for step in range(STEPS):
        want, got = _paired_step(engine, eager, static_sched, static, outs, step)
        assert all(reads == "holes" for _, _, reads in static._bufs)  # a hole step's buffers only
        assert [m is not None for _, m, _ in static._bufs] == [stats_step] * len(static._bufs)
        torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
        assert torch.equal(got.attended, want.attended), step
        assert _holes(static_reqs[0]).sum() > 0  # still holes to skip (the attended counts exclude them)
        if stats_step:
            _assert_stats_equal(got.stats, want.stats, f"step {step}")
        else:
            assert got.stats == [None] * engine.backend.num_layers
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)
    for a, b in zip(eager_reqs, static_reqs):
        for ha, hb in zip(_hole_tables(a), _hole_tables(b)):
            assert (ha is None) == (hb is None) and (ha is None or torch.equal(ha, hb))
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert set(la.scores) == set(lb.scores)
            n = la.host_lengths()[0]
            for key in la.scores:
                torch.testing.assert_close(lb.scores[key][..., :n], la.scores[key][..., :n], **PROBS_TOL)


@pytest.mark.parametrize("per", [(KVZIP, FULL, H2O), (KVZIP, FULL, FULL)], ids=["stats", "plain"])
def test_a_hole_steps_device_half_reads_nothing_back(per, monkeypatch):
    """The device half of a hole step (statistics or plain) issues no host sync, keeps its buffers'
    addresses, and leaves in ``held`` each layer's columns per head: the hole request's own hole table
    inverted below its length, nothing past it; the attended counts are their means over heads."""
    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, reqs = _running(engine, per=per)
    engine.backend.static = static = StaticDecode(engine.backend, capacity_step=64)
    sched.step()  # buffers made for this batch size and mode
    (key,) = static._bufs
    bufs = static._bufs[key]
    assert key[2] == "holes" and bufs.reads == "holes" and bufs.held is not None
    ptrs = [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.held)]
    engine.backend.static = None
    group = sched.plan().groups[0]
    got = prepare(bufs, group.inputs, group.batch, lambda n: pytest.fail(f"new buffers for {n}"))
    assert got is not None and got[0] is bufs
    bufs.held.fill_(True)
    with count_ops() as c:
        _, attended = forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    assert [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.held)] == ptrs
    fewer = False
    for layer, la in enumerate(group.batch.layers):
        for i, r in enumerate(la.rows):
            n = r.host_lengths()[0]
            want = torch.ones(r.kv_heads, n, dtype=torch.bool) if r.holes is None else ~r.holes[0, :, :n]
            assert torch.equal(bufs.held[layer, i, :, 0, :n], want), (layer, i)
            assert not bufs.held[layer, i, :, 0, n:].any()
            assert attended[layer, i] == want.double().sum(-1).mean()
            fewer |= bool(attended[layer, i] < n)
    assert fewer  # some row attended fewer entries than its length: holes were skipped


def test_selected_attention_beside_holes_is_refused_and_buffer_modes_check_themselves(monkeypatch):
    """Per-head holes and a selection in one call are refused (the eager step raises on them; the
    scheduler's groups never form one), nothing reserved; the buffers name their mode and refuse a mode
    they do not know or a hole buffer beside a selection."""
    import dataclasses

    from vlkv.runtime.backend import AttendIndex
    from vlkv.runtime.static_buffers import StaticBuffers
    from vlkv.runtime.static_step import reads_of, refusal

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, _ = _running(engine, per=(KVZIP, FULL, FULL))
    group = sched.plan().groups[0]
    assert reads_of(group.inputs, group.batch) == "holes"
    assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None
    rows = group.batch.layers[0].rows
    heads = rows[0].kv_heads
    index = AttendIndex(
        torch.zeros(len(rows), heads, 1, dtype=torch.long), torch.ones(len(rows), heads, dtype=torch.long)
    )
    selected = dataclasses.replace(group.inputs, attend=[index] * engine.backend.num_layers)
    assert reads_of(selected, group.batch) == "select"
    why = refusal(engine.backend, selected, group.batch, group.stats)
    assert why == "selected attention beside per-head holes (the eager step refuses it too)"
    static = StaticDecode(engine.backend)
    before = [r.host_lengths() for r in rows]
    assert static.step(selected, group.batch, group.stats) is None and static.refused == {why: 1}
    assert [r.host_lengths() for r in rows] == before  # nothing reserved
    assert [StaticBuffers.make(1, 4, 2, 2, 1, "cpu", reads=m).reads for m in (None, "holes", "select")] == [
        None,
        "holes",
        "select",
    ]
    with pytest.raises(ValueError, match="reads must be one of"):
        StaticBuffers.make(1, 4, 2, 2, 1, "cpu", reads="both")
    held = StaticBuffers.make(1, 4, 2, 2, 1, "cpu", reads="holes")
    sel = StaticBuffers.make(1, 4, 2, 2, 1, "cpu", reads="select")
    with pytest.raises(ValueError, match="not read together"):
        dataclasses.replace(sel, held=held.held)
    with pytest.raises(ValueError, match="select / select_len / read"):
        dataclasses.replace(sel, select=sel.select[:, :, :, :2])
