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


DEFAULT_MODEL = "smollm2-llava"
DEFAULT_PROMPTS = 4
SMOKE_MODEL, SMOKE_PROMPTS = "tiny-llava", 2


def check_out(out: str) -> None:
    """Refuse an ``--out`` that is a file or cannot be created before minutes of measuring."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file: it must be a folder (each report goes in a new subfolder)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")


def model_and_prompts(args) -> tuple[str, int]:
    """``--smoke`` fixes the model and the prompt count: naming them too is refused, not ignored."""
    if args.smoke:
        given = [
            flag
            for flag, value in (("--model", args.model), ("--prompts", args.prompts))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"--smoke runs {SMOKE_MODEL} on {SMOKE_PROMPTS} prompts; {' and '.join(given)} would be ignored: "
                f"drop {'them' if len(given) > 1 else 'it'} or drop --smoke"
            )
        return SMOKE_MODEL, SMOKE_PROMPTS
    prompts = DEFAULT_PROMPTS if args.prompts is None else args.prompts
    if prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {prompts}")
    return args.model or DEFAULT_MODEL, prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evaluate", description="vlkv quality/speed report")
    ap.add_argument("--model", default=None, help=f"model to measure (default: {DEFAULT_MODEL})")
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--budgets", nargs="+", type=float, default=None)
    ap.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"image prompts in the quality batch (default: {DEFAULT_PROMPTS})",
    )
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
        model, n_prompts = model_and_prompts(args)
        check_out(args.out)
        from vlkv.eval.report import write_report
        from vlkv.runtime.engine import Engine
        from vlkv.runtime.models.registry import load_model

        engine = Engine(load_model(model, device=args.device))
        images = _images(model)
        prompts = quality_prompts(images, n_prompts)
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
    except KeyboardInterrupt:
        print("evaluate: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"evaluate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # the report folder went away or filled up while measuring
        print(f"evaluate: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    print(f"report: {report.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
