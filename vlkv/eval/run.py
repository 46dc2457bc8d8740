"""One command for the measurement report: quality and speed of vlkv policies vs the full cache,
optionally NVIDIA kvpress side by side, written as markdown + plots under ``docs/benchmarks/``.

    python scripts/evaluate.py --model smollm2-llava --peers kvpress
    python scripts/evaluate.py --smoke --out out/report      # tiny model, < 1 minute
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from vlkv.eval.harness import SweepConfig, quality_prompts, quality_records, speed_records

SMOKE = SweepConfig(
    policies=["h2o", "elastic"],
    budgets=[1.0, 0.3],
    new_tokens=4,
    batch_sizes=[1],
    context_words=[8],
    repeats=1,
)


def _images(model: str) -> list:
    if model == "smollm2-llava":
        from vlkv.runtime.models.photos import real_photos

        return real_photos()
    return ["builtin:checkerboard", "builtin:gradient", "builtin:noise"]


def machine_name(device: str) -> str:
    """The machine, not the run's settings: GPU name, or CPU architecture and logical cores."""
    if device == "cuda":
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{platform.machine()}-{os.cpu_count()}t"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evaluate", description="vlkv quality/speed report")
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--budgets", nargs="+", type=float, default=None)
    ap.add_argument("--prompts", type=int, default=4, help="image prompts in the quality batch")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    ap.add_argument("--context-words", nargs="+", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--speed-policies", nargs="+", default=None, help="policies for the speed sweep (default: --policies)"
    )
    ap.add_argument("--speed-budgets", nargs="+", type=float, default=None)
    ap.add_argument("--peers", nargs="*", default=[], help="'kvpress' to run its presses side by side")
    ap.add_argument(
        "--peer-presses", nargs="+", default=["none", "local", "snapkv", "h2o", "pyramidkv", "knorm"]
    )
    ap.add_argument("--no-speed", action="store_true", help="quality only")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, two policies, seconds not minutes")
    ap.add_argument(
        "--out",
        default="docs/benchmarks",
        help="root folder; the report goes in a new <date>-<machine>[-rN]/ (earlier runs are kept)",
    )
    return ap


def config_from(args) -> SweepConfig:
    base = SMOKE if args.smoke else SweepConfig()
    over = {
        "policies": args.policies,
        "budgets": args.budgets,
        "new_tokens": args.new_tokens,
        "batch_sizes": args.batch_sizes,
        "context_words": args.context_words,
        "repeats": args.repeats,
        "speed_policies": args.speed_policies,
        "speed_budgets": args.speed_budgets,
    }
    fields = {k: getattr(base, k) for k in over} | {k: v for k, v in over.items() if v is not None}
    return SweepConfig(**fields)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from(args)
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available")
        model = "tiny-llava" if args.smoke else args.model
        from vlkv.eval.report import write_report
        from vlkv.runtime.engine import Engine
        from vlkv.runtime.models.registry import load_model

        engine = Engine(load_model(model, device=args.device))
        images = _images(model)
        prompts = quality_prompts(images, 2 if args.smoke else args.prompts)
        total = len(cfg.policies) * len(cfg.budgets)
        if not args.no_speed:
            speed_cfgs = 1 + len(cfg.speed_policies) * len(cfg.speed_budgets)
            total += len(cfg.batch_sizes) * len(cfg.context_words) * speed_cfgs
        with tqdm(total=total, desc=f"evaluate {model}") as bar:
            records = quality_records(engine, prompts, cfg, bar)
            if not args.no_speed:
                records += speed_records(engine, images[0], cfg, bar)
        machine = machine_name(args.device)
        for r in records:
            r["model"], r["machine"] = model, machine
        # written now so a failing peer run cannot cost the vlkv measurements
        report = write_report(records, root=args.out, machine=machine, title=f"vlkv on {model}")
        if "kvpress" in args.peers:
            from vlkv.eval.peers import peer_quality_records

            try:
                with tempfile.TemporaryDirectory() as tmp:
                    peers = peer_quality_records(
                        engine,
                        prompts,
                        args.peer_presses,
                        [b for b in cfg.budgets if b < 1],
                        cfg.new_tokens,
                        Path(tmp),
                    )
            except RuntimeError as e:  # kvpress venv missing or its process died: keep what we measured
                print(f"evaluate: kvpress side-by-side skipped: {str(e).splitlines()[0]}", file=sys.stderr)
                peers = []
            for r in peers:
                r["model"], r["machine"] = model, machine
            if peers:
                records += peers
                report = write_report(
                    records, root=args.out, machine=machine, title=f"vlkv on {model}", into=report.out_dir
                )
    except ValueError as e:
        print(f"evaluate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"report: {report.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
