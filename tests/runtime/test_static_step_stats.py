"""Statistics decode steps (h2o, A-VL, an allocator and cadence around h2o) through the static step
(``runtime/static_step.py``) against the eager step, on the Triton path under the interpreter: the same
logits, statistics (column sums, counts), tokens, tables, K/V rows and policy scores on a ragged batch;
no host sync in the device half of a statistics step."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_static_step import (
    TEXTS,
    TOL,
    _assert_same_state,
    _engine,
    _paired_step,
    _recorded,
    _running,
)
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.static_step import StaticDecode, forward, layer_pools, prepare, stats_mode

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

STEPS = 4  # h2o evicts as it decodes: its lengths hold still (test_static_step.py widens the table)
# the probabilities: the same kernel on the same values; its split count follows the table's width
# (C here, the longest row eagerly), which may reorder an fp32 sum. Measured: 0 at these sizes
PROBS_TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_stats_equal(got, want, msg: str) -> None:
    """Per layer, main and extra row sets: ``got``'s colsum over C columns equals ``want``'s over its
    width and is 0 past it; ``below`` and ``visible`` equal."""
    pairs = [(list(got), list(want))] + [(got.extra[n], want.extra[n]) for n in want.extra]
    assert set(got.extra) == set(want.extra)
    for g_layers, w_layers in pairs:
        assert len(g_layers) == len(w_layers)
        for layer, (g, w) in enumerate(zip(g_layers, w_layers)):
            assert (g is None) == (w is None), (msg, layer)
            if w is None:
                continue
            n = w.colsum.shape[-1]
            torch.testing.assert_close(g.colsum[..., :n], w.colsum, **PROBS_TOL, msg=f"{msg} layer {layer}")
            assert not g.colsum[..., n:].any(), (msg, layer)
            assert torch.equal(g.visible, w.visible), (msg, layer)
            assert (g.below is None) == (w.below is None)
            if w.below is not None:
                assert torch.equal(g.below, w.below), (msg, layer)


# h2o on LLaVA in both dtypes; A-VL (its text-score statistics) and h2o under a per-layer allocator with a
# cadence on Qwen2-VL (M-RoPE positions, q/k/v biases); h2o, full and A-VL in one batch: each case is
# 5-10 s of Triton's interpreter
CASES = [
    ("tiny-llava", torch.float32, "h2o", dict(budget=0.5)),
    ("tiny-llava", torch.bfloat16, "h2o", dict(budget=0.5)),
    ("tiny-qwen2-vl", torch.float32, "avl", dict(budget=0.5)),
    ("tiny-qwen2-vl", torch.bfloat16, "h2o", dict(budget=0.5, allocator="pyramid", evict_every=2)),
    ("tiny-llava", torch.float32, "mixed", {}),
    # budget 1 asks exact_output: the scheduler carries it, the static step takes its "exact" buffers
    ("tiny-llava", torch.float32, "h2o", dict(budget=1.0)),
]
# one batch, one step: h2o and A-VL ask for statistics, full rides along (the step's rows mask picks theirs)
MIXED = (("h2o", dict(budget=0.5)), ("full", {}), ("avl", dict(budget=0.5)))


@pytest.mark.parametrize(
    "name,dtype,policy,kw", CASES, ids=lambda x: str(x) if not isinstance(x, dict) else ""
)
def test_a_statistics_step_equals_the_eager_step(name, dtype, policy, kw, monkeypatch):
    """Two schedulers decode the same ragged batch under a statistics policy, one eagerly and one through
    the static step: every step's logits, attended counts and statistics, then the tokens, tables, K/V
    rows and the policy's running scores (what its bookkeeping made of the statistics) are the same."""
    engine = _engine(name, dtype, monkeypatch)
    outs = _recorded(engine)
    per = MIXED if policy == "mixed" else None
    eager, eager_reqs = _running(engine, policy, per, **kw)
    static_sched, static_reqs = _running(engine, policy, per, **kw)
    static = StaticDecode(engine.backend, capacity_step=2)
    for step in range(STEPS):
        want, got = _paired_step(engine, eager, static_sched, static, outs, step)
        # only statistics buffers (every step asked), exact ones where the policy evicts nothing
        assert [m for _, m, _ in static._bufs] == ["exact" if kw.get("budget") == 1.0 else "probs"]
        torch.testing.assert_close(got.logits, want.logits, **TOL[dtype], msg=f"step {step}")
        assert torch.equal(got.attended, want.attended)
        assert any(st is not None for st in want.stats)
        _assert_stats_equal(got.stats, want.stats, f"step {step}")
    _assert_same_state(eager, static_sched, eager_reqs, static_reqs, dtype)
    for a, b in zip(eager_reqs, static_reqs):
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert set(la.scores) == set(lb.scores) and (la.scores or a.policy.name == "full")
            n = la.host_lengths()[0]
            for key in la.scores:
                torch.testing.assert_close(lb.scores[key][..., :n], la.scores[key][..., :n], **PROBS_TOL)


