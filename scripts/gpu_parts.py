"""The parts of ``gpu_check.py``: each runs in its own process and writes its result as it goes.

A part is ``run_<name>(args, sink)``; ``sink(result)`` replaces the part's JSON file on disk, so a part
stopped at its time limit still leaves what it measured so far. ``args.tiny`` shrinks every size to a
toy one (the CPU dry run in the test suite); otherwise sizes are the GPU check's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_profile import PROFILE_POLICIES, run_profile  # noqa: E402, F401  (the profile part lives apart)

Sink = Callable[[dict], None]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        from importlib.metadata import version

        return version({"onnxruntime": "onnxruntime"}.get(module, module))
    except Exception:  # a module without distribution metadata still counts as present
        return "present"


def bandwidth(device: str, tiny: bool) -> dict:
    """Device memory bandwidth: a device-to-device copy (bytes read + written) and a read-only sum."""
    n = (1 << 22) if tiny else (1 << 30)  # float32 elements: 16 MiB or 4 GiB
    x = torch.ones(n, device=device)
    y = torch.empty_like(x)
    copy_ms = min(timed_ms(partial(y.copy_, x), device, 5, 1) for _ in range(2))
    read_ms = min(timed_ms(x.sum, device, 5, 1) for _ in range(2))
    nbytes = n * 4
    return {
        "buffer_bytes": nbytes,
        "copy_gbps": 2 * nbytes / copy_ms / 1e6,
        "read_gbps": nbytes / read_ms / 1e6,
    }


# ------------------------------------------------------------------------------------------------ env
def run_env(args, sink: Sink) -> None:
    info: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "versions": {m: _version(m) for m in ("transformers", "triton", "onnxruntime", "numpy", "tensorrt")},
    }
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    else:
        info["cpu"] = f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    sink(info)
    info["bandwidth"] = bandwidth(args.device, args.tiny)
    sink(info)


# --------------------------------------------------------------------------------------------- pytest
def gpu_test_files(root: Path) -> list[str]:
    """Test files holding a ``pytest.mark.gpu`` test (collecting only these keeps the run independent
    of optional test dependencies such as the server's)."""
    return sorted(
        str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
    )


# every switch of a CPU C++ kernel that builds on first use (vlkv/plugins/*: ``os.environ`` / ``env_switch``)
CPU_KERNEL_SWITCHES = (
    "VLKV_CPU_KERNEL",
    "VLKV_CPU_GEMM",
    "VLKV_CPU_LAYER",
    "VLKV_CPU_EVICT",
    "VLKV_CPU_APPEND",
    "VLKV_CPU_HUGE_WEIGHTS",
)


def run_pytest(args, sink: Sink) -> None:
    root = HERE.parent
    files = gpu_test_files(root)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    if args.device.startswith("cuda"):
        env["TRITON_INTERPRET"] = "0"  # the kernels compiled for the GPU, not interpreted
        # the GPU tests' CPU references would build the CPU C++ kernels first: ~80 s on 2 cores here, and
        # the H200 run 4 spent its whole 150 + 170 s in them (6 tests done). The references' matmul path is
        # checked against those kernels in CI; here the minutes go to the GPU.
        env.update(dict.fromkeys(CPU_KERNEL_SWITCHES, "0"))
    # -v: each test's name is written before it runs, so a part stopped at its limit names where it was
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rs", *files]
    result: dict = {"command": " ".join(cmd[1:]), "files": files}
    sink(result)
    timeout = max(10.0, args.part_budget - 5)
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        code = "timeout"
    counts = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed)", out):
        counts[word.rstrip("s") if word == "errors" else word] = int(n)
    result |= {"exit_code": code, "counts": counts, "tail": out[-4000:]}
    sink(result)


# -------------------------------------------------------------------------------------------- kernels
def _kernel_sizes(args) -> dict:
    if args.tiny:
        return {"heads": 4, "kv_heads": 2, "dim": 16, "keys": [64, 128], "select_keys": 128, "stat_rows": 8}
    return {
        "heads": 32,
        "kv_heads": 8,
        "dim": 128,
        "keys": [2048, 8192, 32768],
        "select_keys": 8192,
        "stat_rows": 64,
    }


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def kernel_stats(args, dtype, sizes) -> list[dict]:
    from bench_kernels import sdpa_rows

    from vlkv.plugins import ops, reference

    rows = []
    for num_k in sizes["keys"]:
        q = torch.randn(1, sizes["heads"], sizes["stat_rows"], sizes["dim"], device=args.device, dtype=dtype)
        k = torch.randn(1, sizes["kv_heads"], num_k, sizes["dim"], device=args.device, dtype=dtype)
        v = torch.randn_like(k)
        scale = sizes["dim"] ** -0.5
        got = ops.attn_stats(q, k, scale, threshold=0.01)
        ref = reference.attn_stats_reference(q, k, scale, threshold=0.01)
        t_stats = timed_ms(partial(ops.attn_stats, q, k, scale, threshold=0.01), args.device, args.repeats)
        t_sdpa = timed_ms(partial(sdpa_rows, q, k, v), args.device, args.repeats)
        rows.append(
            {
                "keys": num_k,
                "stats_ms": t_stats,
                "sdpa_ms": t_sdpa,
                "ratio": t_stats / t_sdpa,
                "colsum_max_err": _err(got.colsum, ref.colsum),
            }
        )
    return rows


