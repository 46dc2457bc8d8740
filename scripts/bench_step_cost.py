"""A compressed decode step's fixed cost, before and after a change of its paths, in one run.

    python scripts/bench_step_cost.py --model smollm2-llava --tokens 4096 --batch 4 --threads 1 \\
        --policies h2o avl --budgets 0.5 0.1 --json step-cost.json --md step-cost.md
    python scripts/bench_step_cost.py --change pack --policies snapkv h2o --budgets 0.5 0.1
    python scripts/bench_step_cost.py --tiny --json t.json   # seconds: tiny-llava, for the tests

``--change steps`` (the default) compares session 5's per-step paths with the ones before them;
``--change pack`` compares packing (``vlkv.runtime.kv.packing``: a prompt's eviction moves each row's
kept K/V into one run of slots) with the kept entries left where they lie.

One prompt prefilled once (``bench_decode_bound.Prefilled``), then per round, in a rotating order,
``--steps`` timed greedy decode steps of each ``policy@budget`` twice, back to back (which runs first
alternates by round, so each pair shares the load of its moment): **after** (this code) and
**before** (the per-step paths as they were: H2O's edits without the dropped columns, the cache's
search for them by a sort, the tables rebuilt where a one-column drop now closes its gap in place,
a full sort where a few kept of many are now found by ``topk``, A-VL's per-layer hooks from
``vlkv/runtime/policies/avl_reference.py``).
With ``--change pack`` the before is the same code with packing off (``kv.packing.PACK``).
``--controls`` adds policies this change leaves alone (no per-step work: snapkv, vlcache).
Per configuration: step ms (median over rounds of the mean step), its bound ``(W + KV) / bandwidth``
(as ``bench_decode_bound.py``: ``W`` the weights a step reads, ``KV`` the K/V it attends, the read
bandwidth the better of a ``sum`` before and after the rounds) and the fraction of it reached, the
policy's decode hook (``after_decode``), the edits' application (``apply_edits``) and the paged
attention calls (the K/V read, every layer; ``decode_reads.AttnTimer``) per step, aten ops per
step, the ascending runs of slots per table row after the prefill's edits (mean) and those edits'
time, and before / after paired per round (the step, and the attention calls alone); the tokens of
before and after must be equal (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import cpu_name, load_for_bench, machine_name, read_bandwidth  # noqa: E402  # noqa: E402
from bench_decode import stats_for, weight_bytes  # noqa: E402
from decode_prefilled import Prefilled, old_kept_but  # noqa: E402
from decode_reads import AttnTimer  # noqa: E402

import vlkv.plugins.evict_rows as evict_rows  # noqa: E402
import vlkv.runtime.edits as run_edits  # noqa: E402
import vlkv.runtime.kv.drops as drops  # noqa: E402
import vlkv.runtime.kv.edits as kv_edits  # noqa: E402
import vlkv.runtime.kv.packing as packing  # noqa: E402
import vlkv.runtime.policies.base as base  # noqa: E402
import vlkv.runtime.policies.ranking as ranking  # noqa: E402
from vlkv.runtime.edits import apply_edits  # noqa: E402
from vlkv.runtime.engine import Engine  # noqa: E402
from vlkv.runtime.op_count import count_ops  # noqa: E402
from vlkv.runtime.policies import make_policy  # noqa: E402

TINY = {"model": "tiny-llava", "tokens": 64, "batch": 2, "steps": 3, "repeats": 1, "buffer_mib": 64}


@contextlib.contextmanager
def unpacked():
    """A prompt's eviction leaves the kept entries where they lie (``kv.packing`` off)."""
    pack, packing.PACK = packing.PACK, False
    try:
        yield
    finally:
        packing.PACK = pack


@contextlib.contextmanager
def before():
    """The per-step paths as they were: no dropped columns handed to the cache, found by a sort, the
    tables rebuilt instead of rewritten in place."""
    ranked, search, highest = base.rank_entries, kv_edits.unlisted, ranking._keep_highest
    in_place, fused = drops.IN_PLACE, evict_rows.FUSED_DROP
    evict_rows.FUSED_DROP = False  # session 7's one-call drops hand the hint too
    kept_but = ranking.kept_but
    ranking.kept_but = base.kept_but = old_kept_but
    base.rank_entries = lambda *a, **k: (*ranked(*a, **k)[:2], None)
    kv_edits.unlisted = lambda listed, m: torch.sort(listed, dim=2, stable=True).indices[:, :, :m]
    ranking._keep_highest = sorted_keep
    drops.IN_PLACE = False
    try:
        yield
    finally:
        base.rank_entries, kv_edits.unlisted, ranking._keep_highest = ranked, search, highest
        drops.IN_PLACE, evict_rows.FUSED_DROP = in_place, fused
        ranking.kept_but = base.kept_but = kept_but


