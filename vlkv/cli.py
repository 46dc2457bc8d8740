"""``vlkv`` command line: ``vlkv generate ...``.

Every user error (bad budget, policy, setting, sampling value, prompt, image, batch file, a prompt
past the model's position limit, unknown model) ends with one line on stderr and exit status 2,
before any model compute where it can be known that early.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

from vlkv.cli_common import CliError, run_command
from vlkv.cli_common import OneLineParser as _Parser
from vlkv.cli_common import info as _info
from vlkv.link_cli import add_link_args, add_link_check_parser, link_spec

DEFAULT_PROMPT = "Describe the image."
DEFAULT_IMAGE = "builtin:checkerboard"
NOTICES = {
    "tiny-": "built-in tiny model with random weights: the text is noise, the cache numbers are real",
    # first match wins: the random name before its prefix
    "smollm2-llava-random": "real SmolLM2 + DINOv2 weights joined by a random projector: answers about "
    "images are not meaningful, the cache numbers are real",
    "smollm2-llava": "real SmolLM2 + DINOv2 weights, projector trained on procedural coloured shapes "
    "(vlkv.eval.scenes): it answers about such scenes, not about photos",
}


def _printable(text: str) -> str:
    """Generated text with control characters shown as U+00B7, so a terminal stays sane."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def count_or_fraction(text: str) -> int | float:
    """``--hit-rate-k``: a count (an integer >= 1) or a fraction in (0, 1)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0 and (value < 1 or value.is_integer())):
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction in (0, 1), got {text!r}")
    return int(value) if value >= 1 else value


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# ---------------------------------------------------------------- policy settings
def _parse_sets(pairs: list[str]) -> dict:
    """``["key=value", ...]`` → ``{key: YAML value}``; a malformed pair or YAML value is one line."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(f"--set expects key=value, got {pair!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
            raise CliError(f"--set {key}: {value!r} is not a valid value ({problem})") from None
    return out


def _budget(args, settings: dict) -> dict:
    """``{"budget": b}`` for make_policy: the default applies only to policies compressing by budget."""
    from vlkv.runtime.policies.settings import default_budget

    if args.budget is not None:
        return {"budget": args.budget}
    return default_budget(args.policy, settings)


# ---------------------------------------------------------------- prompts
def _prompts(args) -> list:
    from vlkv.runtime.prompt import Prompt, read_batch_file

    if args.batch_file:
        given = [
            flag
            for flag, value in (("--prompt", args.prompt), ("--image", args.image), ("--raw", args.raw))
            if value
        ]
        if given:
            raise CliError(
                f"--batch-file holds the prompts and images; {' and '.join(given)} would be ignored: drop {'them' if len(given) > 1 else 'it'}"
            )
        return read_batch_file(args.batch_file)
    images = args.image
    if args.prompt is None and not images:
        images = [DEFAULT_IMAGE]
    for im in images:
        if not im.startswith("builtin:") and not Path(im).is_file():
            raise CliError(f"image file not found: {im}")
    return [Prompt(args.prompt if args.prompt is not None else DEFAULT_PROMPT, list(images), args.raw)]


# ---------------------------------------------------------------- output
def _notice(model: str) -> str | None:
    """What to keep in mind about a built-in model's answers (None for a checkpoint directory)."""
    from vlkv.runtime.models.registry import MODELS

    if model not in MODELS:
        return None
    return next((text for prefix, text in NOTICES.items() if model.startswith(prefix)), None)


def _describe(prompt, tokens: int) -> str:
    images = ", ".join(im if isinstance(im, str) else "an image" for im in prompt.images) or "no image"
    text = prompt.text if len(prompt.text) <= 60 else prompt.text[:57] + "..."
    return f"{json.dumps(_printable(text), ensure_ascii=False)} + {images} ({tokens} tokens)"


def _answer(sample, eos: set[int]) -> str:
    """The generated text, or why there is none to show (an empty answer is not an empty line)."""
    if sample.text.strip():
        return _printable(sample.text)
    ids = sample.token_ids
    shown = "[" + ", ".join(map(str, ids[:16])) + (", ...]" if len(ids) > 16 else "]")
    if ids and ids[0] in eos:
        return f"(empty answer: the model ended its answer at once; token ids {shown})"
    return f"(empty answer: {len(ids)} token(s) that decode to no visible text; token ids {shown})"


def _print_report(args, prompts, lengths, result, eos) -> None:
    """Answers on stdout; what ran and what the cache cost on stderr (``-- `` lines)."""
    from vlkv.runtime.policies.settings import NO_BUDGET

    model = Path(args.model).name if Path(args.model).is_dir() else args.model
    notice = _notice(args.model)
    _info(f"-- model: {model}" + (f" ({notice})" if notice else ""))
    budget = "no budget" if result.policy in NO_BUDGET else f"budget {result.budget:g}"
    _info(f"-- policy: {result.policy}, {budget}")
    many = len(prompts) > 1
    for i, (prompt, sample) in enumerate(zip(prompts, result.samples)):
        head = f"[{i}] " if many else ""
        _info(f"-- {head}prompt: {_describe(prompt, lengths[i])}")
        print(f"{head}{_answer(sample, eos)}")
    used, full = result.kv_bytes_used, max(result.full_kv_bytes, 1)
    _info(
        f"-- kv: {_size(used)} of {_size(full)} full ({1 - used / full:.0%} saved); "
        f"prefill {result.prefill_s:.3f} s, decode {result.decode_s:.3f} s for {result.decode_steps} step(s)",
    )
    if "store" in result.extras:
        st = result.extras["store"]
        _info(
            f"-- link: {st['hits']} hit(s), {st['misses']} miss(es); {st['reused_tokens']} tokens reused, "
            f"{st['recomputed_tokens']} recomputed"
        )
    if "cache_hit_rate" in result.extras:
        _info(f"-- cache hit rate (mean over layers): {result.extras['cache_hit_rate']['mean']:.3f}")


# ---------------------------------------------------------------- command
def cmd_generate(args) -> int:
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.limits import check_fits, position_limit
    from vlkv.runtime.models.registry import load_model
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.policies.settings import check_compresses, check_setting_sizes, check_setting_types
    from vlkv.runtime.sampling import Sampler

    settings = _parse_sets(args.set)
    if "budget" in settings:
        raise CliError("set the budget with --budget, not --set budget=...")
    check_setting_types(args.policy, settings, "--set ")
    policy = make_policy(args.policy, **_budget(args, settings), **settings)
    if args.backend != "torch" and hasattr(policy, "replay_request"):
        from vlkv.runtime.replay import replay_refusal

        raise CliError(replay_refusal(args.backend, getattr(policy, "gradient", False)))
    sampler = Sampler(args.do_sample, args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from vlkv.runtime.device import resolve_device

    device = resolve_device(args.device)
    store = None
    if args.store is not None:
        from vlkv.runtime.store.identity import validate_tenant
        from vlkv.runtime.store.url import open_store

        validate_tenant(args.tenant)
        if args.link == "none":
            raise CliError(
                "--store needs --link (prefix, full-reuse, cacheblend or mpic): without linking nothing is reused"
            )
        store = open_store(args.store)
    link = None if args.link == "none" and args.link_k is None else link_spec(args)
    if args.link_threshold is not None and not 0.0 <= args.link_threshold <= 1.0:  # NaN too
        raise CliError(f"--link-threshold must be in [0, 1], got {args.link_threshold}")
    if args.pool_bytes is not None and args.pool_bytes < 1:
        raise CliError(f"--pool-bytes must be >= 1, got {args.pool_bytes}")
    if args.cuda_graph:
        from vlkv.runtime.cuda_graph import cli_refusal

        why = cli_refusal(device, args.backend, fixed_pool=args.pool_bytes is not None)
        if why is not None:
            raise CliError(why)
    prompts = _prompts(args)
    loaded = load_model(args.model, device=str(device))
    limit = position_limit(loaded)
    check_setting_sizes(settings, limit, loaded.name, "--set ")
    engine = Engine(loaded, backend=args.backend, decode_graph=args.cuda_graph)
    # Tokenizing is cheap; refuse prompts past the position limit before the first layer runs.
    batch = engine.encode(prompts)
    lengths = batch.lengths.tolist()
    check_fits(lengths, args.max_new_tokens, limit, loaded.name)
    check_compresses(policy, settings, min(lengths), "--set ")
    note = None
    if link is not None and link.method == "mpic":
        sizes = [e - s for p in batch.prompts for s, e in p.spans.image_spans]
        if sizes and link.k >= min(sizes):
            note = (
                f"-- note: --link-k {link.k} is not below an image's {min(sizes)} tokens: MPIC recomputes "
                f"every token of such an image and reuses none; use --link-k below {min(sizes)}"
            )
    result = engine.generate(
        prompts,
        policy,
        args.max_new_tokens,
        sampler,
        cache_hit_rate=args.cache_hit_rate,
        hit_rate_k=args.hit_rate_k,
        pool_bytes=args.pool_bytes,
        link=link,
        store=store,
        tenant=args.tenant,
        link_threshold=args.link_threshold,
    )
    for why in result.extras.get("link_refused", []):
        _info(f"-- {why}")
    if note:  # after the run, so a refused configuration stays one line
        _info(note)
    if args.json:
        described = [
            {"text": p.text, "images": [im if isinstance(im, str) else "<image>" for im in p.images]}
            for p in prompts
        ]
        print(json.dumps({"model": args.model, "prompts": described, **result.to_dict()}, indent=2))
        return 0
    _print_report(args, prompts, lengths, result, engine.eos_ids)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vlkv", description="KV-cache compression for vision-language models")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text under a KV-cache policy")
    g.add_argument(
        "--model", default="tiny-llava", help="built-in name or local HF directory (default: tiny-llava)"
    )
    g.add_argument(
        "--policy", default="elastic", help="full, local, h2o, snapkv, elastic, ... (default: elastic)"
    )
    g.add_argument(
        "--budget",
        type=float,
        default=None,
        help="kept fraction of the cache, in (0, 1] (default: 0.5; policy 'full' takes none, attnpack "
        "compresses by rank and keeps its own)",
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
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay plain decode steps as a CUDA graph per batch size (CUDA, torch backend, --pool-bytes; "
        "experimental: off until a GPU run has measured it)",
    )
    g.add_argument(
        "--link",
        default="none",
        help="reuse stored image K/V: none, prefix, full-reuse, cacheblend or mpic (later prompts reuse "
        "earlier ones' images)",
    )
    g.add_argument(
        "--store",
        default=None,
        help="context store: a directory, redis://host:port/db or mooncake://host:port?metadata=URL "
        "(every process on the same URL shares records)",
    )
    g.add_argument(
        "--link-threshold",
        type=float,
        default=None,
        help="refuse linking when the model's saved link-check agreement is below this (default 0.9)",
    )
    g.add_argument(
        "--tenant", default="default", help="whose stored records a request may link (default: default)"
    )
    add_link_args(g, k_default=None)
    g.add_argument(
        "--pool-bytes",
        type=int,
        default=None,
        help="fixed KV pool size in bytes (continuous batching admits, preempts within it; default: grows)",
    )
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-hit-rate", action="store_true", help="report VL-Cache's CacheHitRate per layer")
    g.add_argument(
        "--hit-rate-k",
        type=count_or_fraction,
        default=None,
        help="k for --cache-hit-rate: count, or fraction < 1",
    )
    g.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    g.set_defaults(func=cmd_generate)
    from vlkv.store_cli import add_store_parser

    add_store_parser(sub)
    from vlkv.serve.cli import add_serve_parser

    add_serve_parser(sub)
    add_link_check_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
