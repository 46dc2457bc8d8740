"""Aten ops and host syncs of one decode step, split by what dispatched them, before and after
session 7's one-call decode eviction (``VLKV_CPU_EVICT``), interleaved in one run.

    python docs/benchmarks/2026-11-26-decode-bound-s7-cpu-x86_64/step_ops.py --tokens 1024 \\
        --configs full h2o@0.5 h2o@0.1 snapkv@0.5 snapkv@0.1 avl@0.5 avl@0.1 --md step-ops-1k.md

One prompt (``bench_decode_bound.Prefilled``: document + image + question, ``--tokens`` tokens, 4 rows)
prefilled once; per configuration and code (``after``: this code; ``before``: ``VLKV_CPU_EVICT=0`` and
the kept columns by the int64 + bool sum, ``bench_decode_bound.old_kept_but``) a fresh copy of the
prefilled cache, the policy's prefill edits, then ``--steps`` decode steps; every step's ops are counted
(``TorchDispatchMode``) and attributed to the innermost ``vlkv`` function on the stack, grouped into the
parts below; host syncs as ``vlkv.runtime.op_count`` counts them. Reported: the mean over the steps
and, for steps that evict, the mean over those (``evicting``), and the tokens (equal before and after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import load_for_bench  # noqa: E402
from bench_decode import stats_for  # noqa: E402
from bench_decode_bound import Prefilled, old_kept_but  # noqa: E402

import vlkv.plugins.evict_rows as evict_rows  # noqa: E402
import vlkv.plugins.paged_cpu as paged_cpu  # noqa: E402
import vlkv.runtime.policies.base as policy_base  # noqa: E402
import vlkv.runtime.policies.ranking as ranking  # noqa: E402
from vlkv.runtime.edits import apply_edits  # noqa: E402
from vlkv.runtime.engine import Engine  # noqa: E402
from vlkv.runtime.op_count import count_ops  # noqa: E402
from vlkv.runtime.policies import make_policy  # noqa: E402

# (part, module prefixes) in the order they are matched; the innermost vlkv frame decides
PARTS = [
    (
        "edits",
        (
            "kv.edits",
            "kv.drops",
            "kv.pool:owned_once",
            "kv.pool:release",
            "kv.spares:keep",
            "plugins.evict_rows:drop",
        ),
    ),
    ("policy", ("policies.", "plugins.evict_rows:", "edits:")),
    (
        "append + attention",
        ("kv.paged", "plugins.paged_append", "kv.appends", "kv.pool", "kv.spares", "attention_rows"),
    ),
    ("layers (GEMMs, norms, RoPE)", ("plugins.skinny_gemm", "plugins.layer_glue", "models.")),
]


def part_of(key: str) -> str:
    for name, prefixes in PARTS:
        if key.startswith(prefixes):
            return name
    return "engine, other"


class Attribute(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.parts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, key = sys._getframe(1), "?"
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith("vlkv.") and name != "vlkv.runtime.op_count":
                key = name.removeprefix("vlkv.").removeprefix("runtime.") + ":" + frame.f_code.co_name
                break
            frame = frame.f_back
        self.parts[part_of(key)] += 1
        return func(*args, **(kwargs or {}))


def steps(pre: Prefilled, name: str, n: int, before: bool) -> dict:
    eng = pre.engine
    policy = (
        make_policy(name.split("@")[0], budget=float(name.split("@")[1]))
        if "@" in name
        else make_policy("full")
    )
    kept_but, fused = ranking.kept_but, evict_rows.FUSED_DROP
    if before:
        evict_rows.FUSED_DROP = False
        ranking.kept_but = policy_base.kept_but = old_kept_but
    try:
        cache = pre.cache_copy()
        if "@" in name:
            key = name.split("@")[0]
            stats = stats_for(pre.stats, pre.alias.get(key, key))
            stats.replay = pre.replays.get(key)
            apply_edits(cache, policy.after_prefill(cache, stats, eng.context(pre.batch)))
        tok, rows, tokens = pre.first, [], []
        for step in range(1, n + 2):
            lengths = cache.layers[0].host_lengths()
            with count_ops() as c, Attribute() as a:
                res = eng.decode(tok, pre.batch, policy, cache, step)
            tok = res.logits.argmax(-1)
            tokens.append(tok.tolist())
            evicted = cache.layers[0].host_lengths() != [m + 1 for m in lengths]
            if step > 1:  # the first step grows the tables once
                rows.append({"ops": c.ops, "syncs": c.syncs, "parts": dict(a.parts), "evicted": evicted})
        cache.release()
    finally:
        evict_rows.FUSED_DROP = fused
        ranking.kept_but = policy_base.kept_but = kept_but
    return {"rows": rows, "tokens": tokens}


def mean_parts(rows: list[dict]) -> dict:
    names = [p for p, _ in PARTS] + ["engine, other"]
    return {p: statistics.mean(r["parts"].get(p, 0) for r in rows) for p in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=["full", "h2o@0.5", "h2o@0.1", "snapkv@0.5", "avl@0.5"])
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    paged_cpu.FUSED_KERNEL = True
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    pols = {c: make_policy(c.split("@")[0], budget=float(c.split("@")[1])) for c in args.configs if "@" in c}
    pre = Prefilled(engine, args.model, args.tokens, 4, pols)
    names = [p for p, _ in PARTS] + ["engine, other"]
    lines = [
        f"Aten ops per decode step ({args.model}, {pre.one.input_ids.shape[1]} tokens × 4, 1 thread; mean over "
        f"{args.steps} steps after the first; `evicting`: over the steps that evicted)",
        "",
        "| config | code | steps evicting | ops / step | ops / evicting step | "
        + " | ".join(names)
        + " | host syncs / step | same tokens |",
        "|---|---|---:|---:|---:|" + "---:|" * len(names) + "---:|---|",
    ]
    for name in args.configs:
        got = {code: steps(pre, name, args.steps, code == "before") for code in ("after", "before")}
        same = got["after"]["tokens"] == got["before"]["tokens"]
        for code in ("before", "after"):
            rows = got[code]["rows"]
            ev = [r for r in rows if r["evicted"]]
            parts = mean_parts(ev or rows)
            lines.append(
                f"| {name} | {code} | {len(ev)}/{len(rows)} | {statistics.mean(r['ops'] for r in rows):.0f} | "
                + (f"{statistics.mean(r['ops'] for r in ev):.0f}" if ev else "—")
                + " | "
                + " | ".join(f"{parts[p]:.0f}" for p in names)
                + f" | {statistics.mean(r['syncs'] for r in rows):.1f} | {same} |"
            )
        print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
