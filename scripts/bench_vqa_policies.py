"""Every compression policy on image questions: exact-answer accuracy and KL against the full cache.

Issue #29 ("every image claim re-measured"): the papers claim modality-aware policies (VL-Cache, A-VL)
beat text-only ones on image questions. This runs the held-out VQA set of :mod:`vlkv.eval.vqa`
(one-object questions, two-object scenes and, with ``--n-multi``, questions over several pictures) under
each policy spec at each budget and reports, per group:

- accuracy: the policy's own greedy answer, exact match after normalisation;
- KL(full ‖ policy) and top-1 agreement of the next-token distributions along the full cache's greedy
  answer (teacher-forced, the policy editing its cache as it decodes), mean over answer tokens.

Specs take settings as ``name:key=value,...`` (``attnpack:evict=snapkv``); ``full`` is the reference
and is run once. The full cache's answers and logits are computed once per group and shared.

    python scripts/bench_vqa_policies.py --n-single 16 --n-two 8 --budgets 0.5 0.25 0.1 \
        --out docs/benchmarks/<dir>/vqa-policies
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

DEFAULT_SPECS = (
    "avl",
    "vlcache",
    "h2o",
    "snapkv",
    "pyramidkv",
    "local",
    "elastic",
    "kvzip",
    "kvgrad",
    "knorm",
    "attnpack:evict=snapkv",
)


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()}, no GPU)"
    except OSError:
        pass
    return platform.machine()


def _policy(spec: str, budget: float | None):
    from vlkv.eval.realtext import parse_spec
    from vlkv.runtime.policies import make_policy

    name, kwargs = parse_spec(spec)
    if budget is not None:
        kwargs["budget"] = budget
    return make_policy(name, **kwargs)


def reference(engine, prompts, new_tokens: int):
    """The full cache's greedy answers (``new_tokens`` each, no stop) and logits along them."""
    from vlkv.eval.teacher_forcing import full_reference

    return full_reference(engine, prompts, new_tokens)


def run_group(engine, items, specs, budgets, new_tokens: int, batch: int, on_row=None) -> list[dict]:
    """Rows ``{spec, budget, accuracy, kl, top1, n}`` for one group of items (same picture count);
    ``on_row(rows)`` after each one (a stopped run keeps what it measured)."""
    from vlkv.eval.metrics import kl_divergence, top1_agreement
    from vlkv.eval.teacher_forcing import forced_logits
    from vlkv.eval.vqa import is_correct
    from vlkv.runtime.prompt import Prompt

    prompts = [Prompt(it.sample.question, it.images) for it in items]
    chunks = [list(range(i, min(i + batch, len(items)))) for i in range(0, len(items), batch)]
    refs = [reference(engine, [prompts[i] for i in c], new_tokens) for c in chunks]
    full_logits = torch.cat([lg for r in refs for lg in r.logits])
    rows = []
    for spec in specs:
        for budget in [None] if spec == "full" else budgets:
            policy = _policy(spec, budget)
            t0 = time.perf_counter()
            hits, logits = [], []
            for c, ref in zip(chunks, refs):
                got = engine.generate([prompts[i] for i in c], policy, max_new_tokens=10)
                hits += [is_correct(s.text, items[i].sample.answer) for s, i in zip(got.samples, c)]
                logits += forced_logits(engine, [prompts[i] for i in c], policy, ref.tokens)
            pol = torch.cat(logits)
            rows.append(
                {
                    "spec": spec,
                    "budget": budget,
                    "accuracy": sum(hits) / len(hits),
                    "kl": float(kl_divergence(full_logits, pol).mean()),
                    "top1": top1_agreement(full_logits, pol),
                    "n": len(hits),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(
                f"  {spec}@{budget}: acc {rows[-1]['accuracy']:.2f} KL {rows[-1]['kl']:.4f} "
                f"top1 {rows[-1]['top1']:.3f} ({rows[-1]['seconds']} s)",
                flush=True,
            )
            if on_row is not None:
                on_row(rows)
    return rows


def to_markdown(res: dict) -> str:
    lines = [
        f"VQA under each policy ({res['model']}, {res['machine']}, {res['threads']} torch threads); "
        f"held-out scenes, seed {res['seed']}; KL(full ‖ policy) and top-1 agreement along the full "
        f"cache's {res['new_tokens']}-token greedy answer.",
        "",
    ]
    for group, rows in res["groups"].items():
        n = rows[0]["n"] if rows else 0
        lines += [f"## {group} (n = {n})", ""]
        budgets = [b for b in res["budgets"]]
        lines.append("| policy | " + " | ".join(f"{b:g}: acc / KL" for b in budgets) + " |")
        lines.append("|---|" + "---:|" * len(budgets))
        full = next((r for r in rows if r["spec"] == "full"), None)
        if full is not None:
            lines.append(f"| full | {full['accuracy']:.2f} (every budget) |" + " |" * (len(budgets) - 1))
        for spec in res["specs"]:
            if spec == "full":
                continue
            cells = []
            for b in budgets:
                r = next((r for r in rows if r["spec"] == spec and r["budget"] == b), None)
                cells.append("—" if r is None else f"{r['accuracy']:.2f} / {r['kl']:.3f}")
            lines.append(f"| {spec} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    ap.add_argument("--n-single", type=int, default=16)
    ap.add_argument("--n-two", type=int, default=8)
    ap.add_argument("--n-multi", type=int, default=0, help="questions per picture count (--counts)")
    ap.add_argument("--counts", nargs="+", type=int, default=[2, 5])
    ap.add_argument("--new-tokens", type=int, default=6, help="answer tokens the KL is taken along")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if any(not 0.0 < b <= 1.0 for b in args.budgets):
        ap.error(f"--budgets must lie in (0, 1], got {args.budgets}")
    if min(args.n_single, args.n_two, args.n_multi) < 0 or args.new_tokens < 1 or args.batch < 1:
        ap.error("--n-* must be >= 0, --new-tokens and --batch >= 1")
    for spec in args.specs:  # a bad spec fails before any model work
        try:
            _policy(spec, None if spec == "full" else args.budgets[0])
        except (ValueError, TypeError) as err:
            ap.error(f"--specs {spec!r}: {err}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from vlkv.eval.vqa import build_set
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    engine = Engine(load_model(args.model))
    items = build_set(args.n_single, args.n_two, args.n_multi, tuple(args.counts), args.seed)
    specs = ["full", *[s for s in args.specs if s != "full"]]
    res = {
        "model": args.model,
        "machine": _machine(),
        "threads": args.threads,
        "seed": args.seed,
        "budgets": args.budgets,
        "specs": specs,
        "new_tokens": args.new_tokens,
        "groups": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(group: str, rows: list[dict]) -> None:
        res["groups"][group] = rows
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        args.out.with_suffix(".md").write_text(to_markdown(res) + "\n")

    for group in dict.fromkeys(it.group for it in items):
        members = [it for it in items if it.group == group]
        print(f"{group}: {len(members)} questions", flush=True)
        rows = run_group(
            engine, members, specs, args.budgets, args.new_tokens, args.batch, lambda r, g=group: write(g, r)
        )
        write(group, rows)
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
