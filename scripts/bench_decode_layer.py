"""The fused decode layer (two C++ calls per layer outside attention) against the skinny layer's separate calls.

    python scripts/bench_decode_layer.py --model smollm2-llava --tokens 8192 --batch 4 --steps 4 \\
        --repeats 3 --threads 1 --policies snapkv --budgets 0.1 --json l.json --md l.md
    python scripts/bench_decode_layer.py --layers-only --threads 1      # seconds: no prefill
    python scripts/bench_decode_layer.py --tiny                         # seconds: tiny-llava, for the tests

One run, configurations interleaved: (1) the decoder layers alone — every layer of the model over a
decode step's ``--batch`` rows with no cache (one key: attention is negligible), ``--layer-reps`` times
per round, the fused layer (``vlkv/plugins/decode_layer.py``) and the separate calls
(``VLKV_CPU_LAYER=0``) alternating, with the aten ops each dispatches; (2) unless ``--layers-only``,
``bench_decode_bound``'s decode steps (one ``--tokens`` prompt prefilled once, copied into ``--batch``
rows; the fused C++ paged read on) for the full cache and each ``--policies`` × ``--budgets``, each with
the fused layer and again with the separate calls (``<config>+calls``), in a rotating order. Per
configuration: step ms (median over rounds), its bound ``(W + KV) / bandwidth`` (the ``sum`` probe,
best of before/after) and the fraction reached, the paged attention calls' time, aten ops per step, the
fused against the separate calls paired per round (median and range), and whether both decoded the same
greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vlkv.plugins.decode_layer as decode_layer
import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.plugins.skinny_gemm as skinny_gemm
import vlkv.plugins.weight_pages as weight_pages
import vlkv.runtime.models.skinny_layer as skinny_layer
from vlkv.runtime.models.skinny_layer import layer_forward
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_threads_arg, cpu_name, load_for_bench, machine_name, read_bandwidth, write_report  # noqa: E402  # noqa: E402
from bench_decode import weight_bytes  # noqa: E402
from decode_prefilled import Prefilled, vlkv_steps  # noqa: E402

TINY = {"model": "tiny-llava", "tokens": 64, "batch": 2, "steps": 2, "repeats": 1, "buffer_mib": 64}


def _switch(on: bool):
    decode_layer.FUSED_LAYER = on


def _setup(name: str, moved) -> None:
    """A configuration's switches: ``+calls`` the separate calls; ``+huge`` the weights in huge pages
    (``weight_pages``; every other configuration reads them where the checkpoint put them); ``+gemms7``
    the few-row GEMMs in session 7's form (both extensions that compile them; bit-equal)."""
    _switch(not name.endswith("+calls"))
    for mod in (skinny_gemm.kernel(), decode_layer.kernel()):
        if mod is not None:
            mod.set_gemm_form(1 if name.endswith("+gemms7") else skinny_gemm.default_form())
    if moved is not None:
        weight_pages.restore(moved, huge="+huge" in name)


def layers_only(
    engine, batch: int, reps: int, repeats: int, moved=None, gemm_s7: bool = False, read_mib: int = 0
) -> dict:
    """Every decoder layer over ``batch`` fresh rows (no cache), fused vs separate calls (and, with
    ``moved``, fused on huge-page weights; with ``gemm_s7``, fused with session 7's GEMM form),
    interleaved; ``read_mib``: a ``sum`` over that many MiB after each layer, standing in for its
    attention's read of the K/V pool (the weight streams restart cold, as in a decode step)."""
    ad = engine.backend.adapter
    torch.manual_seed(0)
    hidden = torch.randn(batch, 1, ad.text_config.hidden_size)
    pos = torch.full((batch, 1, engine.backend.pos_dims), 8192, dtype=torch.long)
    cos_sin = ad.rotary(hidden, pos)

    gap = torch.ones(read_mib * 2**18) if read_mib else None

    def run() -> torch.Tensor:
        h = hidden
        for layer in ad.layers:
            h = layer_forward(layer, h, None, cos_sin)
            if gap is not None:
                gap.sum()
        return h

    names = ["fused", "fused+calls", *(["fused+huge"] if moved is not None else [])]
    # session 7's GEMM form on the weights the engine reads: huge pages where they were moved
    s7_base = "fused+huge" if moved is not None else "fused"
    names += [f"{s7_base}+gemms7"] if gemm_s7 else []
    times: dict[str, list[float]] = {n: [] for n in names}
    outs, ops = {}, {}
    with torch.no_grad():
        for rep in range(repeats + 1):  # round 0 warms up
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                _setup(name, moved)
                t0 = time.perf_counter()
                for _ in range(reps):
                    outs[name] = run()
                if rep:
                    times[name].append((time.perf_counter() - t0) / reps)
        for name in ("fused", "fused+calls"):
            _setup(name, moved)
            with count_ops() as c:
                run()
            ops[name.removeprefix("fused+")] = c.ops
    _setup("fused", moved)
    times["calls"] = times.pop("fused+calls")
    outs["calls"] = outs.pop("fused+calls")
    ratio = [c / f for c, f in zip(times["calls"], times["fused"], strict=True)]
    huge = {}
    if moved is not None:
        h = [f / g for f, g in zip(times["fused"], times["fused+huge"], strict=True)]
        huge = {
            "huge_ms": 1e3 * statistics.median(times["fused+huge"]),
            "huge_speedup": statistics.median(h),
            "huge_speedup_range": [min(h), max(h)],
            "huge_bit_equal": bool(torch.equal(outs["fused+huge"], outs["fused"])),
        }
    if gemm_s7:
        g = [s / f for f, s in zip(times[s7_base], times[f"{s7_base}+gemms7"], strict=True)]
        huge |= {
            "gemm_s7_on": s7_base,
            "gemm_s7_ms": 1e3 * statistics.median(times[f"{s7_base}+gemms7"]),
            "gemm_s7_speedup": statistics.median(g),
            "gemm_s7_speedup_range": [min(g), max(g)],
            "gemm_s7_bit_equal": bool(torch.equal(outs[f"{s7_base}+gemms7"], outs["fused"])),
        }
    return {
        **huge,
        "read_mib": read_mib,
        "layers": len(ad.layers),
        "rows": batch,
        "fused_ms": 1e3 * statistics.median(times["fused"]),
        "calls_ms": 1e3 * statistics.median(times["calls"]),
        "speedup": statistics.median(ratio),
        "speedup_range": [min(ratio), max(ratio)],
        "ops": ops,
        "max_abs_diff": float((outs["fused"] - outs["calls"]).abs().max()),
        "bit_equal": bool(torch.equal(outs["fused"], outs["calls"])),
    }


