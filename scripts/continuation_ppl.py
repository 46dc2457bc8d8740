"""Real-text continuation perplexity, vlkv policies and kvpress presses side by side.

    python scripts/continuation_ppl.py --side vlkv --out docs/benchmarks/<date>-cpu-x86_64-2t/realtext
    python scripts/continuation_ppl.py --side kvpress --out ...   # another process, once the vlkv
                                                                  # side's full cache has run
    python scripts/continuation_ppl.py --side report --out ...

KL and top-1 agreement are taken against vlkv's full-cache logits, which the vlkv side's first
configuration stores per window (``--reference-dir``); the kvpress side's adapter reads them.

Protocol (``vlkv/eval/continuation.py``): KJV narrative books (Debian ``bible-kjv``), windows of
1024 context + 128 continuation tokens, compressed once after prefill, continuation teacher-forced;
paired bootstrap intervals over windows. A run resumes: stored configurations are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from vlkv.eval.realtext import KVPRESS_CONFIGS, VLKV_CONFIGS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=["vlkv", "kvpress", "report"], required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--per-book", type=int, default=3, help="windows per KJV book (8 books)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    ap.add_argument("--specs", nargs="+", default=None, help="configurations (default: the side's table)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument(
        "--reference-dir",
        type=Path,
        default=None,
        help="full-cache logits per window, for KL and top-1 agreement (25 MB a window; default "
        "${VLKV_CACHE:-~/.cache/vlkv}/realtext-reference/<model>-<context>+<continuation>)",
    )
    ap.add_argument("--no-kl", action="store_true", help="perplexity only (no reference logits)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from vlkv.eval.realtext import run_side, write_report

    if args.side == "report":
        header = (
            f"# Real-text continuation perplexity on `{args.model}`\n\n"
            "Protocol: `vlkv/eval/continuation.py`; text: KJV narrative books (Debian `bible-kjv`, public "
            f"domain); {args.context}-token contexts compressed once after prefill, {args.continuation} "
            "teacher-forced continuation tokens; intervals: paired percentile bootstrap over windows, "
            f"{args.boot} resamples.\n\n"
        )
        print(write_report(args.out, header, args.boot))
        return 0
    from vlkv.eval.continuation import text_windows
    from vlkv.eval.corpus import kjv_books
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    engine = Engine(load_model(args.model))
    tok = engine.tokenizer
    windows = text_windows(
        lambda s: tok(s, add_special_tokens=False)["input_ids"],
        kjv_books(),
        args.per_book,
        args.context,
        args.continuation,
    )
    specs = args.specs or (VLKV_CONFIGS if args.side == "vlkv" else KVPRESS_CONFIGS)
    reference = None
    if not args.no_kl:
        reference = args.reference_dir or (
            Path(os.environ.get("VLKV_CACHE") or "~/.cache/vlkv").expanduser()
            / "realtext-reference"
            / f"{args.model}-{args.context}+{args.continuation}"
        )
    run_side(
        args.side,
        engine,
        windows,
        specs,
        args.budgets,
        args.out,
        args.batch_size,
        log=lambda m: print(m, flush=True),
        reference_dir=reference,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
