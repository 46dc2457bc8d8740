"""Decode steps with linked (pre-RoPE) entries through the static step (``runtime/static_step.py``)
against the eager step, on the Triton path under the interpreter: a request that linked a stored image
record (MPIC: its keys kept pre-RoPE, rotated on read) in a ragged batch beside a full and an h2o request
(a statistics step) or a kvzip one (per-head holes), 1-D RoPE (tiny LLaVA) and M-RoPE (tiny Qwen2-VL),
fp32 and bf16: the same logits, attended counts, statistics, tokens, tables and K/V rows, also in A-VL's core steps
(selected attention, the linked request riding along); the device half of a linked step reads nothing
back; low-rank factors are still refused."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_static_step import (
    TOL,
    _assert_same_state,
    _engine,
    _paired_step,
    _recorded,
    _torch_path,
)
from tests.runtime.test_static_step_select import _inputs_recorded, _paired_group_step
from tests.runtime.test_static_step_stats import _assert_stats_equal
from vlkv.runtime.link.gate import UNCHECKED_ENV
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.static_step import StaticDecode, forward, layer_pools, prepare, reads_of, refusal

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 3
FULL, H2O, KVZIP = ("full", {}), ("h2o", dict(budget=0.5)), ("kvzip", dict(budget=0.5))
# (model, dtype, the policies beside the linked request): ~10-15 s of Triton's interpreter each
CASES = [
    ("tiny-llava", torch.float32, (FULL, H2O)),
    ("tiny-llava", torch.bfloat16, (FULL, H2O)),
    ("tiny-qwen2-vl", torch.float32, (FULL, H2O)),
    ("tiny-qwen2-vl", torch.bfloat16, (KVZIP, FULL)),
]
TEXTS = ("Hi", "What colour is the sky today? Tell me more about it.")


def _linked_running(engine, beside: tuple) -> tuple[Scheduler, list[Request]]:
    """A fixed-pool scheduler whose first request linked an image record another request computed
    (prefills on the PyTorch path), running beside text requests under ``beside``'s policies."""
    image = make_image(0)
    sched = Scheduler(engine, pool_bytes=1 << 23, link_threshold=0.0)
    spec = LinkSpec("mpic", 2)
    with _torch_path():
        first = Request(Prompt("Describe it.", [image]), make_policy("full"), 1, stop_at_eos=False, link=spec)
        sched.submit(first)
        sched.run()  # the record computed and kept
        linked = Request(
            Prompt("What is it?", [image]), make_policy("full"), 16, stop_at_eos=False, link=spec
        )
        reqs = [sched.submit(linked)] + [
            sched.submit(Request(Prompt(t), make_policy(p, **kw), 16, stop_at_eos=False))
            for t, (p, kw) in zip(TEXTS, beside)
        ]
        sched.step()
    assert len(sched.running) == len(reqs) and linked.cached_tokens > 0
    assert any(la.linked for la in linked.cache.layers)
    return sched, reqs


@pytest.mark.parametrize(
    "name,dtype,beside",
    CASES,
    ids=lambda x: str(x) if not isinstance(x, tuple) else "-".join(p for p, _ in x),
)
def test_a_step_with_linked_entries_equals_the_eager_step(name, dtype, beside, monkeypatch):
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    eager, eager_reqs = _linked_running(engine, beside)
    static_sched, static_reqs = _linked_running(engine, beside)
    stats_step = any(p == "h2o" for p, _ in beside)
    holes = any(p == "kvzip" for p, _ in beside)
    static = StaticDecode(engine.backend, capacity_step=64)
    for step in range(STEPS):
        want, got = _paired_step(engine, eager, static_sched, static, outs, step)
        assert {reads for _, _, reads in static._bufs} == {"holes+rope" if holes else "rope"}
        (bufs,) = static._bufs.values()
        assert bool((bufs.rot[..., 0] >= 0).any())  # pre-RoPE columns were rotated on read
        torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
        assert torch.equal(got.attended, want.attended), step
        if stats_step:
            _assert_stats_equal(got.stats, want.stats, f"step {step}")
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)