def decode_steps(engine, args, moved=None) -> dict:
    pols = {f"{n}@{b}": make_policy(n, budget=b) for n in args.policies for b in args.budgets}
    before = read_bandwidth(args.buffer_mib)
    pre = Prefilled(engine, args.model, args.tokens, args.batch, pols)
    w = weight_bytes(engine)
    extra = ("+huge",) if moved is not None else ()
    configs = [c for base in ["full", *pols] for c in (base, f"{base}+calls", *(base + e for e in extra))]
    got: dict[str, list[dict]] = {c: [] for c in configs}
    fused_default = paged_cpu.FUSED_KERNEL
    paged_cpu.FUSED_KERNEL = True  # the fused C++ paged read for every configuration
    try:
        for rep in range(args.repeats + 1):  # round 0 warms up
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for name in order:
                base = name.removesuffix("+calls").removesuffix("+huge")
                _setup(name, moved)
                key = base.split("@")[0] if base in pols else None
                res = vlkv_steps(pre, pols.get(base, make_policy("full")), args.steps, key)
                if rep:
                    got[name].append(res)
                print(f"  round {rep}: {name} {1e3 * res['step_s']:.1f} ms/step", flush=True)
    finally:
        paged_cpu.FUSED_KERNEL = fused_default
        _setup("fused", moved)
    after = read_bandwidth(args.buffer_mib)
    bandwidth = max(before, after)
    rows = []
    for name in configs:
        rs = got[name]
        step_ms = 1e3 * statistics.median(r["step_s"] for r in rs)
        kv = statistics.median(r["kv_bytes"] for r in rs)
        ops = rs[-1]["ops"]
        row = {
            "config": name,
            "step_ms": step_ms,
            "step_ms_rounds": [1e3 * r["step_s"] for r in rs],
            "attn_ms": 1e3 * statistics.median(r["attn_s"] for r in rs),
            "bound_ms": 1e3 * (w + kv) / bandwidth,
            "of_bound": 1e3 * (w + kv) / bandwidth / step_ms,
            "ops_per_step": getattr(ops, "ops", ops),
        }
        if name.endswith("+huge"):
            base = name.removesuffix("+huge")
            ratio = [b["step_s"] / r["step_s"] for b, r in zip(got[base], rs, strict=True)]
            row["speed_vs_mapped"] = statistics.median(ratio)
            row["speed_vs_mapped_range"] = [min(ratio), max(ratio)]
            row["same_tokens"] = rs[0]["tokens"] == got[base][0]["tokens"]
        elif not name.endswith("+calls"):
            ratio = [c["step_s"] / r["step_s"] for c, r in zip(got[f"{name}+calls"], rs, strict=True)]
            row["speed_vs_calls"] = statistics.median(ratio)
            row["speed_vs_calls_range"] = [min(ratio), max(ratio)]
            row["same_tokens"] = rs[0]["tokens"] == got[f"{name}+calls"][0]["tokens"]
        rows.append(row)
    return {"bandwidth_gbs": [before / 1e9, after / 1e9], "weight_bytes": w, "rows": rows}


