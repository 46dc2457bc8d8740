"""What query-agnostic scoring costs at compression time, as a ratio to a plain prefill, one run.

    python scripts/bench_scoring_cost.py --model smollm2-llava --tokens 1024 --batch 4 --repeats 3

Every configuration compresses the same KJV windows (``--tokens`` each, ``--batch`` of them) at
budget 0.25 (``Engine.prefill``: prefill with the policy's statistics, its replay, its edit):
KVzip's one-chunk replay, subsampled replays (``every``), KVgrad's replay with its backward pass,
each with the fast scoring pass (the default) or the reference pass (``exact=True``), and
prefill-statistics policies (H2O, SnapKV) for scale. Repeats are interleaved (every configuration
once per repeat, each right after a plain prefill); the ratio is compression / that plain prefill,
median over repeats. Writes ``<out>.json`` and ``<out>.md``.

``--kvpress PRESS ...`` (kvpress peer venv, ``scripts/kvpress_env.py``; ``--batch 1``) adds NVIDIA
kvpress's presses on the same window in the same run: per repeat one adapter process times a plain
HF prefill before each press's compressed prefill (kvpress's own pipeline, its own clock: ``--clock
cpu`` is that process's CPU time), the two sides alternating which goes first. Each side's ratio is to
its own plain prefill; both sides' seconds are written too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
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


def kvpress_times(model_dir, window, presses: list[str], threads: int, clock: str) -> dict[str, tuple]:
    """One kvpress adapter process: per press, a plain prefill then the press's compressed prefill at
    budget 0.25 of ``window``'s context (seconds on ``clock`` in that process); ``press -> (plain, press)``.
    Every job runs once untimed first: the adapter is a fresh process each repeat, and a press's first
    call in it paid up to 3x its later ones (2026-11-26-replay2)."""
    from vlkv.eval.kvpress_peer import KvpressJob, run_kvpress
    from vlkv.eval.realtext import parse_spec

    common = dict(mode="timing", input_ids=list(window.context), max_new_tokens=1, repeats=1)
    common.update(threads=threads or None, clock=clock)
    jobs = [KvpressJob(str(model_dir), "none", warmup=1, **common, id="warm-up")]
    for spec in presses:
        name, kwargs = parse_spec(spec)
        jobs.append(KvpressJob(str(model_dir), "none", warmup=1, **common, id=f"plain {spec}"))
        jobs.append(KvpressJob(str(model_dir), name, 0.25, press_kwargs=kwargs, warmup=1, **common, id=spec))
    results = run_kvpress(jobs)
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise SystemExit(f"error: kvpress job {failed[0]['id']!r} failed: {failed[0]['error']}")
    return {
        spec: (results[1 + 2 * i]["prefill_s"], results[2 + 2 * i]["prefill_s"])
        for i, spec in enumerate(presses)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument(
        "--kvpress",
        nargs="*",
        default=[],
        help="kvpress presses to time beside them, as name:field=value,... (e.g. kvzip kvgrad)",
    )
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
    if args.kvpress and (args.batch != 1 or args.device != "cpu"):
        ap.error("--kvpress times one window on the CPU: use --batch 1 --device cpu")
    if args.kvpress:
        from vlkv.eval.kvpress_peer import kvpress_python

        if kvpress_python() is None:
            ap.error("--kvpress needs the kvpress venv: run `python scripts/kvpress_env.py`")
    from vlkv.runtime.engine import Engine

    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    windows = _windows(engine, args.tokens, args.batch)
    measure(engine, windows, None, args.device, args.clock)  # warm-up
    times: dict[str, list[float]] = {"plain": [], **{c: [] for c in args.configs}}
    ratios: dict[str, list[float]] = {c: [] for c in args.configs}
    peer = {k: [] for k in ("plain", *(f"kvpress:{p}" for p in args.kvpress))}
    peer_ratios: dict[str, list[float]] = {f"kvpress:{p}": [] for p in args.kvpress}
    work = tempfile.TemporaryDirectory(prefix="vlkv-cost-") if args.kvpress else None
    model_dir = None
    if work is not None:
        from vlkv.eval.peers import export_language_model

        model_dir = export_language_model(engine, Path(work.name) / "lm")

    def vlkv_side(rep: int) -> None:
        for spec in args.configs:
            # each configuration against the plain prefill measured just before it: on a machine
            # shared with other jobs the load drifts within a repeat
            plain = measure(engine, windows, None, args.device, args.clock)
            times["plain"].append(plain)
            t = measure(engine, windows, spec, args.device, args.clock)
            times[spec].append(t)
            ratios[spec].append(t / plain)
            print(f"repeat {rep + 1}/{args.repeats} {spec}: {t / plain:.2f}x plain", flush=True)

    def kvpress_side(rep: int) -> None:
        for press, (plain, t) in kvpress_times(
            model_dir, windows[0], args.kvpress, args.threads, args.clock
        ).items():
            key = f"kvpress:{press}"
            peer["plain"].append(plain)
            peer[key].append(t)
            peer_ratios[key].append(t / plain)
            print(f"repeat {rep + 1}/{args.repeats} {key}: {t / plain:.2f}x its plain prefill", flush=True)

    for rep in range(args.repeats):
        # the two sides alternate which goes first
        for side in (vlkv_side, kvpress_side) if rep % 2 == 0 else (kvpress_side, vlkv_side):
            if side is vlkv_side or args.kvpress:
                side(rep)
    if work is not None:
        work.cleanup()
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
        "ratio_range": {c: [min(r), max(r)] for c, r in ratios.items()},
    }
    if args.kvpress:
        res["kvpress_seconds"] = peer
        res["kvpress_ratio_median"] = {c: statistics.median(r) for c, r in peer_ratios.items()}
        res["kvpress_ratio_range"] = {c: [min(r), max(r)] for c, r in peer_ratios.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [
        f"Scoring cost at compression time ({args.model}, {args.dtype}, {machine}; batch {args.batch} x "
        f"{args.tokens} tokens, median of {args.repeats} interleaved repeats, {args.clock} clock)",
        "",
        "| configuration | compression (prefill + statistics + replay + edit) / plain prefill |",
        "|---|---|",
        *(f"| `{c}` | {res['ratio_median'][c]:.2f}x |" for c in args.configs),
        *(
            f"| kvpress `{c[8:]}` (its own plain prefill) | {r:.2f}x |"
            for c, r in res.get("kvpress_ratio_median", {}).items()
        ),
        "",
        f"Plain prefill, median seconds ({args.clock} clock): vlkv {statistics.median(times['plain']):.2f}"
        + (f", kvpress (HF) {statistics.median(peer['plain']):.2f}" if args.kvpress else ""),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
