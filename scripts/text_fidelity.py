"""Greedy agreement with the full cache on a text-only prompt (two corpus paragraphs + an instruction).

    python scripts/text_fidelity.py --model smollm2-llava --out docs/benchmarks/text-fidelity-smollm2-llava-cpu.md

With an untrained projector (smollm2-llava) image tokens are noise, so this isolates what each policy
does to a real language model's own text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlkv.eval.corpus import paragraphs
from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

CONFIGS = [
    ("local", {}),
    ("h2o", {}),
    ("snapkv", {}),
    ("pyramidkv", {}),
    ("elastic", {}),
    ("elastic", {"positions": "original"}),
    ("vlcache", {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.2])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine(load_model(args.model))
    text = f"{paragraphs()[0]}\n{paragraphs()[1]}\nSummarise the text above in one sentence."
    prompt = [Prompt(text)]
    full = engine.generate(prompt, make_policy("full"), args.new, stop_at_eos=False).samples[0]
    lines = [
        f"# Text-only greedy fidelity on `{args.model}` (CPU, 2 cores, no GPU)",
        "",
        f"Prompt: two corpus paragraphs + an instruction, {full.prompt_tokens} tokens; {args.new} greedy tokens.",
        "`agree` = tokens equal to the full cache's at the same step; `first diff` = first differing step.",
        "",
        f"Full cache: {full.text!r}",
        "",
        "| policy | settings | budget | agree | first diff | text |",
        "|---|---|---|---|---|---|",
    ]
    for name, kw in CONFIGS:
        for budget in args.budgets:
            s = engine.generate(
                prompt, make_policy(name, budget=budget, **kw), args.new, stop_at_eos=False
            ).samples[0]
            same = [a == b for a, b in zip(s.token_ids, full.token_ids)]
            first = same.index(False) if False in same else len(same)
            settings = ", ".join(f"{k}={v}" for k, v in kw.items()) or "defaults"
            snippet = s.text[:70].replace("|", "\\|").replace("\n", " ")
            lines.append(
                f"| {name} | {settings} | {budget} | {sum(same)}/{len(same)} | {first} | {snippet} |"
            )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        Path(args.out).write_text(md)


if __name__ == "__main__":
    main()