def kernel_selected(args, dtype, sizes, keep: float = 0.3) -> dict:
    from vlkv.plugins import ops, reference

    n, hkv, d = sizes["select_keys"], sizes["kv_heads"], sizes["dim"]
    sel = max(1, round(keep * n))
    q = torch.randn(1, sizes["heads"], 1, d, device=args.device, dtype=dtype)
    k = torch.randn(1, hkv, n, d, device=args.device, dtype=dtype)
    v = torch.randn_like(k)
    idx = torch.stack([torch.randperm(n, device=args.device)[:sel] for _ in range(hkv)])[None]
    lengths = torch.full((1, hkv), sel, device=args.device, dtype=torch.int64)
    scale = d**-0.5

    def gather_sdpa():
        g = idx[..., None].expand(-1, -1, -1, d)
        return F.scaled_dot_product_attention(q, k.gather(2, g), v.gather(2, g), scale=scale, enable_gqa=True)

    got = ops.selected_attention(q, k, v, idx, lengths, scale)
    err = _err(got, reference.selected_attention_reference(q, k, v, idx, lengths, scale))
    t_sel = timed_ms(lambda: ops.selected_attention(q, k, v, idx, lengths, scale), args.device, args.repeats)
    t_gather = timed_ms(gather_sdpa, args.device, args.repeats)
    t_full = timed_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        args.device,
        args.repeats,
    )
    return {
        "keys": n,
        "selected": sel,
        "selected_ms": t_sel,
        "gather_sdpa_ms": t_gather,
        "full_sdpa_ms": t_full,
        "speedup_vs_gather": t_gather / t_sel,
        "max_err": err,
    }


