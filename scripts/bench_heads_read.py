"""The CPU decode read of per-head tables alone: each KV head its own slots, against the bandwidth.

    python scripts/bench_heads_read.py --tokens 2048 --batch 4 --json heads-read.json --md heads-read.md

One decode row per request over ``--layers`` layers of pools ``(H_kv, S, D)`` (smollm2-llava's shapes
by default: 3 KV heads, GQA 3, D = 64, fp32; 30 layers so the K/V far exceed the caches). Per density
``d`` (the fraction of a request's ``--tokens`` entries each head keeps, drawn at random per head, the
worst case for locality: a real kvzip/snapkv selection is partly clustered) every layer's table keeps
its own slots per head, ragged head lengths. Forms, timed in interleaved rounds with a ``sum`` bandwidth
probe in the same rounds: ``kernel`` (the fused kernel reading each head's table row in place), ``gather``
(the matmul path: one padded gathered copy, then SDPA), and at density 1 ``runs`` (the full cache's
in-place read by runs, the shipped full-cache path). Reports ms per step (all layers), the live K/V
bytes read, GB/s and the fraction of the round's ``sum`` bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vlkv.plugins.paged_cpu as paged_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    cpu_name,  # noqa: E402
    write_report,  # noqa: E402
)


def tables(batch: int, heads: int, tokens: int, density: float, gen: torch.Generator):
    """``table (B, H_kv, n)`` and ``lengths (B, H_kv)``: request ``b`` owns slots ``[b·T, (b+1)·T)``;
    each head keeps a random ``density`` of them (at least one), ascending, ragged lengths."""
    rows = []
    for b in range(batch):
        for _ in range(heads):
            keep = torch.rand(tokens, generator=gen) < density
            keep[-1] = True  # the newest entry: every head holds it
            rows.append(torch.arange(b * tokens, (b + 1) * tokens)[keep])
    n = max(r.numel() for r in rows)
    table = torch.full((batch * heads, n), -1, dtype=torch.long)
    lengths = torch.tensor([r.numel() for r in rows])
    for i, r in enumerate(rows):
        table[i, : r.numel()] = r
    return table.view(batch, heads, n), lengths.view(batch, heads)


def run(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    h, d, b, t = args.kv_heads, args.head_dim, args.batch, args.tokens
    slots = b * t + 64
    pools = [
        (torch.randn(h, slots, d, generator=gen), torch.randn(h, slots, d, generator=gen))
        for _ in range(args.layers)
    ]
    q = torch.randn(b, h * args.group, 1, d, generator=gen)
    probe = torch.ones(args.buffer_mib * 2**20 // 4)
    cases = {dens: [tables(b, h, t, dens, gen) for _ in range(args.layers)] for dens in args.densities}
    forms = [(dens, form) for dens in args.densities for form in ("kernel", "gather")]
    if 1.0 in args.densities:
        forms.append((1.0, "runs"))
    if paged_cpu.paged_cpu_kernel.kernel() is None:
        raise SystemExit("the fused CPU kernel could not be built here (no C++ compiler?)")
    # the full cache as the pool hands it out: one run of slots per request, the same in every head
    runs = (torch.arange(b * t).view(b, 1, t).expand(b, h, t).contiguous(), torch.full((b, h), t))
    times: dict = {f: [] for f in forms}
    bandwidth = []
    default = paged_cpu.FUSED_KERNEL
    try:
        for rep in range(args.repeats + 1):
            tic = time.perf_counter()
            probe.sum()
            bandwidth.append(probe.numel() * 4 / (time.perf_counter() - tic))
            for dens, form in forms[rep % len(forms) :] + forms[: rep % len(forms)]:
                paged_cpu.FUSED_KERNEL = form != "gather"
                tic = time.perf_counter()
                for (k, v), (table, lengths) in zip(pools, cases[dens]):
                    if form == "runs":
                        table, lengths = runs
                    paged_cpu.paged_attention_cpu(q, k, v, table, lengths, d**-0.5)
                if rep:
                    times[(dens, form)].append(time.perf_counter() - tic)
    finally:
        paged_cpu.FUSED_KERNEL = default
    bw = max(bandwidth)
    rows = []
    for dens, form in forms:
        live = sum(int(n.sum()) for _, n in cases[dens]) if form != "runs" else args.layers * b * h * t
        nbytes = live * 2 * d * 4
        ms = 1e3 * statistics.median(times[(dens, form)])
        rows.append(
            {
                "density": dens,
                "form": form,
                "ms": ms,
                "best_ms": 1e3 * min(times[(dens, form)]),
                "kv_bytes": nbytes,
                "gb_s": nbytes / ms / 1e6,
                "of_bandwidth": nbytes / (ms / 1e3) / bw,
            }
        )
    return {
        "machine": cpu_name(),
        "threads": torch.get_num_threads(),
        "shape": {
            "layers": args.layers,
            "batch": b,
            "tokens": t,
            "kv_heads": h,
            "group": args.group,
            "head_dim": d,
        },
        "repeats": args.repeats,
        "bandwidth_gb_s": bw / 1e9,
        "bandwidth_median_gb_s": statistics.median(bandwidth) / 1e9,
        "rows": rows,
    }


def to_markdown(res: dict) -> str:
    s = res["shape"]
    lines = [
        f"Per-head decode read ({res['machine']}, {res['threads']} threads; {s['layers']} layers × {s['batch']} "
        f"requests × {s['tokens']} entries, H_kv {s['kv_heads']}, G {s['group']}, D {s['head_dim']}, fp32; "
        f"median of {res['repeats']} interleaved rounds; `sum` {res['bandwidth_gb_s']:.1f} GB/s best, "
        f"{res['bandwidth_median_gb_s']:.1f} median)",
        "",
        "| density | form | ms (median) | ms (best) | live K/V (MB) | GB/s | of `sum` |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['density']} | {r['form']} | {r['ms']:.1f} | {r['best_ms']:.1f} | {r['kv_bytes'] / 1e6:.0f} "
            f"| {r['gb_s']:.1f} | {r['of_bandwidth']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--densities", nargs="+", type=float, default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    if min(args.tokens, args.batch, args.layers, args.kv_heads, args.group, args.head_dim, args.repeats) < 1:
        ap.error("--tokens, --batch, --layers, --kv-heads, --group, --head-dim and --repeats must be >= 1")
    if any(not 0.0 < x <= 1.0 for x in args.densities):
        ap.error("--densities must be in (0, 1]")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    res = run(args)
    write_report(to_markdown(res), res, args)


if __name__ == "__main__":
    main()
