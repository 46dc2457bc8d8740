"""The static decode step (``runtime/static_step.py``: the forward a CUDA graph captures) against the eager
step it replaces, on the Triton path under the interpreter: the same logits, the same pool and table
writes, on a ragged batch whose read table widens; no host sync in its device half; the steps it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vlkv.plugins.ops import FORCE_TRITON_ENV
from vlkv.runtime.models.registry import load_model
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
)

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

# three prompt lengths: a ragged batch
TEXTS = ("Describe the scene in detail.", "Hi", "What colour is the sky today? Tell me more about it.")
# logits: the static step runs the eager step's kernels on the same values; only the paged read's split
# count may differ (its table is C columns wide, not the longest row), which reorders an fp32 sum.
# Measured: 0 in every case here (tiny sizes take one split either way); the bounds leave that reordering room
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
STEPS = 5  # with a capacity step of 2 the read table widens at least twice


def _torch_path():
    """Prefill on the PyTorch path (the interpreter's glue kernels run a program per token and head): the
    same pool and tables as the Triton path leaves, in a fraction of the time (count_step_ops' switch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from count_step_ops import torch_path_prefill

    return torch_path_prefill()


def _admit_all(sched, reqs: list) -> None:
    """Step ``sched`` until every request of ``reqs`` runs (an image prompt may take a prefill a step; at
    most one step a request), then check they all do."""
    for _ in range(len(reqs)):
        if len(sched.running) == len(reqs):
            break
        sched.step()
    assert len(sched.running) == len(reqs)


def _engine(name: str, dtype: torch.dtype, monkeypatch):
    from vlkv.runtime.engine import Engine

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    loaded = load_model(name)
    loaded.model.to(dtype)
    engine = Engine(loaded)
    assert engine.backend.adapter.device_layer
    return engine


def _recorded(engine) -> list:
    """The backend's step outputs, appended as they return."""
    outs, real = [], engine.backend.step

    def step(inputs, cache, stats=None):
        out = real(inputs, cache, stats)
        outs.append(out)
        return out

    engine.backend.step = step
    return outs


def _paired_step(engine, eager, static_sched, static, outs: list, step: int) -> tuple:
    """Step ``step`` of two schedulers over the same requests, ``eager`` without the static step and
    ``static_sched`` through ``static`` (which must take it): ``(eager's output, the static one's)``
    from ``outs`` (:func:`_recorded`)."""
    engine.backend.static = None
    eager.step()
    want = outs[-1]
    engine.backend.static = static
    static_sched.step()
    assert static.taken == step + 1, static.refused
    return want, outs[-1]


def _assert_same_state(eager, static_sched, eager_reqs: list, static_reqs: list, dtype) -> None:
    """The two schedulers of a paired run (:func:`_paired_step`) left the same tokens, and every
    request the same tables (slots, positions, modality, order) and K/V rows in every layer."""
    assert [r.tokens for r in static_reqs] == [r.tokens for r in eager_reqs]
    for a, b in zip(eager_reqs, static_reqs):
        for layer, ((ta, kva), (tb, kvb)) in enumerate(
            zip(_layer_state(a, eager.pool), _layer_state(b, static_sched.pool))
        ):
            assert all(torch.equal(x, y) for x, y in zip(ta, tb)), layer  # slots, positions, modality, order
            for x, y in zip(kva, kvb):
                torch.testing.assert_close(y, x, **TOL[dtype], msg=f"layer {layer}")


def _running(engine, policy: str = "full", per: tuple | None = None, **kw) -> tuple[Scheduler, list[Request]]:
    """A scheduler on a fixed pool with the three prompts admitted (prefilled on the PyTorch path), each
    under ``policy`` (``kw`` its settings), or ``per[i]``'s ``(name, settings)`` where given."""
    sched = Scheduler(engine, pool_bytes=1 << 22)
    per = per or ((policy, kw),) * len(TEXTS)
    reqs = [
        sched.submit(Request(Prompt(t), make_policy(p, **k), 16, stop_at_eos=False))
        for t, (p, k) in zip(TEXTS, per)
    ]
    with _torch_path():
        sched.step()
    assert len(sched.running) == len(TEXTS)
    return sched, reqs


def _layer_state(req, pool) -> list[tuple]:
    """Per layer the request's held tables and the K/V rows at its slots."""
    out = []
    for la in req.cache.layers:
        n = la.host_lengths()[0]
        slots = la.slots[0, :, :n]
        heads = torch.arange(slots.shape[0])[:, None]
        kv = (pool.keys[la.layer][heads, slots], pool.values[la.layer][heads, slots])
        tables = tuple(getattr(la, t)[0, :, :n].clone() for t in ("slots", "positions", "modality", "order"))
        out.append((tables, kv))
    return out


# both dtypes on LLaVA (1-D RoPE); Qwen2-VL (M-RoPE positions, q/k/v biases) in fp32: each case is ~20 s
# of Triton's interpreter
@pytest.mark.parametrize(
    "name,dtype",
    [("tiny-llava", torch.float32), ("tiny-llava", torch.bfloat16), ("tiny-qwen2-vl", torch.float32)],
    ids=str,
)
def test_static_step_equals_the_eager_step(name, dtype, monkeypatch):
    """Two schedulers decode the same ragged batch, one eagerly and one through the static step: every
    step's logits and attended counts, the tokens, the tables and the K/V rows written are the same."""
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    eager, eager_reqs = _running(engine)
    static_sched, static_reqs = _running(engine)
    static = StaticDecode(engine.backend, capacity_step=2)
    widths = set()
    for step in range(STEPS):
        want, got = _paired_step(engine, eager, static_sched, static, outs, step)
        widths.add(static._bufs[len(TEXTS), None, None].capacity)
        assert got.logits.dtype == want.logits.dtype == torch.float32
        torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
        assert torch.equal(got.attended, want.attended)
        assert got.stats == [None] * engine.backend.num_layers
    assert len(widths) > 1  # the read table widened (new buffers) and the steps stayed equal
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)


def test_the_device_half_reads_nothing_back_and_allocates_nothing_step_shaped(monkeypatch):
    """The device half (what a CUDA graph captures) issues no host sync; its buffers keep their addresses
    from step to step while the read table's capacity holds."""
    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, _ = _running(engine)
    engine.backend.static = static = StaticDecode(engine.backend, capacity_step=64)
    sched.step()  # buffers made for this batch size
    bufs = static._bufs[len(TEXTS), None, None]
    ptrs = [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.token_ids, bufs.positions)]
    engine.backend.static = None
    plan = sched.plan()  # the next decode step's one group, not run by the scheduler
    assert len(plan.groups) == 1
    group = plan.groups[0]
    got = prepare(bufs, group.inputs, group.batch, lambda n: pytest.fail(f"new buffers for {n}"))
    assert got is not None and got[0] is bufs
    with count_ops() as c:
        logits, attended = forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    assert [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.token_ids, bufs.positions)] == ptrs
    assert logits.shape == (len(TEXTS), engine.backend.adapter.lm_head.out_features)
    assert torch.equal(
        attended[0], torch.tensor([float(r.host_lengths()[0]) for r in group.batch.layers[0].rows])
    )