def kernel_paged(args, dtype, sizes) -> list[dict] | str:
    """The runtime-v3 paged read (``ops.paged_attention``) vs SDPA over a contiguous cache: one decode
    row per request, every request's entries scattered over the pool in 16-slot pages."""
    from vlkv.plugins import ops

    if not hasattr(ops, "paged_attention"):
        return "skipped: vlkv.plugins.ops has no paged_attention yet"
    rows = []
    hq, hkv, d = sizes["heads"], sizes["kv_heads"], sizes["dim"]
    batch = 2 if args.tiny else 4
    for t in sizes["keys"][:2] if not args.tiny else sizes["keys"]:
        page = 16
        pages = batch * (-(-t // page))
        perm = torch.randperm(pages, device=args.device)
        slots = (perm[:, None] * page + torch.arange(page, device=args.device)).reshape(-1)
        table = slots[: batch * (-(-t // page)) * page].view(batch, -1)[:, :t]
        table = table[:, None, :].expand(batch, hkv, t).contiguous()
        k_pool = torch.randn(hkv, pages * page, d, device=args.device, dtype=dtype)
        v_pool = torch.randn_like(k_pool)
        lengths = torch.full((batch, hkv), t, device=args.device, dtype=torch.int64)
        q = torch.randn(batch, hq, 1, d, device=args.device, dtype=dtype)
        scale = d**-0.5
        k = k_pool[torch.arange(hkv, device=args.device)[None, :, None], table]  # (B, Hkv, T, D)
        v = v_pool[torch.arange(hkv, device=args.device)[None, :, None], table]
        want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        got = ops.paged_attention(q, k_pool, v_pool, table, lengths, scale)
        paged = partial(ops.paged_attention, q, k_pool, v_pool, table, lengths, scale)
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
        t_paged = timed_ms(paged, args.device, args.repeats)
        t_sdpa = timed_ms(sdpa, args.device, args.repeats)
        kv_bytes = 2 * batch * hkv * t * d * k.element_size()
        rows.append(
            {
                "tokens": t,
                "batch": batch,
                "paged_ms": t_paged,
                "contiguous_sdpa_ms": t_sdpa,
                "ratio_vs_sdpa": t_paged / t_sdpa,
                "paged_gbps": kv_bytes / t_paged / 1e6,
                "max_err_vs_sdpa": _err(got, want),
            }
        )
    return rows


def kernel_lowrank(args, dtype, sizes) -> dict:
    """AttentionPack's rank-space decode (``ops.lowrank_attention``) over T factored + S dense entries
    vs SDPA over T + S dense entries."""
    from vlkv.plugins import ops
    from vlkv.plugins.lowrank_reference import lowrank_decode_attention

    hq, hkv, d = sizes["heads"], sizes["kv_heads"], sizes["dim"]
    t, s, r, b = (64, 16, 8, 1) if args.tiny else (8192, 512, 64, 1)
    dev = args.device
    q = torch.randn(b, hq, d, device=dev, dtype=dtype)
    kbar = torch.randn(b, t, r, device=dev, dtype=dtype)
    vbar = torch.randn(b, t, r, device=dev, dtype=dtype)
    dk = torch.randn(b, r, hkv * d, device=dev, dtype=dtype) / r**0.5
    dv = torch.randn(b, r, hkv * d, device=dev, dtype=dtype) / r**0.5
    k = torch.randn(b, hkv, s, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    rows = torch.full((b,), t, device=dev, dtype=torch.int64)
    dense = torch.full((b,), s, device=dev, dtype=torch.int64)
    got = ops.lowrank_attention(q, kbar, dk, vbar, dv, rows, k, v, dense)
    err = _err(got, lowrank_decode_attention(q, kbar, dk, vbar, dv, rows, k, v, dense))
    kd = torch.randn(b, hkv, t + s, d, device=dev, dtype=dtype)
    vd = torch.randn_like(kd)
    t_lr = timed_ms(
        lambda: ops.lowrank_attention(q, kbar, dk, vbar, dv, rows, k, v, dense), dev, args.repeats
    )
    t_dense = timed_ms(
        lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True), dev, args.repeats
    )
    return {"factored": t, "dense": s, "rank": r, "lowrank_ms": t_lr, "dense_sdpa_ms": t_dense,
            "ratio_vs_dense": t_lr / t_dense, "max_err": err}  # fmt: skip


def kernel_merge(args, dtype, sizes) -> dict:
    """KV merging (Elastic Cache): segment means of ``S`` rows into ``S/4`` outputs vs the reference."""
    from vlkv.plugins import ops, reference

    s = 128 if args.tiny else 8192
    hkv, d, dev = sizes["kv_heads"], sizes["dim"], args.device
    k = torch.randn(1, hkv, s, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    out = s // 4
    assign = torch.sort(torch.randint(0, out, (1, hkv, s), device=dev), dim=-1).values
    counts = torch.zeros(1, hkv, out, device=dev, dtype=torch.int64).scatter_add_(
        -1, assign, torch.ones_like(assign)
    )
    got = ops.merge_kv(k, v, assign, counts)
    ref = reference.merge_kv_reference(k, v, assign, counts)
    t_k = timed_ms(lambda: ops.merge_kv(k, v, assign, counts), dev, args.repeats)
    t_ref = timed_ms(lambda: reference.merge_kv_reference(k, v, assign, counts), dev, args.repeats)
    return {"rows": s, "outputs": out, "kernel_ms": t_k, "reference_ms": t_ref, "speedup": t_ref / t_k,
            "max_err": max(_err(got[0], ref[0]), _err(got[1], ref[1]))}  # fmt: skip


def run_kernels(args, sink: Sink) -> None:
    from vlkv.plugins import ops

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    sizes = _kernel_sizes(args)
    on_gpu = args.device.startswith("cuda") and ops.use_triton(torch.empty(1, device=args.device))
    result: dict = {"dtype": str(dtype), "path": "triton" if on_gpu else "pytorch reference", "sizes": sizes}
    for name, fn in (
        ("stats", kernel_stats),
        ("selected", kernel_selected),
        ("paged", kernel_paged),
        ("lowrank", kernel_lowrank),
        ("merge", kernel_merge),
    ):
        torch.manual_seed(0)
        try:
            result[name] = fn(args, dtype, sizes)
        except Exception as exc:  # one kernel's failure is recorded, the others still run
            result[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        sink(result)


# --------------------------------------------------------------------------------------------- decode
# kvzip / kvgrad compress by replaying the context inside Engine.generate, which this harness (prefill
# edits + decode steps) does not run; attnpack's low-rank images are 16 tokens in these models: the
# kernels part times its rank-space read instead.
DECODE_POLICIES = ("snapkv", "vlcache", "pyramidkv", "h2o", "local", "elastic", "avl")


def decode_cells(args) -> list[tuple[str, int, int]]:
    """(model, context tokens, batch) in the order they run: the most informative first, so a part that
    runs out of time has measured those."""
    if args.tiny:
        return [("shape:toy-llava", 96, 2), ("shape:toy-qwen2-vl", 96, 2), ("shape:toy-llava", 64, 1)]
    return [
        ("shape:llava-1.5-7b", 8192, 4),
        ("shape:qwen2-vl-7b", 8192, 4),
        ("shape:llava-1.5-7b", 32768, 1),
        ("shape:qwen2-vl-7b", 32768, 4),
        ("shape:llava-1.5-7b", 8192, 1),
        ("shape:llava-1.5-7b", 8192, 8),
        ("shape:qwen2-vl-7b", 8192, 1),
        ("shape:qwen2-vl-7b", 8192, 8),
        ("shape:qwen2-vl-7b", 32768, 1),
        ("shape:qwen2-vl-7b", 32768, 8),
    ]


def run_decode(args, sink: Sink) -> None:
    import bench_decode
    from bench_common import load_for_bench

    from vlkv.runtime.engine import Engine

    deadline = time.monotonic() + args.part_budget - 10
    dtype = "fp32" if args.device == "cpu" else "bf16"
    bw = bandwidth(args.device, args.tiny)
    result: dict = {"dtype": dtype, "bandwidth_gbps": bw["copy_gbps"], "bandwidth_probe": bw, "cells": []}
    sink(result)
    budgets = [0.5, 0.2, 0.1]
    engines: dict[str, Engine] = {}
    for model, tokens, batch in decode_cells(args)[args.decode_from :]:
        if time.monotonic() > deadline:
            result["cells"].append(
                {"model": model, "tokens": tokens, "batch": batch, "status": "skipped: part time limit"}
            )
            continue
        if model not in engines:
            engines.clear()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            start = time.perf_counter()
            engines[model] = Engine(load_for_bench(model, args.device, dtype))
            result.setdefault("build_s", {})[model] = time.perf_counter() - start
        engine = engines[model]
        ns = argparse.Namespace(
            model=model, batch=batch, steps=3 if args.tiny else 5, repeats=1, evict_every=1,
            interleave=False, device=args.device, dtype=dtype,
        )  # fmt: skip
        cell: dict = {"model": model, "tokens": tokens, "batch": batch, "rows": [], "errors": {}}
        result["cells"].append(cell)
        for policy in DECODE_POLICIES:
            if time.monotonic() > deadline:
                cell["errors"][policy] = "skipped: part time limit"
                continue
            try:
                rows = bench_decode.run_length(engine, ns, tokens, [(policy, b) for b in budgets])
            except Exception as exc:  # record the policy's failure; the others still run
                cell["errors"][policy] = (
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                )
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                sink(result)
                continue
            for r in rows:
                # the step's own bound: weights + the K/V it attends, read once at the measured bandwidth
                bound_ms = (r["weight_bytes"] + r["kv_read_bytes"]) / (bw["copy_gbps"] * 1e6)
                full_bound_ms = (r["weight_bytes"] + r["kv_full_bytes"]) / (bw["copy_gbps"] * 1e6)
                r |= {"bound_ms": bound_ms, "of_bound": bound_ms / r["step_ms"],
                      "full_of_bound": full_bound_ms / r["full_step_ms"]}  # fmt: skip
                cell["rows"].append(r)
            sink(result)
    sink(result)


# -------------------------------------------------------------------------------------------- prefill
def run_prefill(args, sink: Sink) -> None:
    import bench_prefill_stats

    ns = argparse.Namespace(
        model="shape:toy-llava" if args.tiny else "shape:llava-1.5-7b",
        device=args.device,
        dtype="fp32" if args.device == "cpu" else "bf16",
        tokens=96 if args.tiny else 8192,
        policies=list(bench_prefill_stats.POLICIES),
        rows=[8, 32] if args.tiny else [64, 256, 1024],
        repeats=2 if args.tiny else 3,
    )
    sink({"config": {k: v for k, v in vars(ns).items()}})
    res = bench_prefill_stats.run(ns)
    sink({"config": {k: v for k, v in vars(ns).items()}} | res)


# ------------------------------------------------------------------------------ what cannot run here
def run_compile(args, sink: Sink) -> None:
    from vlkv.runtime import engine

    src = Path(engine.__file__).read_text()
    if "torch.compile" in src or "CUDAGraph" in src:
        sink({"note": "a compiled decode step exists but the check has no part for it yet"})
        return
    sink(
        {"skipped": "vlkv has no CUDA-graph or torch.compile decode step yet (nothing to compare with eager)"}
    )


def run_tensorrt(args, sink: Sink) -> None:
    if importlib.util.find_spec("tensorrt") is None:
        sink({"skipped": "TensorRT is not installed on this machine (the ONNX artefacts are checked on ORT)"})
        return
    import tensorrt

    sink({"tensorrt": tensorrt.__version__, "note": "engine build not part of this check yet"})


PARTS: dict[str, Callable[[argparse.Namespace, Sink], None]] = {
    "env": run_env,
    "kernels": run_kernels,
    "decode": run_decode,
    "prefill": run_prefill,
    "profile": run_profile,
    "pytest": run_pytest,
    "compile": run_compile,
    "tensorrt": run_tensorrt,
}
