"""The ``compile`` part of ``gpu_check.py``: the eager decode step against its CUDA-graph replay.

LLaVA-1.5-7B's decoder shape, bf16, 8k x 4, through ``Scheduler.step()`` on a fixed pool
(``runtime/cuda_graph.py``: the static forward captured per batch size, ``runtime/static_step.py``):

- ``step_ms``: scheduler steps over a full cache, eager and graph, in interleaved blocks (eager, graph,
  eager, graph), the median step of each configuration; ``policies``: the same for the other kinds of
  step a graph takes (``GRAPH_POLICIES``: h2o's statistics steps, snapkv's compress-once cache), each on
  its own scheduler (run 7 timed the full cache only: 1.57x);
- ``forward_ms``: the step's device half alone on one prepared set of buffers: the static forward run
  eagerly (every launch from the host) against one replay of its graph (one launch);
- ``graph_vs_static_max_abs``: the replay's logits against the static forward's on the same buffers
  (the same kernels, grids and inputs: expected 0), and the first capture's seconds.

On a CPU (the dry run) it records itself skipped: a CUDA graph needs a CUDA device (the static forward is
checked against the eager step on CPU by ``tests/runtime/test_static_step.py``).
"""

from __future__ import annotations

import statistics
import time

from bench_common import sync  # scripts/ is on sys.path: gpu_parts puts it there

BLOCKS = 2  # interleaved blocks per configuration
STEPS = 8  # timed scheduler steps per block
# after the full cache, (name, settings) of the other steps timed: statistics every step (h2o: the kernel
# writing the graph's probabilities buffer, the scores updated on the host half's side), and a cache
# compressed once at prefill (snapkv: a plain step over fewer entries)
GRAPH_POLICIES = (("h2o", {"budget": 0.5}), ("snapkv", {"budget": 0.2}))


def run_compile(args, sink) -> None:
    if not args.device.startswith("cuda"):
        sink({"skipped": "a CUDA graph needs a CUDA device (the static step is checked on CPU by the tests)"})
        return
    from bench_common import document_prompt, load_for_bench

    from vlkv.runtime.engine import Engine

    model, tokens, b = ("shape:toy-llava", 96, 2) if args.tiny else ("shape:llava-1.5-7b", 8192, 4)
    engine = Engine(load_for_bench(model, args.device, "bf16"), decode_graph=True)
    one = document_prompt(engine, model, tokens)
    time_policies(engine, one, b, args.device, sink, {"model": model, "dtype": "bf16"})


def time_policies(engine, one, b: int, device: str, sink, result: dict) -> dict:
    """:func:`measure` for the full cache (``result``'s own fields), then for each of ``GRAPH_POLICIES``
    (``result["policies"][label]``), ``sink`` called after each."""
    measure(engine, one, b, device, sink, result)
    result["policies"] = {}
    for name, settings in GRAPH_POLICIES:
        label = f"{name} {settings.get('budget', '')}".strip()
        mine = result["policies"][label] = {}
        # written into the part's result as it goes: a part stopped at its limit keeps this policy's blocks
        measure(engine, one, b, device, lambda _, r=result: sink(r), mine, name, settings)
        sink(result)
    return result