def test_a_linked_steps_device_half_reads_nothing_back_and_a_swapped_out_request_is_refused(monkeypatch):
    import dataclasses

    from vlkv.runtime.backend import AttendIndex

    monkeypatch.setenv(UNCHECKED_ENV, "1")
    engine = _engine("tiny-qwen2-vl", torch.float32, monkeypatch)
    sched, reqs = _linked_running(engine, (FULL, H2O))
    engine.backend.static = static = StaticDecode(engine.backend, capacity_step=64)
    sched.step()
    (key,) = static._bufs
    bufs = static._bufs[key]
    assert key[2] == "rope" and bufs.reads == "rope" and bufs.rope.sec is not None  # M-RoPE's sections
    assert bufs.rope.rows >= sched.pool.capacity(0)  # every position a prompt in this pool can have
    # the table's rows, per section, are the model's own rotary at mixed (t, h, w) positions, bit for bit
    pos = torch.randint(0, 300, (1, 40, 3), generator=torch.Generator().manual_seed(0))
    cos, sin = engine.backend.adapter.rotary(torch.zeros(1, 40, bufs.rope.cos.shape[1]), pos)
    dims = torch.arange(bufs.rope.cos.shape[1])
    at = pos[0][:, bufs.rope.sec]  # (40, D_r) the row each dim reads
    assert torch.equal(bufs.rope.cos[at, dims], cos[0]) and torch.equal(bufs.rope.sin[at, dims], sin[0])
    ptrs = [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.rot, bufs.rope.cos)]
    engine.backend.static = None
    group = sched.plan().groups[0]
    got = prepare(bufs, group.inputs, group.batch, lambda n: pytest.fail(f"new buffers for {n}"))
    assert got is not None and got[0] is bufs
    with count_ops() as c:
        forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    assert [t.data_ptr() for t in (bufs.ints, bufs.table, bufs.rot, bufs.rope.cos)] == ptrs
    # the last layer's twin: the linked request's pre-RoPE columns hold their positions
    la = reqs[0].cache.layers[-1]
    at = next(i for i, r in enumerate(group.batch.layers[-1].rows) if r is la)
    n = la.host_lengths()[0]
    pre = sched.pool.is_prerope(la.layer, la.slots[:, :, :n].clamp_min(0))[0]
    assert pre.any() and not pre[:, -1].any()  # the new entry is stored rotated
    want = torch.where(pre[..., None], la.positions[0, :, :n], -1)
    assert torch.equal(bufs.rot[at, :, :n], want)
    assert not (bufs.rot[at, :, n:] >= 0).any()
    assert all(not (bufs.rot[i] >= 0).any() for i in range(len(reqs)) if i != at)  # text requests
    rows = group.batch.layers[0].rows
    index = AttendIndex(
        torch.zeros(len(rows), rows[0].kv_heads, 1, dtype=torch.long),
        torch.ones(len(rows), rows[0].kv_heads, dtype=torch.long),
    )
    selected = dataclasses.replace(group.inputs, attend=[index] * engine.backend.num_layers)
    assert reads_of(selected, group.batch) == "select+rope"  # taken: the twin gathered through the lists
    assert refusal(engine.backend, selected, group.batch, group.stats) is None
    rows[0].offloaded = object()  # a swapped-out request runs eagerly (its K/V are not in the pool)
    try:
        why = refusal(engine.backend, group.inputs, group.batch, group.stats)
    finally:
        rows[0].offloaded = None
    assert why == "a swapped-out request (or a layer of several samples)"
    assert refusal(engine.backend, group.inputs, group.batch, group.stats) is None


AVL = ("avl", dict(budget=0.5, core=0.3))


# fp32 only: in a core step the eager step does not read paged (the selection gathers K/V), and rotates
# linked keys with the model's apply_rotary_pos_emb in the pool's dtype (bf16: every product rounded),
# where the kernels rotate in fp32 and round once: tiny Qwen2-VL in bf16 measured 0.055 apart in the
# rider's logits at the first core step (A-VL's own row equal). The paged eager steps above compare bf16
@pytest.mark.parametrize(
    "name,dtype", [("tiny-llava", torch.float32), ("tiny-qwen2-vl", torch.float32)], ids=str
)
def test_a_linked_request_in_core_steps_equals_the_eager_step(name, dtype, monkeypatch):
    """A-VL ``core=0.3`` over its image beside a full request that linked its image (it rides in A-VL's
    core steps: every column its list) and an h2o one: core steps are ``"select+rope"`` steps, taken, and
    every backend call's logits, attended counts and statistics, then tokens, tables and K/V rows equal
    the eager step's (``test_static_step_select``'s pattern)."""
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    engine = _engine(name, dtype, monkeypatch)
    outs, inputs = _recorded(engine), _inputs_recorded(engine)
    spec = LinkSpec("mpic", 2)
    pairs = []
    for _ in range(2):
        sched = Scheduler(engine, pool_bytes=1 << 23, link_threshold=0.0)
        with _torch_path():
            sched.submit(
                Request(
                    Prompt("Describe it.", [make_image(1)]),
                    make_policy("full"),
                    1,
                    stop_at_eos=False,
                    link=spec,
                )
            )
            sched.run()
            reqs = [
                sched.submit(
                    Request(
                        Prompt("Describe the picture.", [make_image(0)]),
                        make_policy(AVL[0], **AVL[1]),
                        16,
                        stop_at_eos=False,
                    )
                ),
                sched.submit(
                    Request(
                        Prompt("Hi", [make_image(1)]), make_policy("full"), 16, stop_at_eos=False, link=spec
                    )
                ),
                sched.submit(
                    Request(
                        Prompt("What colour is the sky today?"),
                        make_policy("h2o", budget=0.5),
                        16,
                        stop_at_eos=False,
                    )
                ),
            ]
            sched.step()
        assert len(sched.running) == 3 and reqs[1].cached_tokens > 0
        pairs.append((sched, reqs))
    (eager, eager_reqs), (static_sched, static_reqs) = pairs
    static = StaticDecode(engine.backend, capacity_step=64)
    selected = 0
    for n in range(4):  # A-VL's interval 3: an update step, then core steps
        selected += _paired_group_step(engine, eager, static_sched, static, outs, inputs, dtype, n)
    assert "select+rope" in {k[2] for k in static._bufs} and selected > 0
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)


def test_the_table_covers_the_model_and_the_pool():
    """``rope_table.table_rows``: the larger of ``max_position_embeddings`` and the pool's slots a layer
    (capped), at least 4096, a power of two."""
    from types import SimpleNamespace

    from vlkv.runtime.kv.rope_table import MAX_ROWS, table_rows

    model = SimpleNamespace(lm=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=5000)))
    assert table_rows(model) == 8192 and table_rows(model, 9000) == 16384
    assert table_rows(model, 10**9) == MAX_ROWS and table_rows(SimpleNamespace()) == 4096