def sorted_keep(ranked, keep, kmax: int):
    """``ranking._keep_highest`` as it was done before: a stable sort of every row, then of the picks."""
    s = ranked.shape[-1]
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :kmax]
    ranks = torch.arange(kmax, device=ranked.device)[None, None, :]
    top = torch.sort(torch.where(ranks < keep[:, None, None], top, torch.full_like(top, s)), dim=-1).values
    return top.masked_fill(top == s, 0)


# what each ``--change`` puts back for its before: the code, and whether A-VL takes its per-layer hooks
CHANGES = {"steps": (before, True), "pack": (unpacked, False)}


def make(name: str, old: bool):
    """``name`` = ``policy@budget``; ``old``: A-VL's per-layer hooks (the reference class)."""
    policy, budget = name.split("@")
    if old and policy == "avl":
        from vlkv.runtime.policies.avl_reference import PerLayerAVL

        return PerLayerAVL(budget=float(budget))
    return make_policy(policy, budget=float(budget))


class PhaseTimer:
    """Wall seconds of ``policy.after_decode`` and ``apply_edits`` inside a decode step."""

    def __init__(self, policy):
        self.seconds = {"after_decode": 0.0, "apply_edits": 0.0}
        self.policy, self.apply = policy, run_edits.apply_edits

    def _wrap(self, key, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        return timed

    def __enter__(self):
        self.policy.after_decode = self._wrap("after_decode", self.policy.after_decode)
        # the engine calls it through this module (``_edits.apply_edits``)
        run_edits.apply_edits = self._wrap("apply_edits", self.apply)
        return self

    def __exit__(self, *exc):
        del self.policy.after_decode
        run_edits.apply_edits = self.apply


def steps_of(pre, name: str, old: bool, steps: int) -> dict:
    """``steps + 1`` greedy decode steps from the prefill (the first untimed), then one counted."""
    eng, policy = pre.engine, make(name, old)
    key = name.split("@")[0]
    cache = pre.cache_copy()
    ctx = eng.context(pre.batch)
    stats = stats_for(pre.stats, pre.alias.get(key, key))
    stats.replay = pre.replays.get(key)
    t0 = time.perf_counter()
    apply_edits(cache, policy.after_prefill(cache, stats, ctx))
    prefill_edit = time.perf_counter() - t0
    runs = torch.cat([packing.row_runs(layer).flatten() for layer in cache.layers]).double().mean()
    be = eng.backend
    entry = 2 * be.num_kv_heads * be.head_dim * torch.finfo(be.dtype).bits // 8
    tok, times, hooks, edits, kv, tokens, attn = pre.first, [], [], [], [], [], []
    with PhaseTimer(policy) as timer, AttnTimer() as reads:
        for step in range(steps + 1):
            timer.seconds = dict.fromkeys(timer.seconds, 0.0)
            reads.seconds = 0.0
            t0 = time.perf_counter()
            out = eng.decode(tok, pre.batch, policy, cache, step + 1)
            tok = out.logits.argmax(-1)
            if step:
                times.append(time.perf_counter() - t0)
                hooks.append(timer.seconds["after_decode"])
                edits.append(timer.seconds["apply_edits"])
                attn.append(reads.seconds)
                kv.append(float(out.attended.sum()) * entry)
            tokens.append(tok.tolist())
    with count_ops() as c:
        eng.decode(tok, pre.batch, policy, cache, steps + 2)
    cache.release()
    mean = statistics.mean
    return {
        "step_s": mean(times),
        "hook_s": mean(hooks),
        "edits_s": mean(edits),
        "attn_s": mean(attn),
        "kv_bytes": mean(kv),
        "ops": c.ops,
        "tokens": tokens,
        "runs_per_row": float(runs),
        "prefill_edit_s": prefill_edit,
    }


def run(args) -> dict:
    bw_before = read_bandwidth(args.buffer_mib)
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    names = [f"{p}@{b}" for p in args.policies for b in args.budgets]
    controls = [f"{p}@{b}" for p in args.controls for b in args.budgets]
    pre = Prefilled(
        engine, args.model, args.tokens, args.batch, {n: make(n, False) for n in names + controls}
    )
    configs = [(n, False) for n in names + controls] + [(n, True) for n in names]
    got: dict[tuple, list[dict]] = {c: [] for c in configs}
    every = names + controls
    for rep in range(args.repeats + 1):  # the first round warms up
        # rotated every round; a policy's before and after run back to back (which first alternates),
        # so that each round's pair shares the machine's load of the moment
        order = []
        for name in every[rep % len(every) :] + every[: rep % len(every)]:
            pair = [(name, False), (name, True)] if name in names else [(name, False)]
            order += pair if rep % 2 else pair[::-1]
        for name, old in order:
            code, avl_hooks = CHANGES[args.change]
            with code() if old else contextlib.nullcontext():
                res = steps_of(pre, name, old and avl_hooks, args.steps)
            if rep:
                got[(name, old)].append(res)
            print(
                f"  round {rep}: {name}{' (before)' if old else ''} {1e3 * res['step_s']:.1f} ms/step",
                flush=True,
            )
    bw_after = read_bandwidth(args.buffer_mib)
    bandwidth, w = max(bw_before, bw_after), weight_bytes(engine)
    rows = []
    med = statistics.median
    for name, old in configs:
        rs = got[(name, old)]
        row = {
            "config": name,
            "code": "before" if old else "after",
            "step_ms": 1e3 * med(r["step_s"] for r in rs),
            "step_ms_rounds": [1e3 * r["step_s"] for r in rs],
            "after_decode_ms": 1e3 * med(r["hook_s"] for r in rs),
            "apply_edits_ms": 1e3 * med(r["edits_s"] for r in rs),
            "attention_ms": 1e3 * med(r["attn_s"] for r in rs),
            "ops_per_step": rs[-1]["ops"],
            "kv_bytes": med(r["kv_bytes"] for r in rs),
            "runs_per_row": rs[-1]["runs_per_row"],
            "prefill_edit_ms": 1e3 * med(r["prefill_edit_s"] for r in rs),
        }
        # the step against its bandwidth bound: (weights + K/V attended) / bandwidth
        row["bound_ms"] = 1e3 * (w + row["kv_bytes"]) / bandwidth
        row["of_bound"] = row["bound_ms"] / row["step_ms"]
        if not old and (name, True) in got:
            pairs = [b["step_s"] / a["step_s"] for a, b in zip(rs, got[(name, True)], strict=True)]
            row["before_over_after"] = med(pairs)
            row["before_over_after_range"] = [min(pairs), max(pairs)]
            row["same_tokens"] = rs[0]["tokens"] == got[(name, True)][0]["tokens"]
            reads = [b["attn_s"] / a["attn_s"] for a, b in zip(rs, got[(name, True)]) if a["attn_s"] > 0]
            row["attention_before_over_after"] = med(reads) if reads else None
        rows.append(row)
    return {
        "machine": f"{cpu_name()} ({machine_name('cpu')})",
        "threads": torch.get_num_threads(),
        "model": args.model,
        "change": args.change,
        "batch": args.batch,
        "prompt_tokens": int(pre.one.input_ids.shape[1]),
        "steps": args.steps,
        "repeats": args.repeats,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_before_after_gb_s": [bw_before / 1e9, bw_after / 1e9],
        "weight_bytes": w,
        "rows": rows,
    }


def to_markdown(res: dict) -> str:
    lines = [
        f"change `{res['change']}`; {res['model']}, {res['prompt_tokens']} tokens × batch {res['batch']}, fp32, "
        f"{res['threads']} thread(s), "
        f"{res['machine']}; {res['repeats']} rounds × {res['steps']} steps; read bandwidth "
        f"{res['bandwidth_gb_s']:.1f} GB/s (the better of before / after the rounds)",
        "",
        "| config | code | step ms | bound ms | of bound | after_decode ms | apply_edits ms | attention ms "
        "| aten ops | runs per row | prefill edits ms | before / after (range) | attention before / after "
        "| same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        ratio = ""
        if "before_over_after" in r:
            lo, hi = r["before_over_after_range"]
            ratio = f"{r['before_over_after']:.3f} ({lo:.3f}–{hi:.3f})"
        lines.append(
            f"| {r['config']} | {r['code']} | {r['step_ms']:.1f} | {r['bound_ms']:.1f} | {r['of_bound']:.0%} | "
            f"{r['after_decode_ms']:.2f} | {r['apply_edits_ms']:.2f} | {r['attention_ms']:.1f} | "
            f"{r['ops_per_step']:,} | {r['runs_per_row']:.1f} | {r['prefill_edit_ms']:.0f} | {ratio} | "
            f"{'' if r.get('attention_before_over_after') is None else format(r['attention_before_over_after'], '.3f')} | "
            f"{r.get('same_tokens', '')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny-llava, 64 tokens × 2, a few steps (tests)")
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--change", choices=sorted(CHANGES), default="steps", help="what before / after compares")
    ap.add_argument("--policies", nargs="+", default=["h2o", "avl"])
    ap.add_argument("--controls", nargs="*", default=[], help="policies without per-step work (snapkv)")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.1])
    ap.add_argument("--buffer-mib", type=int, default=2048, help="bandwidth buffer (far above the L3)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    if args.md:
        Path(args.md).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
