"""What query-agnostic scoring costs at compression time, as a ratio to a plain prefill, one run.

    python scripts/bench_scoring_cost.py --model smollm2-llava --tokens 1024 --batch 4 --repeats 3

Every configuration compresses the same KJV windows (``--tokens`` each, ``--batch`` of them) at
budget 0.25 (``Engine.prefill``: prefill with the policy's statistics, its replay, its edit):
KVzip's one-chunk replay, subsampled replays (``every``), KVgrad's replay with its backward pass,
each with the fast scoring pass (the default) or the reference pass (``exact=True``), and
prefill-statistics policies (H2O, SnapKV) for scale. Repeats are interleaved (every configuration
once per repeat, each right after a plain prefill); the ratio is compression / that plain prefill,
median over repeats. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_device_args,
    add_threads_arg,
    check_device_args,
    load_for_bench,
    machine_name,
    sync,
)

CONFIGS = (
    "kvzip:exact=True",
    "kvzip",
    "kvzip:value_norm=True",
    "kvgrad:exact=True",
    "kvgrad",
    "kvgrad:chunk_size=256,every=4",
    "h2o",
    "snapkv:window=64,kernel=5",
)


def _windows(engine, tokens: int, batch: int):
    from vlkv.eval.continuation import text_windows
    from vlkv.eval.corpus import kjv_books

    tok = engine.tokenizer
    windows = text_windows(lambda s: tok(s, add_special_tokens=False)["input_ids"], kjv_books(), 1, tokens, 1)
    if len(windows) < batch:
        raise SystemExit(f"error: only {len(windows)} windows of {tokens} tokens, --batch {batch}")
    return windows[:batch]


def measure(engine, windows, spec: str | None, device: str, clock: str = "wall") -> float:
    """Seconds of one plain prefill (``spec`` None) or of the configuration's whole compression at
    budget 0.25: prefill with its statistics, its replay, its edit (``Engine.prefill``).

    ``clock="cpu"``: the process's CPU time instead of wall time (CPU runs only): on a machine shared
    with other jobs a 1-thread run's CPU time moves far less with the load than its wall time."""
    from vlkv.eval.continuation import _batch
    from vlkv.eval.realtext import parse_spec
    from vlkv.runtime.policies import make_policy

    batch = _batch(windows, engine.pad_id)
    cache = engine.new_cache(batch)
    if spec is None:
        policy = make_policy("full")
    else:
        name, kwargs = parse_spec(spec)
        policy = make_policy(name, budget=0.25, **kwargs)
    now = time.process_time if clock == "cpu" else time.perf_counter
    sync(device)
    t0 = now()
    with torch.no_grad():
        engine.prefill(batch, policy, cache)
    sync(device)
    return now() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/scoring-cost"))
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or the process's CPU time (CPU only; steadier on a shared machine)",
    )
    add_device_args(ap)
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    check_device_args(ap, args)
    if args.clock == "cpu" and args.device != "cpu":
        ap.error("--clock cpu measures CPU runs only")
    if args.repeats < 1 or args.tokens < 2 or args.batch < 1:
        ap.error("--repeats and --batch must be >= 1, --tokens >= 2")
    from vlkv.runtime.engine import Engine

    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    windows = _windows(engine, args.tokens, args.batch)
    measure(engine, windows, None, args.device, args.clock)  # warm-up
    times: dict[str, list[float]] = {"plain": [], **{c: [] for c in args.configs}}
    ratios: dict[str, list[float]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        for spec in args.configs:
            # each configuration against the plain prefill measured just before it: on a machine
            # shared with other jobs the load drifts within a repeat
            plain = measure(engine, windows, None, args.device, args.clock)
            times["plain"].append(plain)
            t = measure(engine, windows, spec, args.device, args.clock)
            times[spec].append(t)
            ratios[spec].append(t / plain)
            print(f"repeat {rep + 1}/{args.repeats} {spec}: {t / plain:.2f}x plain", flush=True)
    machine = machine_name(args.device)
    res = {
        "machine": machine,
        "model": args.model,
        "tokens": args.tokens,
        "batch": args.batch,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "clock": args.clock,
        "seconds": times,
        "ratio_median": {c: statistics.median(r) for c, r in ratios.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [
        f"Scoring cost at compression time ({args.model}, {args.dtype}, {machine}; batch {args.batch} x "
        f"{args.tokens} tokens, median of {args.repeats} interleaved repeats, {args.clock} clock)",
        "",
        "| configuration | compression (prefill + statistics + replay + edit) / plain prefill |",
        "|---|---|",
        *(f"| `{c}` | {res['ratio_median'][c]:.2f}x |" for c in args.configs),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