def test_steps_it_cannot_take_are_refused_with_a_reason(monkeypatch):
    """A statistics step (h2o) with the Triton statistics kernel off is refused, and so is a growable pool
    where a graph would be captured: nothing reserved, the reason counted (the backend then runs its eager
    step); the buffers and the capacity step check their sizes."""
    from vlkv.plugins import paged_probs

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, _ = _running(engine, "h2o", budget=0.5)
    static = StaticDecode(engine.backend)
    group = sched.plan().groups[0]
    before = [la.host_lengths() for la in group.batch.layers[0].rows]
    assert group.stats is not None
    monkeypatch.setattr(paged_probs, "TRITON_PROBS", False)
    assert static.step(group.inputs, group.batch, group.stats) is None
    why = "statistics with the Triton statistics kernel off (VLKV_TRITON_PROBS=0)"
    assert static.taken == 0 and static.refused == {why: 1}
    monkeypatch.setattr(paged_probs, "TRITON_PROBS", True)
    assert [la.host_lengths() for la in group.batch.layers[0].rows] == before  # nothing reserved
    grow = Scheduler(engine)  # a growable pool
    grow.submit(Request(Prompt("Hi"), make_policy("full"), 4, stop_at_eos=False))
    with _torch_path():
        grow.step()
    group = grow.plan().groups[0]
    graphs = StaticDecode(engine.backend, graphs=object())
    assert graphs.step(group.inputs, group.batch, group.stats) is None
    assert graphs.refused == {"a growable pool (its tensors move: a graph needs a fixed pool)": 1}
    assert StaticDecode(engine.backend).step(group.inputs, group.batch, group.stats) is not None  # no graph
    with pytest.raises(ValueError, match="must be >= 1"):
        StaticBuffers.make(0, 8, 2, 2, 1, "cpu")
    with pytest.raises(ValueError, match="exact output is a statistics step's"):
        StaticBuffers.make(1, 8, 2, 2, 1, "cpu", exact=True)
    assert StaticBuffers.make(1, 8, 2, 2, 1, "cpu", group=3).probs.shape == (2, 1, 2, 3, 8)
    with pytest.raises(ValueError, match="capacity_step"):
        StaticDecode(engine.backend, capacity_step=0)
    assert [capacity_for(n, 8) for n in (1, 8, 9, 17)] == [8, 8, 16, 24]


def test_a_cuda_graph_engine_on_the_cpu_says_it_needs_cuda():
    from vlkv.runtime.engine import Engine

    with pytest.raises(ValueError, match="needs a CUDA device; this model is on 'cpu'"):
        Engine(load_model("tiny-llava"), decode_graph=True)
