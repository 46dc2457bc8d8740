"""Where a decode step's time outside attention goes, and the skinny-GEMM layers against the HF ones.

    python scripts/bench_layer_glue.py --model smollm2-llava --tokens 2048 --batch 4 --threads 1 \\
        --steps 4 --repeats 6 --json glue.json --md glue.md

One run, one prefill (``bench_decode_bound.Prefilled``: a batch of one repeated into ``--batch`` rows).
Per round, in a rotating order, ``--steps`` timed greedy decode steps of each configuration: the full
cache and each ``--policies`` at each ``--budgets``, each with the default skinny GEMMs (``<config>``:
few-row GEMMs as ``(W @ xᵀ)ᵀ``, ``vlkv/runtime/models/skinny_layer.py``) and with the HF layers
(``<config>-hf``: ``FamilyAdapter.skinny = False``, what ``VLKV_SKINNY_GEMM=0`` gives).
Per configuration: step ms (median over rounds of the mean step), the paged attention calls' own time,
the rest ("outside attention"), aten ops per step, and the ratio against its ``-hf`` twin paired per
round. Then one profiled step per mode: self CPU ms per aten op (top ``--top``), the ``linear`` family's
share and the Python time between ops (wall − the ops' self time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_threads_arg,
    load_for_bench,
    machine_name,
    read_bandwidth,  # noqa: E402
)
from bench_decode import weight_bytes  # noqa: E402
from decode_prefilled import Prefilled, vlkv_steps  # noqa: E402

GEMM = ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm")


def profile_step(pre: Prefilled, policy, top: int) -> dict:
    """One decode step (after one untimed) under ``torch.profiler``: self CPU ms per aten op."""
    from torch.profiler import ProfilerActivity, profile

    cache = pre.cache_copy()
    eng, tok = pre.engine, pre.first
    tok = eng.decode(tok, pre.batch, policy, cache, 1).logits.argmax(-1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        eng.decode(tok, pre.batch, policy, cache, 2)
        wall = time.perf_counter() - t
    cache.release()
    rows = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in rows}
    calls = {e.key: e.count for e in rows}
    ranked = sorted(self_ms, key=self_ms.get, reverse=True)[:top]
    gemm = sum(v for k, v in self_ms.items() if k in GEMM)
    return {
        "wall_ms": 1e3 * wall,
        "aten_self_ms": sum(self_ms.values()),
        "gemm_ms": gemm,
        "gemm_calls": sum(calls.get(k, 0) for k in ("aten::addmm", "aten::mm")),
        "top": [(k, round(self_ms[k], 2), calls[k]) for k in ranked],
    }


def run(args) -> dict:
    bandwidth = read_bandwidth(args.buffer_mib)
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    adapter = engine.backend.adapter
    pols = {f"{n}@{b}": make_policy(n, budget=b) for n in args.policies for b in args.budgets}
    pre = Prefilled(engine, args.model, args.tokens, args.batch, pols)
    full = make_policy("full")
    bases = ["full", *pols]
    configs = [c for b in bases for c in (b, f"{b}-hf")]
    got: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeats + 1):  # round 0 warms up (untimed)
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for name in order:
            base = name.removesuffix("-hf")
            adapter.skinny = not name.endswith("-hf")
            res = vlkv_steps(
                pre, pols.get(base, full), args.steps, base.split("@")[0] if base in pols else None
            )
            if rep:
                got[name].append(res)
            print(f"  round {rep}: {name} {1e3 * res['step_s']:.1f} ms/step ({res['ops']} ops)", flush=True)
    adapter.skinny = True
    w = weight_bytes(engine)
    out = {
        "machine": machine_name("cpu"),
        "threads": torch.get_num_threads(),
        "bandwidth": bandwidth,
        "weights": w,
    }
    out["configs"] = {}
    for name, runs in got.items():
        step = statistics.median(r["step_s"] for r in runs)
        attn = statistics.median(r["attn_s"] for r in runs)
        kv = statistics.median(r["kv_bytes"] for r in runs)
        twin = name.removesuffix("-hf") + "-hf"
        pair = (
            statistics.median(h["step_s"] / r["step_s"] for r, h in zip(runs, got[twin]))
            if twin != name
            else None
        )
        out["configs"][name] = {
            "step_ms": 1e3 * step,
            "attn_ms": 1e3 * attn,
            "outside_ms": 1e3 * statistics.median(r["step_s"] - r["attn_s"] for r in runs),
            "ops": runs[-1]["ops"],
            "kv_bytes": kv,
            "of_bound": (w + kv) / bandwidth / step,
            "speedup_vs_hf": pair,  # 1.0 for the -hf configuration itself
            "tokens_equal_hf": all(r["tokens"] == h["tokens"] for r, h in zip(runs, got[twin])),
        }
    out["profile"] = {}
    for mode in ("skinny", "hf"):
        adapter.skinny = mode == "skinny"
        out["profile"][mode] = profile_step(pre, full, args.top)
    adapter.skinny = True
    return out


def markdown(res: dict) -> str:
    lines = [
        f"machine: {res['machine']}, {res['threads']} thread(s); read bandwidth {res['bandwidth'] / 1e9:.1f} GB/s; "
        f"weights {res['weights'] / 1e9:.2f} GB",
        "",
        "| config | step ms | attention ms | outside attention ms | aten ops/step | HF layers ÷ this (paired) "
        "| step of its bound | tokens = HF layers |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in res["configs"].items():
        ratio = f"{c['speedup_vs_hf']:.2f}×" if not name.endswith("-hf") else ""
        lines.append(
            f"| {name} | {c['step_ms']:.1f} | {c['attn_ms']:.1f} | {c['outside_ms']:.1f} | {c['ops']} | {ratio} "
            f"| {100 * c['of_bound']:.0f} % | {c['tokens_equal_hf']} |"
        )
    for mode, p in res["profile"].items():
        lines += [
            "",
            f"profiled full-cache step, {mode} layers: wall {p['wall_ms']:.1f} ms, aten self {p['aten_self_ms']:.1f} ms, "
            f"GEMMs {p['gemm_ms']:.1f} ms in {p['gemm_calls']} calls",
            "",
            "| aten op | self ms | calls |",
            "|---|---:|---:|",
            *(f"| {k} | {ms} | {n} |" for k, ms, n in p["top"]),
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--policies", nargs="*", default=["snapkv"])
    ap.add_argument("--budgets", nargs="*", type=float, default=[0.1])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    text = markdown(res)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
