"""The ``profile`` part of ``gpu_check.py``: where a decode step's time goes, per policy.

Two paths over the same prompt (LLaVA-1.5-7B's shape, 8k x 4 on a GPU; toy sizes with ``--tiny``):

- ``engine``: ``Engine.decode`` on one batched cache (the benchmarks' path: no scheduler);
- ``scheduler``: ``Scheduler.step()`` with the same requests running (what ``vlkv serve`` and
  ``vlkv generate`` run: the step plan, the runner, the commit's one read back per group).

Each is profiled over a few steps after two warm-up steps: top operators by self CPU time and by
device time, operator calls, host synchronisations and copies per step.

Host syncs per step: ``aten::_local_scalar_dense`` events (one per ``.item()`` / ``int()`` /
``bool()`` of a tensor; run 4 counted its ``aten::item`` parent too, two per read) and, on CUDA,
``cudaStreamSynchronize`` calls (every read back waits on one, ``.tolist()`` / ``.cpu()`` /
``nonzero`` included, which no scalar event shows). ``vlkv.runtime.op_count.count_ops`` counts the
same reads on a CPU run (tests/runtime/policies/test_decode_syncs.py bounds them).

Host Python per step (``host``): the same steps under ``cProfile`` (no torch profiler), the functions
with the most own time per step, and the time inside Triton's launcher. Run 5 halved the operator
events of a full-cache step and the step (38-56 ms against a 7.3 ms bound, ~13 ms of device work) did not
get faster: what the host spends is not the operator count, and an operator profile cannot say where the
Python goes. ``step_ms`` is the step unprofiled, the number the others are read against.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from bench_common import sync  # scripts/ is on sys.path: gpu_parts and the scripts put it there

PROFILE_POLICIES = ("full", "snapkv", "vlcache", "h2o", "avl")
STEPS = 3
SYNC_KEYS = ("aten::_local_scalar_dense",)  # its parent ``aten::item`` is the same read
STREAM_SYNC_KEYS = ("cudaStreamSynchronize",)  # the final ``torch.cuda.synchronize()`` is a device sync
COPY_KEYS = ("aten::copy_", "aten::to", "aten::_to_copy")
HOST_TOP = 12
TRITON_LAUNCH = (
    "triton/runtime/jit.py",
    "run",
)  # JITFunction.run: binds arguments, picks the binary, launches


def _where(filename: str) -> str:
    """``filename`` from its package down (``vlkv/...``, ``torch/...``, ``triton/...``), or as it is."""
    for root in ("vlkv/", "triton/", "torch/", "transformers/", "scripts/"):
        at = filename.rfind("/" + root)
        if at >= 0:
            return filename[at + 1 :]
    return filename.rsplit("/", 1)[-1]  # no machine's directories in a committed report


def _fn(filename: str, line: int, name: str) -> str:
    """One profile row's function: ``where:line:name``, or a builtin's own name (cProfile files those under ``~``)."""
    return name if filename == "~" else f"{_where(filename)}:{line}:{name}"


def host_profile(step, device: str, steps: int = STEPS) -> dict:
    """``steps`` runs of ``step()`` unprofiled, then under ``cProfile``: the step's wall time and where its
    host Python goes (the functions with the most own time; Triton's launcher, its callees included)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    plain = (time.perf_counter() - start) / steps * 1e3
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    sync(device)
    prof.disable()
    wall = (time.perf_counter() - start) / steps * 1e3
    stats = pstats.Stats(
        prof
    ).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:HOST_TOP]
    launch = [v for (f, _, n), v in stats.items() if f.endswith(TRITON_LAUNCH[0]) and n == TRITON_LAUNCH[1]]
    return {
        "step_ms": plain,
        "step_ms_cprofile": wall,
        "triton_launch_ms_per_step": sum(v[3] for v in launch) / steps * 1e3,
        "triton_launches_per_step": sum(v[0] for v in launch) / steps,
        "top_own": [
            {"fn": _fn(f, line, name), "calls_per_step": v[0] / steps, "own_ms_per_step": v[2] / steps * 1e3}
            for (f, line, name), v in rows
        ],
    }  # fmt: skip