def report(res: dict) -> str:
    lo = res["layers_only"]
    lines = [
        f"# Fused decode layer vs separate calls ({res['machine']}, {res['threads']} thread(s))",
        "",
        f"Layers only ({lo['layers']} layers, {lo['rows']} rows, no cache): fused {lo['fused_ms']:.2f} ms, "
        f"separate calls {lo['calls_ms']:.2f} ms, **{lo['speedup']:.2f}×** "
        f"({lo['speedup_range'][0]:.2f}–{lo['speedup_range'][1]:.2f}); aten ops {lo['ops']['fused']} vs "
        f"{lo['ops']['calls']}; outputs bit-equal: {lo['bit_equal']} (max |diff| {lo['max_abs_diff']:.2e})",
    ]
    if "huge_ms" in lo:
        lines.append(
            f"\nWeights in huge pages (`weight_pages`, {res['huge_mib']:.0f} MiB moved): fused {lo['huge_ms']:.2f} ms, "
            f"**{lo['huge_speedup']:.2f}×** the mapped weights ({lo['huge_speedup_range'][0]:.2f}–"
            f"{lo['huge_speedup_range'][1]:.2f}); bit-equal: {lo['huge_bit_equal']}"
        )
    if "gemm_s7_ms" in lo:
        lines.append(
            f"\nThe few-row GEMMs in session 7's form ({lo['gemm_s7_on']}, a {lo['read_mib']} MiB read after each layer): "
            f"{lo['gemm_s7_ms']:.2f} ms, the current form **{lo['gemm_s7_speedup']:.2f}×** that "
            f"({lo['gemm_s7_speedup_range'][0]:.2f}–{lo['gemm_s7_speedup_range'][1]:.2f}); bit-equal: "
            f"{lo['gemm_s7_bit_equal']}"
        )
    if "decode" in res:
        d = res["decode"]
        bw = d["bandwidth_gbs"]
        lines += [
            "",
            f"Decode steps, {res['tokens']} tokens × {res['batch']} rows; `sum` probe {bw[0]:.1f} / {bw[1]:.1f} GB/s",
            "",
            "| config | step ms | bound ms | of bound | attention ms | aten ops | fused vs calls (range) | same tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in d["rows"]:
            key = "speed_vs_calls" if "speed_vs_calls" in r else "speed_vs_mapped"
            vs = (
                f"**{r[key]:.2f}×** ({r[key + '_range'][0]:.2f}–{r[key + '_range'][1]:.2f})"
                + (" vs mapped" if key == "speed_vs_mapped" else "")
                if key in r
                else ""
            )
            lines.append(
                f"| {r['config']} | {r['step_ms']:.1f} | {r['bound_ms']:.1f} | {100 * r['of_bound']:.0f} % | "
                f"{r['attn_ms']:.1f} | {r['ops_per_step']:,} | {vs} | {r.get('same_tokens', '')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer-reps", type=int, default=20, help="layer passes per round (layers only)")
    ap.add_argument("--policies", nargs="*", default=["snapkv"])
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.1])
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--layers-only", action="store_true", help="skip the prefill and the decode steps")
    ap.add_argument("--tiny", action="store_true", help="tiny-llava, a few seconds")
    ap.add_argument("--huge", action="store_true", help="also each fused configuration on huge-page weights")
    ap.add_argument(
        "--gemm-s7", action="store_true", help="layers only: also the fused layer with session 7's GEMM form"
    )
    ap.add_argument(
        "--read-mib",
        type=int,
        default=0,
        help="layers only: MiB read after each layer (its attention's stand-in)",
    )
    ap.add_argument("--json")
    ap.add_argument("--md")
    add_threads_arg(ap)
    args = ap.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        args.layer_reps = 2
        # tiny-llava's weights are below the skinny layer's floor: lowered, so its layers take the C++ path
        skinny_layer.SKINNY_MIN_WEIGHT = 0
    if args.read_mib < 0:
        ap.error(f"--read-mib must be >= 0, got {args.read_mib}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if decode_layer.kernel() is None:
        sys.exit("bench_decode_layer: the decode layer could not be built here")
    from vlkv.runtime.engine import Engine

    # the engine leaves the weights where the checkpoint put them: the configurations move them here
    weight_pages.HUGE_WEIGHTS = False
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    ad = engine.backend.adapter
    moved = weight_pages.move([ad.layers, ad.norm, ad.lm_head]) if args.huge else None
    if moved is not None:
        weight_pages.restore(moved)  # the checkpoint's mapping unless a configuration asks
    res = {
        "machine": f"{cpu_name()} ({machine_name('cpu')})",
        "threads": torch.get_num_threads(),
        "model": args.model,
        "tokens": args.tokens,
        "batch": args.batch,
        "huge_mib": moved.bytes / 2**20 if moved is not None else 0.0,
        "layers_only": layers_only(
            engine, args.batch, args.layer_reps, args.repeats, moved, args.gemm_s7, args.read_mib
        ),
    }
    if not args.layers_only:
        res["decode"] = decode_steps(engine, args, moved)
    write_report(report(res), res, args)


if __name__ == "__main__":
    main()
