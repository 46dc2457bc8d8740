"""CUDA graphs of the static decode step (``runtime/cuda_graph.py``): replay equals the eager step on a GPU,
step after step as the lengths grow, the read table widens and the batch shrinks (a capture per batch
size and width). The CPU side (the static forward equals the eager step, no host sync) is
``test_static_step.py``."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

TEXTS = (
    "Describe the scene in detail.",
    "Hi",
    "What colour is the sky today? Tell me more about it.",
    "Describe the picture.",
    "What is in the picture?",
)
# the batch goes from 5 to 4 to 3 to 2 to 1 (a capture each): attnpack's request (below) ends first,
# kvzip's (per-head holes: a hole step's buffers and graph) next, then A-VL's (core=0.3 over its image:
# core steps of selected attention, a group and graph of their own, "select"), then h2o's (statistics
# steps: its rows asked, the others' not), then the full one runs alone (plain steps): every mode's graph
# in as many scheduler steps as before.
# h2o's request links (MPIC) the record of an image an earlier request computed: its keys stored pre-RoPE,
# rotated on read, so the steps it is in are linked steps ("holes+rope" beside kvzip, then "rope").
# attnpack's request (rank 4 over its image: pre-RoPE factors, the static step's factor stacks) runs its
# last decode steps beside them all (batch 5: factor steps, whose graph's key names the stacks' shape too)
NEW = (4, 8, 10, 6, 4)
POLICIES = (
    ("kvzip", {"budget": 0.5}),
    ("h2o", {"budget": 0.5}),
    ("full", {}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("attnpack", {"rank": 4}),
)
IMAGES = (None, 1, None, 0, 2)  # A-VL's and attnpack's requests have an image, h2o's a linked one
LINKED = 1  # h2o's request links its image's record
FACTORED = 4  # attnpack's request
# the graph replays the eager step's kernels on the same values; only the paged read's split count may
# differ (its table is a fixed capacity wide), which at these sizes is one split either way
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def test_a_cuda_graph_needs_cuda(capsys, no_model_compute):
    from tests.runtime.cli_refusal import refused
    from vlkv.runtime.cuda_graph import check_device

    with pytest.raises(ValueError, match="needs a CUDA device; this model is on 'cpu'"):
        check_device("cpu")
    line = refused(capsys, "--cuda-graph")
    assert "--cuda-graph needs --device cuda, --backend torch and a fixed pool (--pool-bytes)" in line


# bf16 only, the GPU path's dtype: the check's pytest part ran 149 of its 185 s in run 6 (the fp32 case is the
# same code; on CPU both dtypes are compared, test_static_step.py)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_graph_replay_equals_the_eager_step(dtype, monkeypatch):
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link.gate import UNCHECKED_ENV
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.models.registry import load_model

    monkeypatch.setenv(UNCHECKED_ENV, "1")  # the random tiny model has no link check: opted in
    spec = LinkSpec("mpic", 2)

    loaded = load_model("tiny-llava", device="cuda")
    loaded.model.to(dtype)
    engine = Engine(loaded, decode_graph=True)
    be = engine.backend
    static = be.static
    static.capacity_step = 8  # the read table widens every 8 steps: a capture each time
    outs, real = [], be.step

    def recorded(inputs, cache, stats=None):
        out = real(inputs, cache, stats)
        outs.append(out)
        return out

    be.step = recorded
    scheds = []
    for _ in range(2):
        sched = Scheduler(engine, pool_bytes=1 << 23, link_threshold=0.0)
        be.static = None
        prime = Prompt("Describe it.", [make_image(IMAGES[LINKED])])
        sched.submit(Request(prime, make_policy("full"), 1, stop_at_eos=False, link=spec))
        sched.run()  # the image's record computed and kept
        reqs = [
            sched.submit(
                Request(
                    Prompt(t, [] if im is None else [make_image(im)]),
                    make_policy(p, **kw),
                    n,
                    stop_at_eos=False,
                    link=spec if i == LINKED else None,
                )
            )
            for i, (t, n, (p, kw), im) in enumerate(zip(TEXTS, NEW, POLICIES, IMAGES))
        ]
        while len(sched.running) < len(TEXTS):  # the prefills (no graph for them)
            sched.step()
        scheds.append((sched, reqs))
    (eager, eager_reqs), (graphed, graph_reqs) = scheds
    assert graph_reqs[LINKED].cached_tokens > 0 and any(la.linked for la in graph_reqs[LINKED].cache.layers)
    packed = graph_reqs[FACTORED].cache.layers
    assert all(la.lowrank is not None and not la.lowrank.post_rope for la in packed)  # path (a) factors
    assert graph_reqs[FACTORED].status is Status.RUNNING
    step, calls, modes, holes = 0, 0, set(), set()
    while eager.running:
        # a scheduler step is one backend call per group (A-VL's core steps are a group of their own):
        # each compared with the eager one at the same place
        be.static = None
        at = len(outs)
        eager.step()
        want = outs[at:]
        be.static = static
        at = len(outs)
        graphed.step()
        got = outs[at:]
        calls += len(got)
        # a request whose step raised is failed alone and the others' step retried (a call more than the
        # eager run's): its error named first (run 7: the low-rank kernel's compile error, seen as 3 != 2)
        failed = {i: r.error for i, r in enumerate(graph_reqs) if r.status is Status.FAILED}
        assert not failed, failed
        assert static.taken == calls and len(got) == len(want), static.refused
        first = graph_reqs[0]  # kvzip's: a hole step while it runs
        holes.add(first.status is Status.RUNNING and any(la.holes is not None for la in first.cache.layers))
        for g, w in zip(got, want):
            torch.testing.assert_close(g.logits, w.logits, **TOL[dtype], msg=f"step {step}")
            assert torch.equal(g.attended, w.attended)
            assert (g.stats[0] is None) == (w.stats[0] is None), step
            modes.add(w.stats[0] is None)
            if w.stats[0] is not None:  # every asked row's statistics, C columns wide (0 past its width)
                for gs, ws in zip(g.stats, w.stats):
                    n = ws.colsum.shape[-1]
                    torch.testing.assert_close(gs.colsum[..., :n], ws.colsum, rtol=1e-4, atol=1e-5)
        step += 1
    assert not graphed.running
    assert static.graphs.replays == calls
    # one capture per (batch size, statistics mode, reads, width): holes and linked entries beside
    # statistics, A-VL's selection, linked entries with statistics, plain, and each width reached
    assert static.graphs.captures >= 4, static.graphs.captures
    assert modes == {True, False}  # statistics steps, then plain ones
    assert True in holes  # kvzip's request had holes while it ran
    reads = {key[2] for key in static.graphs._graphs}
    assert {"holes+rope", "select", "rope", None} <= reads, reads
    # attnpack's factor steps replayed a graph of their own (the key names the factor stacks' shape)
    assert any(len(key) == 4 for key in static.graphs._graphs), list(static.graphs._graphs)
    for a, b in zip(eager_reqs, graph_reqs):
        assert a.status is b.status is Status.FINISHED, (a.error, b.error)
        assert a.tokens == b.tokens
    graphed.segments.release()  # the linked image's record, kept for later requests
    assert graphed.pool.used_bytes() == 0


def test_a_graph_is_captured_per_batch_size_and_again_when_its_buffers_or_pools_change(monkeypatch):
    """:meth:`DecodeGraphs.run`'s bookkeeping on CPU, the capture itself replaced (a CUDA graph needs a
    GPU; the replay is checked above): one capture per batch size, replays while the buffers and the pool
    tensors are the same, a new capture when either changes, the outputs handed back as copies."""
    from types import SimpleNamespace

    from vlkv.runtime import cuda_graph

    monkeypatch.setattr(cuda_graph, "check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    captured = []

    def capture(self, forward):
        outputs = forward()
        captured.append(outputs)
        graph = SimpleNamespace(replay=lambda: [o.copy_(n) for o, n in zip(outputs, forward())])
        return graph, outputs, ()

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "_capture", capture)
    graphs = cuda_graph.DecodeGraphs("cuda")
    step = [0.0]

    def forward():
        return (torch.full((2,), step[0]),)

    narrow, wide, three = (SimpleNamespace(batch=b) for b in (2, 2, 3))
    pool_a, pool_b = torch.zeros(4), torch.zeros(4)
    runs = [
        (narrow, pool_a),
        (narrow, pool_a),
        (narrow, pool_b),
        (wide, pool_b),
        (three, pool_b),
        (wide, pool_b),
    ]
    for i, (bufs, pool) in enumerate(runs):
        step[0] = float(i)
        (out,) = graphs.run(bufs, forward, (pool,))
        assert torch.equal(out, torch.full((2,), float(i)))  # this step's values, by replay
        assert all(out is not o for outs in captured for o in outs)  # a copy, not the graph's own
    # captured: the first run, a new pool, wider buffers, a new batch size; replayed every run
    assert graphs.captures == len(captured) == 4 and graphs.replays == len(runs)
    # a statistics step's graph is kept beside the plain one of its batch size (its own key), both replayed
    stats = SimpleNamespace(batch=2)
    for bufs, key in ((stats, (2, "probs", None)), (stats, (2, "probs", None)), (wide, None)):
        graphs.run(bufs, forward, (pool_b,), key=key)
    assert graphs.captures == 5 and set(graphs._graphs) == {2, 3, (2, "probs", None)}