def profiled(step, device: str, steps: int = STEPS) -> dict:
    """Run ``step()`` twice to warm up, then ``steps`` times under torch.profiler; per-step counts."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in range(2):  # one-off table growth, first-call dispatch
        step()
    sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall = (time.perf_counter() - start) / steps * 1e3
    host = host_profile(step, device, steps)
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    on_device = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True)[:8]
    return {
        "step_ms_profiled": wall,
        "step_ms": host.pop("step_ms"),
        "host": host,
        "syncs_per_step": sum(e.count for e in events if e.key in SYNC_KEYS) / steps,
        "stream_syncs_per_step": sum(e.count for e in events if e.key in STREAM_SYNC_KEYS) / steps,
        "copies_per_step": sum(e.count for e in events if e.key in COPY_KEYS) / steps,
        "ops_per_step": sum(e.count for e in events) / steps,
        "top_self_cpu": [
            {"op": e.key, "calls_per_step": e.count / steps,
             "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "device_ms_per_step": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps}
            for e in top
        ],
        "top_device": [
            {"op": e.key, "calls_per_step": e.count / steps,
             "device_ms_per_step": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps}
            for e in on_device
        ],
    }  # fmt: skip


def _policy(name: str):
    from vlkv.runtime.policies import make_policy

    return make_policy(name) if name == "full" else make_policy(name, budget=0.2)


def engine_path(engine, batch, ctx, name: str, device: str) -> dict:
    """``Engine.decode`` over one batched cache, compressed once after the prefill."""
    import bench_decode

    from vlkv.runtime.backend import StepInputs
    from vlkv.runtime.edits import apply_edits

    be = engine.backend
    pol = _policy(name)
    t = batch.input_ids.shape[1]
    request, alias = bench_decode.joint_request({name: pol}, ctx, t)
    cache = engine.new_cache(batch)
    inputs = StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, be.embed(batch))
    out = be.step(inputs, cache, request)
    if name != "full":
        stats = bench_decode.stats_for(out.stats, alias.get(name, name))
        apply_edits(cache, pol.after_prefill(cache, stats, ctx))
    state = {"tok": out.logits.argmax(-1), "step": 0}

    def step():
        state["step"] += 1
        state["tok"] = engine.decode(state["tok"], batch, pol, cache, state["step"]).logits.argmax(-1)

    try:
        return profiled(step, device)
    finally:
        cache.release()


def scheduler_path(engine, prompt_batch, b: int, name: str, device: str) -> dict:
    """``Scheduler.step()`` with ``b`` requests of ``prompt_batch`` running (prefilled first, one per
    step as the scheduler admits them), each decoding under ``name`` at budget 0.2."""
    from vlkv.runtime.prompt import Prompt
    from vlkv.runtime.request import Request, Status
    from vlkv.runtime.scheduler import Scheduler

    sched = Scheduler(engine)
    reqs = []
    for _ in range(b):
        # the text is a label: the request is taken as encoded (as the server's handler threads do)
        req = Request(Prompt("document prompt, encoded"), _policy(name), 64, stop_at_eos=False)
        req.batch = prompt_batch
        reqs.append(sched.submit(req))
    for _ in range(b):  # a step admits what fits, prefills it, then decodes
        if all(r.status is not Status.WAITING for r in reqs):
            break
        sched.step()
    failed = [r.error for r in reqs if r.status is Status.FAILED]
    if failed:
        raise RuntimeError(failed[0])
    try:
        res = profiled(sched.step, device)
        res["running"] = sum(r.status is Status.RUNNING for r in reqs)  # all b, or the step ran fewer
    finally:
        for r in reqs:
            sched.cancel(r)
        sched.step()
    return res


def run_profile(args, sink) -> None:
    """Both paths per policy at LLaVA-1.5-7B's shape (8k x 4); a failing path is recorded, not raised."""
    import bench_decode
    from bench_common import document_prompt, load_for_bench

    from vlkv.runtime.engine import Engine

    model, tokens, b = ("shape:toy-llava", 96, 2) if args.tiny else ("shape:llava-1.5-7b", 8192, 4)
    dtype = "fp32" if args.device == "cpu" else "bf16"
    engine = Engine(load_for_bench(model, args.device, dtype))
    one = document_prompt(engine, model, tokens)
    batch = bench_decode._repeat(one, b)
    ctx = engine.context(batch)
    result: dict = {"model": model, "tokens": batch.input_ids.shape[1], "batch": b, "policies": {}}
    for name in PROFILE_POLICIES:
        row: dict = {}
        for path, run, inputs in (
            ("engine", engine_path, (batch, ctx)),
            ("scheduler", scheduler_path, (one, b)),
        ):
            try:
                row[path] = run(engine, *inputs, name, args.device)
            except Exception as exc:
                row[path] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            result["policies"][name] = row
            sink(result)
    sink(result)