def measure(
    engine, one, b: int, device: str, sink, result: dict, policy: str = "full", settings=None
) -> dict:
    """The part's measurements (see the module docstring) for ``b`` requests of the encoded prompt ``one``
    under ``policy`` (``settings`` its keywords) on ``engine`` (its backend's ``static`` a
    :class:`~vlkv.runtime.static_step.StaticDecode` with graphs). The device half alone is timed for the
    full cache only (its buffers' key names no statistics mode and no reads)."""
    from gpu_timing import timed_ms

    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt
    from vlkv.runtime.request import Request, Status
    from vlkv.runtime.scheduler import Scheduler
    from vlkv.runtime.static_step import forward

    be = engine.backend
    static = be.static
    entry = be.num_layers * 2 * be.num_kv_heads * be.head_dim * be.dtype.itemsize  # one token, all layers
    n = one.input_ids.shape[1]
    new = 2 * (BLOCKS * 2 * STEPS + 8)
    settings = settings or {}
    result.update(tokens=n, batch=b, policy=policy, settings=settings)
    sched = Scheduler(engine, pool_bytes=entry * b * (n + new + 64))
    reqs = []
    for _ in range(b):
        # the text is a label: the request is taken as encoded (as gpu_profile's scheduler path does)
        req = Request(
            Prompt("document prompt, encoded"), make_policy(policy, **settings), new, stop_at_eos=False
        )
        req.batch = one
        reqs.append(sched.submit(req))
    be.static = None
    for _ in range(b + 1):  # admit (one prefill a step), then an eager decode step
        sched.step()
    if any(r.status is not Status.RUNNING for r in reqs):
        raise RuntimeError(next((r.error for r in reqs if r.error), "a request is not running"))
    sink(result)

    def timed_steps(on) -> list[float]:
        be.static = static if on else None
        out = []
        for _ in range(STEPS):
            sync(device)
            t0 = time.perf_counter()
            sched.step()
            sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    captures0, replays0, taken0 = static.graphs.captures, static.graphs.replays, static.taken
    refused0 = dict(static.refused)
    be.static = static
    t0 = time.perf_counter()
    sched.step()  # the first graph step: warm-up, capture, replay
    sync(device)
    result["first_graph_step_s"] = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "graph": []}
    for _ in range(BLOCKS):
        for name in ("eager", "graph"):
            times[name] += timed_steps(name == "graph")
            result["step_ms"] = {k: statistics.median(v) for k, v in times.items() if v}
            sink(result)
    result["step_ms_all"] = times
    # the graphs and counters are the engine's: what this policy's steps added to them
    result["captures"], result["replays"] = (
        static.graphs.captures - captures0,
        static.graphs.replays - replays0,
    )
    result["taken"] = static.taken - taken0
    result["refused"] = {
        k: v - refused0.get(k, 0) for k, v in static.refused.items() if v > refused0.get(k, 0)
    }
    result["eager_over_graph"] = result["step_ms"]["eager"] / result["step_ms"]["graph"]
    sink(result)
    if policy != "full":
        _finish(sched, reqs)
        return result

    # the device half alone, on the buffers of the last graph step: running it again writes the same K/V
    # rows and table columns (the same values at the same places) and reads the same lengths
    bufs = static._bufs[b, None, None]  # (batch size, statistics mode, reads): a full cache has neither
    pool = sched.pool
    pools = [(pool.keys[i], pool.values[i], pool.prerope_flags(i)) for i in range(be.num_layers)]
    _, _, graph, outputs, _ = static.graphs._graphs[b, None, None]
    ref = forward(be, bufs, pools)[0]
    graph.replay()
    result["graph_vs_static_max_abs"] = float((outputs[0] - ref).abs().max())
    result["forward_ms"] = {
        "static_eager": timed_ms(lambda: forward(be, bufs, pools), device, 10),
        "graph_replay": timed_ms(graph.replay, device, 10),
    }
    fwd = result["forward_ms"]
    result["forward_static_over_graph"] = fwd["static_eager"] / fwd["graph_replay"]
    _finish(sched, reqs)
    sink(result)
    return result


def _finish(sched, reqs) -> None:
    """Cancel the part's requests, let the scheduler release their slots, and drop the graphs and step
    buffers (they hold this scheduler's pool tensors: three 8k x 4 pools of a 7B model at once would not fit
    an H100)."""
    for r in reqs:
        sched.cancel(r)
    sched.step()
    sched.engine.backend.static.release()


def markdown(res: dict) -> list[str]:
    """The part's lines in ``report.md``."""
    steps, fwd = res.get("step_ms") or {}, res.get("forward_ms") or {}
    lines = [
        f"{res.get('model')}, {res.get('tokens')} tokens x {res.get('batch')}, {res.get('dtype')}, "
        f"{res.get('policy')} cache; first graph step (warm-up + capture + replay) "
        f"{res.get('first_graph_step_s', float('nan')):.2f} s, {res.get('captures')} capture(s), "
        f"{res.get('replays')} replays, {res.get('taken')} graph steps taken, refused {res.get('refused')}.",
        "",
        "| measure | eager (ms) | graph (ms) | eager / graph |",
        "|---|---:|---:|---:|",
    ]
    if "eager" in steps and "graph" in steps:
        e, g = steps["eager"], steps["graph"]
        lines.append(f"| Scheduler.step() (median) | {e:.2f} | {g:.2f} | {e / g:.2f} |")
    if fwd:
        e, g = fwd["static_eager"], fwd["graph_replay"]
        lines.append(f"| device half alone (static forward vs replay) | {e:.2f} | {g:.2f} | {e / g:.2f} |")
    for label, pol in (res.get("policies") or {}).items():
        st = pol.get("step_ms") or {}
        if "eager" in st and "graph" in st:
            e, g = st["eager"], st["graph"]
            lines.append(f"| Scheduler.step(), {label} (median; {pol.get('taken')} graph steps, refused "
                         f"{pol.get('refused')}) | {e:.2f} | {g:.2f} | {e / g:.2f} |")  # fmt: skip
    if "graph_vs_static_max_abs" in res:
        lines += ["", f"Replay vs the static forward, same buffers: max abs logit difference "
                  f"{res['graph_vs_static_max_abs']:.3g}."]  # fmt: skip
    return lines
