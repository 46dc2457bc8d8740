"""Sweep policies × budgets: decode-step time and KV bytes relative to the full cache, in one run.

    python scripts/bench_policies.py --model smollm2-llava --out docs/benchmarks/policies-cpu.md

Each configuration generates ``--new`` tokens for the same prompts; the full cache runs in the same
process, interleaved, so the reported numbers are ratios measured side by side, not lone times.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]
from tqdm import tqdm

from vlkv.eval.harness import context_prompt
from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy

POLICIES = ("local", "h2o", "snapkv", "elastic")
BUDGETS = (1.0, 0.5, 0.2, 0.1)


def _images(model: str, n: int) -> list:
    if model == "smollm2-llava":
        from vlkv.runtime.models.photos import real_photos

        return real_photos()[:n]
    return [f"builtin:{name}" for name in ("checkerboard", "gradient", "noise")][:n]


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, no GPU)"


def run(args) -> list[dict]:
    engine = Engine(load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device))
    images = _images(args.model, args.images)
    prompts = [context_prompt(im, args.words) for im in images]
    configs = [(p, b) for p in args.policies for b in args.budgets]
    engine.generate(prompts, make_policy("full"), 2)  # warm-up: first calls allocate and spin up threads
    records: dict = {("full", 1.0): []}
    pairs: dict = {c: [] for c in configs}
    # each configuration is timed right after its own full-cache run, alternating, so slow drifts in
    # machine load cancel in the per-pair ratio
    for name, budget in tqdm(configs, desc="configs"):
        for _ in range(args.repeats):
            full = engine.generate(prompts, make_policy("full"), args.new, stop_at_eos=False)
            res = engine.generate(prompts, make_policy(name, budget=budget), args.new, stop_at_eos=False)
            records[("full", 1.0)].append((full, 0.0))
            records.setdefault((name, budget), []).append((res, 0.0))
            pairs[(name, budget)].append(
                (res.decode_s / res.decode_steps) / (full.decode_s / full.decode_steps)
            )
    full_res = records[("full", 1.0)][0][0]
    rows = []
    for (name, budget), runs in records.items():
        res = runs[0][0]
        step = statistics.median(r.decode_s / r.decode_steps for r, _ in runs)
        agree = sum(
            sum(a == b for a, b in zip(s.token_ids, f.token_ids))
            for s, f in zip(res.samples, full_res.samples)
        ) / sum(len(f.token_ids) for f in full_res.samples)
        rows.append(
            {
                "policy": name,
                "budget": budget,
                "decode_step_ms": 1e3 * step,
                "decode_ratio_vs_full": statistics.median(pairs[(name, budget)]) if name != "full" else 1.0,
                "kv_used_ratio": res.kv_bytes_used / res.full_kv_bytes,
                "kv_bytes": res.kv_bytes,
                "peak_kv_bytes": res.peak_kv_bytes,
                "full_kv_bytes": full_res.full_kv_bytes,
                "prompt_tokens": [s.prompt_tokens for s in res.samples],
                "token_agreement_vs_full": agree,
            }
        )
    return rows


def to_markdown(rows: list[dict], args, machine: str) -> str:
    lines = [
        f"# Policy sweep on `{args.model}` ({machine})",
        "",
        f"Batch of {args.images} image prompt(s), {args.new} new tokens. Each configuration ran {args.repeats}x, each",
        "time right after a full-cache run of the same prompts; the ratio is the median of those pairs. `kv used` = bytes of valid K/V entries",
        "at the end of generation over what the full cache holds then. `agreement` = share of generated",
        "tokens equal to the full cache's at the same step (greedy).",
        "",
        "| policy | budget | decode step (ms) | decode time vs full | kv used vs full | peak KV MiB | agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['budget']} | {r['decode_step_ms']:.1f} | {r['decode_ratio_vs_full']:.2f}× "
            f"| {r['kv_used_ratio']:.1%} | {r['peak_kv_bytes'] / 2**20:.2f} | {r['token_agreement_vs_full']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--budgets", nargs="+", type=float, default=[b for b in BUDGETS])
    ap.add_argument("--images", type=int, default=2, help="prompts in the batch (one image each)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--words", type=int, default=128, help="words of corpus text before each image")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="markdown report path (JSON written beside it)")
    add_device_args(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    machine = _machine(args.device)
    rows = run(args)
    md = to_markdown(rows, args, machine)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