def test_a_statistics_steps_device_half_reads_nothing_back(monkeypatch):
    """The device half of an h2o step (what a CUDA graph captures) issues no host sync and writes every
    layer's probabilities into the buffers allocated for its batch size; an exact-output request gets
    buffers (and a graph) of its own mode."""
    from vlkv.runtime.backend import StatsRequest

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    sched, _ = _running(engine, "h2o", budget=0.5)
    engine.backend.static = static = StaticDecode(engine.backend, capacity_step=64)
    sched.step()  # buffers made for this batch size and mode
    bufs = static._bufs[len(TEXTS), "probs", None]
    assert bufs.probs is not None and bufs.probs.shape[:3] == (
        engine.backend.num_layers,
        len(TEXTS),
        engine.backend.num_kv_heads,
    )
    ptr = bufs.probs.data_ptr()
    engine.backend.static = None
    group = sched.plan().groups[0]
    assert stats_mode(group.stats) == "probs"
    assert stats_mode(StatsRequest(exact_output=True)) == "exact" and stats_mode(None) is None
    got = prepare(bufs, group.inputs, group.batch, lambda n: pytest.fail(f"new buffers for {n}"))
    assert got is not None and got[0] is bufs
    bufs.probs.fill_(-1.0)
    with count_ops() as c:
        forward(engine.backend, bufs, layer_pools(group.batch))
    assert c.syncs == 0, dict(c.sites)
    assert bufs.probs.data_ptr() == ptr
    # every layer's softmax rows written: each (request, query head) row sums to 1 over its length, 0 past it
    lengths = [r.host_lengths()[0] for r in group.batch.layers[0].rows]
    for i, n in enumerate(lengths):
        rows = bufs.probs[:, i]
        torch.testing.assert_close(rows[..., :n].sum(-1), torch.ones(rows.shape[:-1]))
        assert not rows[..., n:].any()


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("threshold", [None, 0.3])
@pytest.mark.parametrize("asked", [None, (True, False, True)])
def test_every_layers_statistics_at_once_equal_the_eager_steps_per_layer(threshold, asked, holes):
    """:func:`layers_stats` (every layer in one pass) equals the eager step's ``_one_row_stats`` layer by
    layer: ragged lengths (probabilities 0 past them), per-head holes (a hole step's ``held``, per KV
    head) or none (one mask for every head), a row set asking for some requests only, with and without a
    threshold (VL-Cache's counts)."""
    from vlkv.runtime.attention_rows import _one_row_stats
    from vlkv.runtime.static_step import layers_stats

    gen = torch.Generator().manual_seed(0)
    layers, b, kv_heads, group, cols = 3, 3, 2, 2, 9
    lengths = torch.tensor([[9, 4, 6], [9, 5, 6], [8, 4, 7]])  # (L, B): per layer, as an allocator leaves
    held = (torch.arange(cols) < lengths[..., None])[:, :, None, None, :]  # (L, B, 1, 1, C)
    if holes:  # each KV head gives up some of its columns (kvzip's adaptive head budgets)
        held = held & (torch.rand(layers, b, kv_heads, 1, cols, generator=gen) > 0.3)
        assert held.shape[2] == kv_heads and (held.sum(-1) > 0).all()
    scores = torch.randn(layers, b, kv_heads, group, cols, generator=gen)
    probs = torch.softmax(scores.masked_fill(~held, float("-inf")), -1)
    rows = None if asked is None else torch.tensor(asked)[:, None]
    got = layers_stats(probs, held, rows, threshold)
    assert len(got) == layers
    for layer, g in enumerate(got):
        want = _one_row_stats(probs[layer], held[layer], rows, threshold)
        assert torch.equal(g.colsum, want.colsum), layer
        assert torch.equal(g.visible, want.visible), layer
        assert (g.below is None) == (threshold is None)
        if threshold is not None:
            assert torch.equal(g.below, want.below), layer
            assert g.below.sum() > 0  # some entries below the threshold: the count is exercised
    if holes:  # the heads' visible counts differ (a mask per head, not one per request)
        assert not torch.equal(got[0].visible[:, 0::group], got[0].visible[:, group::group])


def test_an_exact_output_step_reads_plainly_beside_its_statistics(monkeypatch):
    """A step asking ``exact_output`` (a backend step called with it: the scheduler's merged requests
    carry none) gets buffers of its own mode, and its logits and statistics equal the eager step's, whose
    output is the plain read's too."""
    from vlkv.runtime.backend import StatsRequest

    engine = _engine("tiny-llava", torch.float32, monkeypatch)
    stats = StatsRequest(exact_output=True)
    outs = []
    for static in (None, StaticDecode(engine.backend, capacity_step=64)):
        sched, _ = _running(engine, "h2o", budget=0.5)
        group = sched.plan().groups[0]
        engine.backend.static = static
        outs.append(engine.backend.step(group.inputs, group.batch, stats))
    engine.backend.static = None
    assert static.taken == 1 and set(static._bufs) == {(len(TEXTS), "exact", None)}
    assert static._bufs[len(TEXTS), "exact", None].exact
    want, got = outs
    torch.testing.assert_close(got.logits, want.logits, **TOL[torch.float32])
    _assert_stats_equal(got.stats, want.stats, "exact")
