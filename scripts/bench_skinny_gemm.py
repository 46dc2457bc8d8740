"""The few-row CPU GEMM forms on smollm2-llava's weight shapes, against a plain read of the same bytes.

For each shape ``(N, K)`` (the 30 layers' q/o 576×576, k/v 192×576, gate/up 1536×576, down 576×1536,
the 49152×576 output head) and each row count, times ``F.linear`` (``x @ Wᵀ``, the HF layers),
``(W @ xᵀ)ᵀ`` (``skinny_layer``'s torch form), the C++ kernel (``vlkv/plugins/skinny_gemm.py``), the
same kernel in its session-7 form (``kernel-s7``: 4 weight rows per block at 3-4 rows, the next block
prefetched) and its session-8 form (``kernel-s8``: 2 weight rows per block at 3-8 rows, lines 8 KiB ahead
into L1; both bit-equal, checked; the two form switches around a call add well under 1 µs) and a
STREAM-like ``W.sum()`` (a read of the same bytes at the machine's read bandwidth), interleaved and
rotated per round, one product per form per round over a ring of weight copies larger than the L3
cache (every product reads its weight from memory, as a decode step does). Reports the best (the
shared VM's preemptions only add time) and the median µs per product, and GB/s of weight read at the
best; ``kernel ÷ sum`` is the fraction of the read bandwidth the kernel reaches. ``--huge``: the ring in
huge pages (``weight_pages``' buffer), as the engine places a model's weights.

    python scripts/bench_skinny_gemm.py --threads 1 2 --rows 1 2 4 8 --md out.md --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlkv.plugins import skinny_gemm, weight_pages  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_name  # noqa: E402

SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}
# "after-sum" (not reported): the form timed right after ``sum`` read up to 2× faster than memory allows
# (seen on the 2-core EPYC VM in every ring layout tried); a throwaway product takes that seat
FORMS = {
    "after-sum": lambda x, w: skinny_gemm.kernel().gemm(x, w, None),
    "F.linear": lambda x, w: F.linear(x, w),
    "(W@xT)T": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
    "kernel": lambda x, w: skinny_gemm.kernel().gemm(x, w, None),
    "kernel-s7": lambda x, w: form_gemm(x, w, 1),
    "kernel-s8": lambda x, w: form_gemm(x, w, 2),
    "sum": lambda x, w: w.sum(),
}


def form_gemm(x, w, form: int):
    """The kernel in an earlier form (1: session 7's, 2: session 8's), this CPU kind's default put back after."""
    mod = skinny_gemm.kernel()
    mod.set_gemm_form(form)
    try:
        return mod.gemm(x, w, None)
    finally:
        mod.set_gemm_form(skinny_gemm.default_form())


