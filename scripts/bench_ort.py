"""Decode-step time of the ONNX Runtime backend vs the PyTorch backend, at several KV budgets, one run.

Both backends drive the same tiny model, prompts and policy. For each repeat and budget, each backend
prefills (untimed), then both run ``--steps`` decode steps in lockstep through ``Engine.decode``
(backend step + the policy's edits, i.e. what one generated token costs), alternating which goes
first, so bursts of machine load hit both alike. Reported: median ms per decode step, the ratio of
the medians and the median of the per-step ORT / PyTorch ratios.

    python scripts/bench_ort.py --model tiny-llava --budgets 1.0 0.2 --json out.json
    # A-VL as the paper runs it: core-only decode and the prefill filter, on both backends
    python scripts/bench_ort.py --policy avl --budgets 0.5 --option core=0.2 --option prefill_keep=0.5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]
from PIL import Image

from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.ort_backend import THREADS_ENV
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

BACKENDS = ("torch", "onnxruntime")


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))


def _prompts(batch: int, images: int, words: int) -> list[Prompt]:
    text = " ".join(["describe the colours shapes and layout of every picture"] * max(1, words // 9))
    return [Prompt(text, [_image(10 * b + i) for i in range(images)]) for b in range(batch)]


def time_decode(
    engines: dict[str, Engine],
    prompts: list[Prompt],
    policy_name: str,
    budget: float,
    steps: int,
    options: dict | None = None,
):
    """Per-step wall times (ms) of each engine over ``steps`` decode steps after an untimed prefill.

    The engines step in lockstep (alternating which goes first), so a burst of load from other
    processes lands on both backends' samples alike.
    """
    state = {}
    for name, engine in engines.items():
        policy = make_policy(policy_name, budget=budget, **(options or {}))
        batch = engine.encode(prompts)
        cache = engine.new_cache(batch)
        state[name] = [policy, batch, cache, engine.prefill(batch, policy, cache).logits.argmax(-1)]
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(1, steps + 1):
        order = list(engines) if step % 2 else list(reversed(engines))
        for name in order:
            policy, batch, cache, tokens = state[name]
            start = time.perf_counter()
            out = engines[name].decode(tokens, batch, policy, cache, step)
            times[name].append((time.perf_counter() - start) * 1e3)
            state[name][3] = out.logits.argmax(-1)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument(
        "--policy", default="elastic", help="policy at every budget (budget 1.0 = full cache)"
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyper-parameter (repeatable)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--words", type=int, default=60, help="approximate prompt words besides the images")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads of both backends (0: defaults)"
    )
    parser.add_argument("--json", help="also write the results here")
    add_device_args(parser)
    args = parser.parse_args(argv)
    check_device_args(parser, args)
    options = dict(_option(o, parser) for o in args.option)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ[THREADS_ENV] = str(args.threads)

    loaded = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    start = time.perf_counter()
    engines = {name: Engine(loaded, backend=name) for name in BACKENDS}
    setup_s = time.perf_counter() - start  # includes the ONNX export on a cold cache
    prompts = _prompts(args.batch, args.images, args.words)
    prompt_tokens = int(engines["torch"].encode(prompts).lengths.max())
    time_decode(
        engines, prompts, args.policy, max(args.budgets), 2, options
    )  # warm up: first runs allocate / dispatch

    samples = {(b, name): [] for b in args.budgets for name in BACKENDS}
    for _ in range(args.repeats):
        for budget in args.budgets:
            for name, times in time_decode(
                engines, prompts, args.policy, budget, args.steps, options
            ).items():
                samples[(budget, name)] += times
    rows = []
    for budget in args.budgets:
        med = {name: statistics.median(samples[(budget, name)]) for name in BACKENDS}
        paired = [o / t for o, t in zip(samples[(budget, "onnxruntime")], samples[(budget, "torch")])]
        rows.append(
            {
                "budget": budget,
                **{f"{n}_ms": round(med[n], 3) for n in BACKENDS},
                "ort_over_torch": round(med["onnxruntime"] / med["torch"], 3),
                "paired_ratio_median": round(statistics.median(paired), 3),
            }
        )
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs",
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "onnxruntime": __import__("onnxruntime").__version__,
        "torch_threads": torch.get_num_threads(),
        "ort_threads": args.threads or "default (physical cores)",
        "model": args.model,
        "policy": args.policy,
        "policy_options": options,
        "batch": args.batch,
        "prompt_tokens": prompt_tokens,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "setup_s": round(setup_s, 2),
        "rows": rows,
    }
    threads = args.threads or "default"
    print(
        f"{args.model}, batch {args.batch}, {prompt_tokens} prompt tokens, policy {args.policy} {options or ''}, "
        f"threads {threads}"
    )
    print("| budget | PyTorch ms/step | ORT ms/step | ORT / PyTorch | median paired ratio |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['budget']} | {r['torch_ms']:.2f} | {r['onnxruntime_ms']:.2f} | {r['ort_over_torch']:.2f} "
            f"| {r['paired_ratio_median']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _option(text: str, parser: argparse.ArgumentParser) -> tuple[str, object]:
    """``KEY=VALUE`` → (key, value as a Python literal, or the string itself)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        parser.error(f"--option takes KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


if __name__ == "__main__":
    main()
