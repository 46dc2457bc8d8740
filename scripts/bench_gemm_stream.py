"""The few-row GEMM's 1-2 row forms in one run: weight rows in register blocks (before) vs one stream.

``skinny_gemm`` reads a weight for 1-2 rows as one stream, row after row (``rows_stream``); before, as for
3-8 rows, in blocks of 8 weight rows read side by side (``rows_block<R, 8>``, a prefetch one block
ahead). (Since session 8 the kernel's own 1-2 row form is ``rows_block<R, 1>`` with lines 8 KiB ahead:
``bench_skinny_gemm.py``'s ``kernel`` vs ``kernel-s7``.) Both compute every output alike (bit-equal, checked here). This builds both from the kernel's own
C++ text and times them beside a ``sum`` of the same bytes, interleaved and rotated per round, over
copies of each weight 2 MiB apart and visited out of order (``bench_skinny_gemm.ring``): GB/s at the best
and the median of ``--rounds``.

    python scripts/bench_gemm_stream.py --threads 1 --rows 1 2 --md out.md --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from vlkv.plugins import paged_cpu_kernel, skinny_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_name, write_report  # noqa: E402
from bench_skinny_gemm import SHAPES, ring, ring_at, time_once  # noqa: E402

_ENTRY = r"""
torch::Tensor gemm_form(torch::Tensor x, torch::Tensor w, bool blocked) {
  const int64_t K = w.size(1), N = w.size(0), R = x.numel() / K;
  TORCH_CHECK(R == 1 || R == 2, "gemm_form: 1 or 2 rows");
  auto y = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (blocked) {
    if (R == 1) rows_block<1, 8>(xp, wp, nullptr, yp, 0, N, K, N, 8 * K);
    else rows_block<2, 8>(xp, wp, nullptr, yp, 0, N, K, N, 8 * K);
  } else {
    if (R == 1) rows_stream<1>(xp, wp, nullptr, yp, 0, N, K, N);
    else rows_stream<2>(xp, wp, nullptr, yp, 0, N, K, N);
  }
  return y;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--ring-mib", type=int, default=512)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = skinny_gemm._KERNELS + _ENTRY
    mod = paged_cpu_kernel.load_extension(
        [],
        paged_cpu_kernel.build_name(src, "vlkv_bench_gemm_stream"),
        src,
        ["gemm_form"],
        "GEMM forms",
        "none",
    )
    if mod is None:
        sys.exit("bench_gemm_stream: the GEMM forms could not be built here")
    # "after-sum" (not reported): the form timed right after ``sum`` read up to 2× faster than memory
    # allows in every layout tried (copies apart, out of order): a third form takes that seat
    forms = {
        "after-sum": lambda x, w: mod.gemm_form(x, w, False),
        "blocked": lambda x, w: mod.gemm_form(x, w, True),
        "stream": lambda x, w: mod.gemm_form(x, w, False),
        "sum": lambda x, w: w.sum(),
    }
    res = {"machine": machine_name("cpu"), "threads": args.threads, "rounds": args.rounds, "rows": {}}
    lines = [
        f"### {res['machine']}: GB/s of weight read, best / median of {args.rounds} rounds",
        "",
        "| shape × rows | blocked (before) | stream | sum (read) | stream ÷ blocked (median) | stream ÷ sum (best) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in args.shapes:
        n, k = SHAPES[name]
        ws = ring(n, k, args.ring_mib)
        for rows in args.rows:
            x = torch.randn(rows, k)
            assert torch.equal(forms["blocked"](x, ws[0]), forms["stream"](x, ws[0]))  # the same sums
            times = {f: [] for f in forms}
            order, at = list(forms), 0
            for r in range(args.rounds):
                for f in order[r % len(order) :] + order[: r % len(order)]:
                    times[f].append(time_once(forms[f], x, ring_at(ws, at)))
                    at += 1
            times.pop("after-sum")  # timed, not reported
            best = {f: n * k * 4 / min(t) / 1e9 for f, t in times.items()}
            med = {f: n * k * 4 / statistics.median(t) / 1e9 for f, t in times.items()}
            res["rows"][f"{name} x{rows}"] = {"gbps_best": best, "gbps_median": med}
            lines.append(
                f"| {name} x{rows} | {best['blocked']:.1f} / {med['blocked']:.1f} | "
                f"**{best['stream']:.1f}** / {med['stream']:.1f} | {best['sum']:.1f} / {med['sum']:.1f} | "
                f"{med['stream'] / med['blocked']:.2f}× | {best['stream'] / best['sum']:.0%} |"
            )
            print(lines[-1], flush=True)
    write_report("\n".join(lines) + "\n", res, args)


if __name__ == "__main__":
    main()