def ring(n: int, k: int, ring_mib: int, huge: bool = False) -> list[torch.Tensor]:
    """Copies of an ``(n, k)`` weight whose total passes ``ring_mib`` (each read from memory), 2 MiB apart
    and visited out of order (:func:`ring_at`): copies end to end, read in turn, let the hardware
    prefetcher run from one read into the next copy — the form timed after ``sum`` (the most regular
    stream) read up to 2× faster than memory allows. ``huge``: one huge-page buffer (``weight_pages``)."""
    copies = max(2, -(-ring_mib * 2**20 // (n * k * 4))) | 1
    gap = 2**20 // 2  # floats: 2 MiB
    total = copies * (n * k + gap)
    big = weight_pages.kernel().huge_buffer(total).normal_() if huge else torch.randn(total)
    return [big[i * (n * k + gap) : i * (n * k + gap) + n * k].view(n, k) for i in range(copies)]


def ring_at(ws: list[torch.Tensor], at: int) -> torch.Tensor:
    """The ``at``-th read's copy: a large prime stride through the ring (no two reads in a row adjacent)."""
    return ws[(at * 7919) % len(ws)]


def time_once(fn, x, w) -> float:
    t0 = time.perf_counter()
    fn(x, w)
    return time.perf_counter() - t0


def run(args) -> dict:
    res = {
        "machine": machine_name("cpu"),
        "torch": torch.__version__,
        "threads": {},
        "ring_mib": args.ring_mib,
        "rounds": args.rounds,
        "huge": args.huge,
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows_out = {}
        for name in args.shapes:
            n, k = SHAPES[name]
            ws = ring(n, k, args.ring_mib, args.huge)
            for rows in args.rows:
                x = torch.randn(rows, k)
                want = F.linear(x, ws[0])
                torch.testing.assert_close(FORMS["kernel"](x, ws[0]), want, rtol=1e-4, atol=1e-4)
                for before in ("kernel-s7", "kernel-s8"):  # bit-equal forms
                    assert torch.equal(FORMS["kernel"](x, ws[0]), FORMS[before](x, ws[0]))
                times = {f: [] for f in FORMS}
                order = list(FORMS)
                at = 0
                for r in range(args.rounds):
                    for f in order[r % len(order) :] + order[: r % len(order)]:
                        times[f].append(time_once(FORMS[f], x, ring_at(ws, at)))
                        at += 1
                times.pop("after-sum")  # the seat after sum: timed, not reported
                best = {f: min(t) for f, t in times.items()}
                med = {f: statistics.median(t) for f, t in times.items()}
                rows_out[f"{name} x{rows}"] = {
                    "us_best": {f: round(v * 1e6, 1) for f, v in best.items()},
                    "us_median": {f: round(v * 1e6, 1) for f, v in med.items()},
                    "gbps": {f: round(n * k * 4 / v / 1e9, 2) for f, v in best.items()},
                }
                print(
                    threads,
                    name,
                    rows,
                    {f: round(n * k * 4 / v / 1e9, 1) for f, v in best.items()},
                    flush=True,
                )
        res["threads"][str(threads)] = rows_out
    return res


def to_markdown(res: dict) -> str:
    out = []
    for threads, rows in res["threads"].items():
        out += [
            f"\n### {threads} thread(s): GB/s of weight read at the best of {res['rounds']} rounds (µs per product: best / median)\n",
            "| shape × rows | F.linear | (W@xᵀ)ᵀ | kernel | kernel-s7 | kernel-s8 | sum (read) | kernel ÷ sum "
            "| kernel-s7 ÷ sum | kernel-s8 ÷ sum | kernel vs kernel-s7 (median) | kernel vs kernel-s8 (median) "
            "| kernel vs F.linear | kernel vs (W@xᵀ)ᵀ |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, v in rows.items():
            g, ms, md = v["gbps"], v["us_best"], v["us_median"]
            out.append(
                f"| {key} | {g['F.linear']} ({ms['F.linear']} / {md['F.linear']}) | "
                f"{g['(W@xT)T']} ({ms['(W@xT)T']} / {md['(W@xT)T']}) | "
                f"**{g['kernel']}** ({ms['kernel']} / {md['kernel']}) | {g['kernel-s7']} ({ms['kernel-s7']} / "
                f"{md['kernel-s7']}) | {g['kernel-s8']} ({ms['kernel-s8']} / {md['kernel-s8']}) | {g['sum']} "
                f"| {g['kernel'] / g['sum']:.0%} | {g['kernel-s7'] / g['sum']:.0%} | {g['kernel-s8'] / g['sum']:.0%} | "
                f"{md['kernel-s7'] / md['kernel']:.2f}× | {md['kernel-s8'] / md['kernel']:.2f}× "
                f"| {ms['F.linear'] / ms['kernel']:.2f}× | {ms['(W@xT)T'] / ms['kernel']:.2f}× |"
            )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE")
    ap.add_argument(
        "--ring-mib", type=int, default=96, help="weight copies cycled per shape (> the L3 cache)"
    )
    ap.add_argument("--huge", action="store_true", help="the weight copies in huge pages (weight_pages)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    if any(not 1 <= r <= skinny_gemm.MAX_ROWS for r in args.rows):
        ap.error(f"--rows must lie in 1..{skinny_gemm.MAX_ROWS}")
    if args.rounds < 1 or args.ring_mib < 1 or min(args.threads) < 1:
        ap.error("--rounds, --ring-mib and --threads must be >= 1")
    if skinny_gemm.kernel() is None:
        ap.error("the skinny C++ GEMM could not be built (is a C++ compiler installed?)")
    res = run(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if args.md:
        args.md.write_text(to_markdown(res))


if __name__ == "__main__":
    main()
