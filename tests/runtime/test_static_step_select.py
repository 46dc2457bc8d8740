"""Selected attention (A-VL's core steps, ``StepInputs.attend``) through the static step
(``runtime/static_step.py``) against the eager step, on the Triton path under the interpreter: a ragged
batch of an A-VL request with ``core=0.3`` (image prompts: a core to restrict to) beside a full and an h2o
request gives the same logits, attended counts, statistics (scattered back from the lists' positions to
columns), tokens, tables, K/V rows and running scores, over update steps and core steps; the device half
of a selection step reads nothing back."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_static_step import (
    TOL,
    _assert_same_state,
    _engine,
    _recorded,
    _torch_path,
)
from tests.runtime.test_static_step_stats import PROBS_TOL, _assert_stats_equal
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.static_step import (
    StaticBuffers,
    StaticDecode,
    capacity_for,
    forward,
    layer_pools,
    prepare,
    refusal,
)

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 4  # A-VL's interval 3: an update step (every entry), then core steps (the selection), then again
AVL = ("avl", dict(budget=0.5, core=0.3))
# (text, image seed or None, policy): ragged, two images of their own, A-VL's core among them
BATCH = (
    ("Describe the picture.", 0, AVL),
    ("Hi", 1, ("full", {})),
    ("What colour is the sky today? Tell me more.", None, ("h2o", dict(budget=0.5))),
)


def _running(engine, batch=BATCH) -> tuple[Scheduler, list[Request]]:
    sched = Scheduler(engine, pool_bytes=1 << 22)
    reqs = [
        sched.submit(
            Request(
                Prompt(text, [] if seed is None else [make_image(seed)]),
                make_policy(p, **kw),
                16,
                stop_at_eos=False,
            )
        )
        for text, seed, (p, kw) in batch
    ]
    with _torch_path():
        sched.step()
    assert len(sched.running) == len(batch)
    return sched, reqs


def _inputs_recorded(engine) -> list:
    """Every :class:`~vlkv.runtime.backend.StepInputs` ``engine``'s backend steps from now on, in order."""
    inputs, real = [], engine.backend.step

    def step(inp, cache, stats=None):
        inputs.append(inp)
        return real(inp, cache, stats)

    engine.backend.step = step
    return inputs


def _paired_group_step(engine, eager, static_sched, static, outs: list, inputs: list, dtype, n: int) -> int:
    """Scheduler step ``n`` of two schedulers over the same requests, ``eager`` without the static step,
    ``static_sched`` through ``static`` (which must take every backend step): A-VL's core steps run as a
    group of their own (``step_groups``: selecting rows never sit beside h2o's in one call), so a scheduler
    step is one or two backend steps, each compared (logits, attended counts, statistics). ``outs`` /
    ``inputs``: :func:`_recorded` / :func:`_inputs_recorded`. Returns how many were core steps."""
    engine.backend.static = None
    at = len(outs)
    eager.step()
    want, want_inputs = outs[at:], inputs[at:]
    taken = static.taken
    engine.backend.static = static
    at = len(outs)
    static_sched.step()
    got = outs[at:]
    assert static.taken == taken + len(got) and not static.refused, static.refused
    assert len(got) == len(want) and [i.attend is None for i in inputs[at:]] == [
        i.attend is None for i in want_inputs
    ]
    selected = 0
    for g, w, inp in zip(got, want, inputs[at:]):
        selected += inp.attend is not None  # a core step: A-VL's lists (a full rider's every column)
        torch.testing.assert_close(g.logits, w.logits, **TOL[dtype], msg=f"step {n}")
        assert torch.equal(g.attended, w.attended), n
        _assert_stats_equal(g.stats, w.stats, f"step {n}")
    return selected


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("tiny-llava", torch.float32),
        ("tiny-llava", torch.bfloat16),
        ("tiny-qwen2-vl", torch.float32),
        ("tiny-qwen2-vl", torch.bfloat16),
    ],
    ids=str,
)
def test_a_selection_step_equals_the_eager_step(name, dtype, monkeypatch):
    """Two schedulers decode the same ragged mixed batch, one eagerly and one through the static step:
    core steps (selected attention) are taken, not refused, and every step's logits, attended counts and
    statistics, then the tokens, tables, K/V rows and running scores are the same."""
    engine = _engine(name, dtype, monkeypatch)
    outs, inputs = _recorded(engine), _inputs_recorded(engine)
    eager, eager_reqs = _running(engine)
    static_sched, static_reqs = _running(engine)
    static = StaticDecode(engine.backend, capacity_step=8)
    selected = 0
    for n in range(STEPS):
        selected += _paired_group_step(engine, eager, static_sched, static, outs, inputs, dtype, n)
    assert any(k[2] == "select" for k in static._bufs)
    assert 0 < selected < static.taken  # core steps and others
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)
    for a, b in zip(eager_reqs, static_reqs):
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert set(la.scores) == set(lb.scores)
            n = la.host_lengths()[0]
            for key in la.scores:
                torch.testing.assert_close(lb.scores[key][..., :n], la.scores[key][..., :n], **PROBS_TOL)


def test_a_selection_steps_device_half_reads_nothing_back(monkeypatch):
    """A core step's device half issues no host sync and keeps its buffers' addresses; each layer's
    lists (the host half's) end with the new column; a row attends its list's length (fewer than its
    cache holds)."""
    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, reqs = _running(engine)
    group = None
    for _ in range(STEPS):  # up to a core step planned
        group = next((g for g in sched.plan().groups if g.inputs.attend is not None), None)
        if group is not None:
            break
        sched.step()
    assert group is not None
    assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None
    be = engine.backend
    made = []

    def make(longest: int) -> StaticBuffers:
        made.append(StaticBuffers.make(
            len(group.requests), capacity_for(longest, 64), be.num_layers, be.num_kv_heads,
            be.pos_dims, "cpu",
            be.num_heads // be.num_kv_heads, reads="select",
        ))  # fmt: skip
        return made[-1]

    got = prepare(None, group.inputs, group.batch, make)
    assert got is not None and got[0] is made[0]
    bufs = got[0]
    assert bufs.reads == "select" and bufs.held is None
    ptrs = [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.select, bufs.select_len, bufs.read)]
    with count_ops() as c:
        _, attended = forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    assert [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.select, bufs.select_len, bufs.read)] == ptrs
    for i, index in enumerate(group.inputs.attend):
        past = torch.tensor([r.host_lengths()[0] - 1 for r in group.batch.layers[i].rows])
        last = bufs.select[i].gather(2, (bufs.select_len[i] - 1)[..., None])[..., 0]
        assert torch.equal(last, past[:, None].expand_as(last)), i  # the new column closes every list
        if index is not None:
            assert torch.equal(bufs.select_len[i], index.lengths + 1)
    assert (
        attended < torch.tensor([[float(r.host_lengths()[0]) for r in la.rows] for la in group.batch.layers])
    ).any()
