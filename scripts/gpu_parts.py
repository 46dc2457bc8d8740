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
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STARTED = time.monotonic()  # imported as the part's child process starts: its limit counts from here
sys.path.insert(0, str(HERE))

from gpu_graph import run_compile  # noqa: E402  (the compile part, eager step vs CUDA graph, lives apart)
from gpu_kernels import run_kernels  # noqa: E402  (the kernels part lives apart)
from gpu_profile import PROFILE_POLICIES, run_profile  # noqa: E402, F401  (the profile part lives apart)
from gpu_timing import Sink, timed_ms  # noqa: E402


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
    "VLKV_CPU_HEAP",  # not a kernel: the C heap left as glibc sets it, as on a GPU run
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
    # -v: each test's name is written before it runs, so a part stopped at its limit names where it was;
    # -rsfE: the summary at the tail names every failed test (run 5's tail kept only the last traceback)
    # -o addopts=: one process (the project's "-n auto" would start a worker per core, each compiling
    # the kernels again, and fails where pytest-xdist is not installed)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-o",
        "addopts=",
        "-m",
        "gpu",
        "-v",
        "-p",
        "no:cacheprovider",
        "-rsfE",
        *files,
    ]
    result: dict = {"command": " ".join(cmd[1:]), "files": files}
    sink(result)
    # run 7's rerun was stopped at the part's limit with pytest's output still in a pipe: nothing kept. The
    # output is read line by line instead, each -v verdict written to the report as it comes. A watchdog
    # kills pytest 10 s before the part's limit (counted from the part's start), so the summary is written
    # even while a test runs silently; pytest stays in the part's process group, which the part's own kill
    # (gpu_check.run_part) takes down with it
    left = max(10.0, args.part_budget - 10 - (time.monotonic() - STARTED))
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        proc.kill()

    watchdog = threading.Timer(left, stop)
    watchdog.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:  # ends at pytest's exit or at the watchdog's kill
            lines.append(line)
            if VERDICT.search(line):
                sink(result | pytest_summary("".join(lines), root, None))
    finally:
        watchdog.cancel()
    proc.stdout.close()
    returned = proc.wait()
    sink(result | pytest_summary("".join(lines), root, "timeout" if fired.is_set() else returned))


VERDICT = re.compile(r" (PASSED|FAILED|ERROR|SKIPPED)\b")


def pytest_summary(out: str, root: Path, code) -> dict:
    """The report's fields of a pytest run's output so far: counts (the summary line's, else the -v
    verdicts seen), each failure's error lines and the tail, with no machine's directories in them."""
    counts = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed)", out):
        counts[word.rstrip("s") if word == "errors" else word] = int(n)
    if not counts.keys() - {
        "deselected"
    }:  # not finished (the header names the deselected): the verdicts so far
        for word in VERDICT.findall(out):
            counts[word.lower()] = counts.get(word.lower(), 0) + 1
    out = out.replace(str(root), "<repo>").replace(sys.prefix, "<python prefix>")
    return {"exit_code": code, "counts": counts, "errors": error_lines(out), "tail": out[-4000:]}


# a failure's header, its ``E`` lines and its ``file:line: Error`` line: run 7's tail (the last 4000
# characters) held only the end of one assertion's repr, not what failed (a Triton compile error)
ERROR_LINE = re.compile(r"^(_{3,} .+ _{3,}|E {2,}.*|\S+\.py:\d+: \w+.*|.+\.py:\d+:\d+: error: .*)$")


def error_lines(out: str, width: int = 300, limit: int = 12000) -> str:
    """Each failed test's error lines of a pytest run's output (each cut to ``width``), at most ``limit``
    characters: the first ones kept (the first failure is the one to read)."""
    lines = [line[:width] for line in out.splitlines() if ERROR_LINE.match(line)]
    text = "\n".join(lines)
    return text if len(text) <= limit else text[:limit] + "\n... (cut)"


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
        breakdown=["plain", "snapkv"],  # where the last-rows statistics' time goes (profiled once each)
    )
    sink({"config": {k: v for k, v in vars(ns).items()}})
    res = bench_prefill_stats.run(ns)
    sink({"config": {k: v for k, v in vars(ns).items()}} | res)


# ------------------------------------------------------------------------------ what cannot run here
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
