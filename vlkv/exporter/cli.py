"""``build-engine RECIPE [--stage NAME] [--set k=v ...] [--out DIR]`` (also ``python -m vlkv.exporter``).

Exit codes:
    0  every requested stage ran or was already up to date
    2  usage or recipe error, a stage failed / was blocked by a failed upstream, or another build-engine
       is building the same --out (one line each on stderr)
    3  every stage that can run here succeeded, but TensorRT / TensorRT-LLM is not installed, so
       trt_engine / trtllm_engine were skipped (their inputs are on disk; see the summary)
    130  interrupted (Ctrl-C), one line
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from vlkv.exporter.errors import BuildLocked

EXIT_OK = 0
EXIT_ERROR = 2
EXIT_TRT_MISSING = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)


def _parser() -> argparse.ArgumentParser:
    from vlkv.exporter.recipe import STAGE_NAMES

    parser = _Parser(
        prog="build-engine",
        description="Export a VLM to ONNX / TensorRT / TensorRT-LLM artifacts as a recipe says.",
        epilog="exit codes: 0 ok, 2 error, 3 TensorRT/TensorRT-LLM stages skipped (not installed)",
    )
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo.yaml")
    parser.add_argument(
        "--stage", action="append", choices=STAGE_NAMES, help="run only this stage (repeatable)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set policy.budget=0.5 (YAML syntax)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="output directory (default: build/<recipe name>)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``build-engine`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        with _notes_to_stderr():
            return _build(args)
    except KeyboardInterrupt:
        print("build-engine: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, BuildLocked) as exc:  # RecipeError, a held --out and friends: already one line
        print(f"build-engine: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        if os.environ.get("VLKV_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"build-engine: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_ERROR


@contextmanager
def _notes_to_stderr() -> Iterator[None]:
    """The exporter's warnings (a rebuilt cache entry, a removed stale folder) as ``build-engine:`` lines."""
    logger = logging.getLogger("vlkv.exporter")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("build-engine: %(message)s"))
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _build(args: argparse.Namespace) -> int:
    from vlkv.exporter.build_lock import build_lock
    from vlkv.exporter.recipe_loader import load_recipe
    from vlkv.exporter.stages import run_stages

    recipe = load_recipe(args.recipe, args.overrides)
    out = args.out or Path("build") / Path(args.recipe).stem
    with build_lock(out):  # before anything in `out` is written: one build per folder
        recipe.to_yaml(out / "resolved_recipe.yaml")
        report = run_stages(recipe, out, only=args.stage, progress=not args.no_progress)
    width = max(len(r.name) for r in report.results) if report.results else 5
    print(f"build-engine: {out}")
    for r in report.results:
        print(f"  {r.name:<{width}}  {r.status:<11}  {r.seconds:6.1f}s  {r.detail}")
    for r in report.results:
        if r.status in ("failed", "blocked"):
            print(f"build-engine: {r.name} {r.status}: {r.detail}", file=sys.stderr)
    if report.failed:
        return EXIT_ERROR
    if report.unavailable:
        for r in report.results:
            if r.status == "unavailable":
                print(f"build-engine: {r.detail}", file=sys.stderr)
        return EXIT_TRT_MISSING
    return EXIT_OK
