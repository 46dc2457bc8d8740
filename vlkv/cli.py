"""``vlkv`` command line: ``vlkv generate ...``.

Every user error (bad budget, unknown policy or setting, missing image, image count not
matching the prompt, unknown model) ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

DEFAULT_PROMPT = "Describe the image."
DEFAULT_IMAGE = "builtin:checkerboard"
EXIT_USAGE = 2


class CliError(ValueError):
    """A user error reported as one line."""


def _printable(text: str) -> str:
    """Generated text with control characters shown as U+00B7, so a terminal stays sane."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def _count_or_fraction(text: str) -> int | float:
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def _parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _read_batch(path: str) -> list[dict]:
    """A batch file: a JSON list, or JSON lines, of ``{"prompt": str, "images": [paths], "raw": bool}``."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"batch file not found: {path}")
    text = p.read_text()
    try:
        items = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
    except json.JSONDecodeError as e:
        raise CliError(f"batch file {path} is not JSON / JSON lines: {e.msg} (line {e.lineno})") from None
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise CliError(f"batch file {path}: entry {i} needs a string 'prompt'")
    return items


def _prompts(args) -> list:
    from vlkv.runtime.prompt import Prompt

    if args.batch_file:
        items = _read_batch(args.batch_file)
        return [Prompt(it["prompt"], list(it.get("images", [])), bool(it.get("raw", False))) for it in items]
    images = args.image
    if args.prompt is None and not images:
        images = [DEFAULT_IMAGE]
    for im in images:
        if not im.startswith("builtin:") and not Path(im).is_file():
            raise CliError(f"image file not found: {im}")
    return [Prompt(args.prompt or DEFAULT_PROMPT, list(images), args.raw)]


def cmd_generate(args) -> int:
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.sampling import Sampler

    settings = _parse_sets(args.set)
    if "budget" in settings:
        raise CliError("set the budget with --budget, not --set budget=...")
    policy = make_policy(args.policy, budget=args.budget, **settings)
    sampler = Sampler(args.do_sample, args.temperature, args.top_k, args.top_p, args.seed)
    prompts = _prompts(args)
    from vlkv.runtime.models.registry import load_model

    engine = Engine(load_model(args.model), backend=args.backend)
    result = engine.generate(
        prompts,
        policy,
        args.max_new_tokens,
        sampler,
        cache_hit_rate=args.cache_hit_rate,
        hit_rate_k=args.hit_rate_k,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    if args.model.startswith("tiny-"):
        print("(built-in tiny model with random weights: the text is noise, the cache numbers are real)")
    for i, s in enumerate(result.samples):
        head = f"[{i}] " if len(result.samples) > 1 else ""
        print(f"{head}{_printable(s.text)}")
    ratio = result.kv_bytes_used / max(result.full_kv_bytes, 1)
    if "cache_hit_rate" in result.extras:
        print(
            f"-- cache hit rate (mean over layers): {result.extras['cache_hit_rate']['mean']:.3f}",
            file=sys.stderr,
        )
    print(
        f"-- policy={result.policy} budget={result.budget} kv={result.kv_bytes_used / 2**20:.2f} MiB "
        f"({ratio:.1%} of full) prefill={result.prefill_s:.3f}s decode={result.decode_s:.3f}s",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlkv", description="KV-cache compression for vision-language models"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text under a KV-cache policy")
    g.add_argument(
        "--model", default="tiny-llava", help="built-in name or local HF directory (default: tiny-llava)"
    )
    g.add_argument(
        "--policy", default="elastic", help="full, local, h2o, snapkv, elastic, ... (default: elastic)"
    )
    g.add_argument(
        "--budget", type=float, default=0.5, help="kept fraction of the cache, in (0, 1] (default: 0.5)"
    )
    g.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="policy setting, repeatable"
    )
    g.add_argument(
        "--prompt", default=None, help=f"user prompt (default: {DEFAULT_PROMPT!r} with a built-in image)"
    )
    g.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="image file or builtin:NAME, repeatable"
    )
    g.add_argument(
        "--raw", action="store_true", help="prompt already holds the chat template and image placeholders"
    )
    g.add_argument("--batch-file", default=None, help="JSON list / JSON lines of {prompt, images, raw}")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--backend", default="torch", help="torch or onnxruntime (default: torch)")
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-hit-rate", action="store_true", help="report VL-Cache's CacheHitRate per layer")
    g.add_argument(
        "--hit-rate-k",
        type=_count_or_fraction,
        default=None,
        help="k for --cache-hit-rate: count, or fraction < 1",
    )
    g.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"vlkv: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
