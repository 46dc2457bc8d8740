"""The language model's own ceiling on the VQA questions: each scene given as text instead of an image.

    python -m vlkv.eval.text_ceiling --draws 0 1 2 3 --n-two 24 --out text-ceiling.json

A projector can at best hand the LM what a sentence about the scene says. So the same held-out
questions of :mod:`vlkv.eval.vqa` are asked about a *description* of each scene, with in-format
examples before it (few-shot, no chat template: the fairest test of the LM's reasoning, free of answer
format), and scored by the same exact answer. Where the LM cannot answer "What is on the left?" from
"a red star on the left and a blue circle on the right", no trained projector makes it answer from the
image: the frozen LM, not the vision side, bounds that group.

Forms (:data:`FORMS`): ``caption`` names the objects left to right without positions (what the
captions of the training mix say), ``sides`` adds "on the left / on the right", ``sides-swapped``
names the right object first (the words alone say where each is). The examples use invented
colour–shape words (none of the scenes' pairs), so no answer can be copied from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from vlkv.eval.vqa import build_set, is_correct, normalise

__all__ = ["EXAMPLES", "FORMS", "evaluate", "main", "prompt_text", "score"]

FORMS: dict[str, Callable[[str, str], str]] = {
    "caption": lambda left, right: f"The image shows a {left} and a {right}.",
    "sides": lambda left, right: f"The image shows a {left} on the left and a {right} on the right.",
    "sides-swapped": lambda left, right: f"The image shows a {right} on the right and a {left} on the left.",
}
# (left, right, question, answer): one per question kind of the ``two`` group, invented pairs
EXAMPLES = (
    ("pink arc", "grey heart", "What is on the right?", "grey heart"),
    ("brown ring", "cyan moon", "What is left of the cyan moon?", "brown ring"),
    ("lime arrow", "teal bolt", "What colour is the bolt?", "teal"),
    ("navy drop", "gold leaf", "What is in the image?", "navy drop and gold leaf"),
    ("olive key", "plum bell", "What is on the left?", "olive key"),
)


def prompt_text(form: str, left: str, right: str, question: str) -> str:
    """The few-shot text for one question about a scene whose objects are ``left`` and ``right``
    (names such as ``"red star"``): the examples, one per line, then the scene and ``"Q: … A:"``."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}, got {form!r}")
    describe = FORMS[form]
    shots = "".join(f"{describe(a, b)} Q: {q} A: {ans}\n" for a, b, q, ans in EXAMPLES)
    return f"{shots}{describe(left, right)} Q: {question} A:"


def score(text: str, expected: str) -> tuple[str, bool]:
    """The answer (the generated text up to its first line break, normalised) and whether it is right:
    a few-shot prompt has no end of turn, so the model's next example line is not part of its answer."""
    first = text.split("\n")[0]
    return normalise(first), is_correct(first, expected)


def evaluate(
    engine, forms: list[str], draws: list[int], n_two: int, n_single: int = 24, batch: int = 8
) -> list[dict]:
    """Every ``two`` item of VQA draws ``draws`` (``n_two`` each) asked under every form; one row each.
    ``n_single``: the draw's one-object items, drawn first and skipped here, so that the two-object items
    are the very ones ``python -m vlkv.eval.vqa --seed DRAW --n-single 24 --n-two 24`` asks."""
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    rows = []
    for draw in draws:
        drawn = build_set(n_single=n_single, n_two=n_two, n_multi=0, counts=(), seed=draw)
        items = [item for item in drawn if item.group == "two"]
        for form in forms:
            texts = [
                prompt_text(form, *(o.name for o in item.sample.scenes[0].objects), item.sample.question)
                for item in items
            ]
            for i in range(0, len(items), batch):
                prompts = [Prompt(t, [], raw=True) for t in texts[i : i + batch]]
                result = engine.generate(prompts, make_policy("full"), max_new_tokens=6)
                for item, sample in zip(items[i : i + batch], result.samples, strict=True):
                    answer, correct = score(sample.text, item.sample.answer)
                    rows.append(
                        {
                            "draw": draw,
                            "form": form,
                            "kind": item.sample.kind,
                            "question": item.sample.question,
                            "expected": item.sample.answer,
                            "answer": answer,
                            "correct": correct,
                        }
                    )
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table: per form, right answers of all and of each question kind."""
    forms = list(dict.fromkeys(r["form"] for r in rows))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    lines = ["| form | all | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for form in forms:
        mine = [r for r in rows if r["form"] == form]
        hit, n = Counter(), Counter()
        for r in mine:
            n[r["kind"]] += 1
            hit[r["kind"]] += r["correct"]
        cells = [f"{hit[k]} / {n[k]}" for k in kinds]
        lines.append(f"| {form} | {sum(hit.values())} / {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    ap.add_argument("--draws", nargs="+", type=int, default=[0, 1, 2, 3], help="VQA draws (their seeds)")
    ap.add_argument("--n-two", type=int, default=24, help="two-object items per draw")
    ap.add_argument("--n-single", type=int, default=24, help="one-object items drawn before them (skipped)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="JSON file for every answer")
    args = ap.parse_args(argv)
    if args.n_two < 1 or args.n_single < 0:
        ap.error(f"--n-two must be >= 1 and --n-single >= 0, got {args.n_two} and {args.n_single}")

    import torch

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model))
    rows = evaluate(engine, args.forms, args.draws, args.n_two, args.n_single)
    table = summary(rows)
    print(table)
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "draws": args.draws, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
