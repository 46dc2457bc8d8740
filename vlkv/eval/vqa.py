"""Synthetic VQA over procedural scenes of held-out colour–shape pairs, scored by exact answer.

    python -m vlkv.eval.vqa --model smollm2-llava --policies full snapkv --budgets 0.5 0.25 --out vqa.json

Groups (every object is a :data:`vlkv.eval.scenes.HELD_OUT` pair, never drawn in training):

- ``single``: one object, "What is in the image?" → ``"red star"`` (colour and shape both right);
- ``two``: two objects, one of "What is in the image?", "What is on the left?", "What is left of
  the …?", "What colour is the star?";
- ``multi-N`` for N pictures (1, 2, 5, 10 by default): "What colour is the shape in the seventh
  picture?", "What is in the third picture?", "Which picture has two stars?".

The phrasings are the training mix's (:mod:`vlkv.eval.scene_tasks`). Answers are greedy, lower-cased,
punctuation dropped, cut at the end of turn, and compared whole with the expected answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlkv.eval.scene_tasks import LABELS, QUESTION_ORDERS, WHAT, Sample, nth, prompt_text, two, which
from vlkv.eval.scenes import random_scene

MULTI_COUNTS = (1, 2, 5, 10)
GROUPS = ("single", "two", "multi")  # multi-N groups go by "multi"


@dataclass(frozen=True)
class VQAItem:
    """One question: its group (``single``, ``two``, ``multi-N``) and the sample it asks about."""

    group: str
    sample: Sample

    @property
    def images(self) -> list:
        return [scene.image() for scene in self.sample.scenes]


def build_set(
    n_single: int = 20,
    n_two: int = 20,
    n_multi: int = 6,
    counts: tuple[int, ...] = MULTI_COUNTS,
    seed: int = 0,
) -> list[VQAItem]:
    """The held-out question set; the same arguments always give the same items."""
    for name, value in (("n_single", n_single), ("n_two", n_two), ("n_multi", n_multi)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if any(not 1 <= c <= 10 for c in counts):
        raise ValueError(f"counts must lie in 1..10 (ordinals up to tenth), got {list(counts)}")
    rng = np.random.default_rng([seed, 29])
    items = []
    for _ in range(n_single):
        scene = random_scene(rng, "heldout", 1)
        items.append(VQAItem("single", Sample((scene,), WHAT, scene.objects[0].name, "single")))
    items += [VQAItem("two", two(rng, "heldout")) for _ in range(n_two)]
    for count in counts:
        for i in range(n_multi):
            # alternate "which picture" and "the k-th picture" questions
            make = which if i % 2 else nth
            items.append(VQAItem(f"multi-{count}", make(rng, "heldout", count)))
    return items


def normalise(text: str, end_of_turn: str = "<|im_end|>") -> str:
    """Lower-case, cut at the end of turn, punctuation to spaces, whitespace collapsed."""
    text = text.split(end_of_turn)[0].lower()
    for mark in ".,!?;:\"'":
        text = text.replace(mark, " ")
    return " ".join(text.split())


def is_correct(answer: str, expected: str) -> bool:
    return normalise(answer) == normalise(expected)


def evaluate(
    engine,
    items: list[VQAItem],
    policy_name: str,
    budget: float | None,
    batch: int = 4,
    labels: str = "none",
    order: str = "after",
) -> dict:
    """Answer every item under one policy; returns per-group accuracy/n and per-item rows.

    Items are batched by group (same number of pictures), ``batch`` prompts per engine call.
    ``labels``: picture labels of several-picture prompts (:data:`vlkv.eval.scene_tasks.LABELS`).
    ``order``: where the question stands (:data:`vlkv.eval.scene_tasks.QUESTION_ORDERS`).
    """
    from vlkv.runtime.policies import make_policy

    rows = []
    start = time.perf_counter()
    for group in dict.fromkeys(item.group for item in items):
        members = [item for item in items if item.group == group]
        for i in range(0, len(members), batch):
            chunk = members[i : i + batch]
            prompts = [_prompt(engine.loaded, item, labels, order) for item in chunk]
            policy = make_policy(policy_name) if budget is None else make_policy(policy_name, budget=budget)
            result = engine.generate(prompts, policy, max_new_tokens=10)
            for item, sample in zip(chunk, result.samples, strict=True):
                rows.append(
                    {
                        "group": group,
                        "kind": item.sample.kind,
                        "question": item.sample.question,
                        "expected": item.sample.answer,
                        "answer": normalise(sample.text),
                        "correct": is_correct(sample.text, item.sample.answer),
                    }
                )
    groups = {}
    for group in dict.fromkeys(r["group"] for r in rows):
        hits = [r["correct"] for r in rows if r["group"] == group]
        groups[group] = {"accuracy": sum(hits) / len(hits), "n": len(hits)}
    return {
        "policy": policy_name,
        "budget": budget,
        "labels": labels,
        "question_order": order,
        "groups": groups,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }


def _prompt(loaded, item: VQAItem, labels: str, order: str = "after"):
    from vlkv.runtime.prompt import Prompt

    if labels == "none" and order == "after":  # the engine formats it: exactly what every other caller gets
        return Prompt(item.sample.question, item.images)
    text = prompt_text(loaded, item.sample.question, len(item.sample.scenes), labels, order)
    return Prompt(text, item.images, raw=True)


def format_table(results: list[dict]) -> str:
    """A markdown table: one row per (policy, budget), one column per group (accuracy, n in the header)."""
    groups = list(dict.fromkeys(g for r in results for g in r["groups"]))
    ns = {g: next(r["groups"][g]["n"] for r in results if g in r["groups"]) for g in groups}
    head = "| policy | budget | " + " | ".join(f"{g} (n={ns[g]})" for g in groups) + " |"
    lines = [head, "|" + "---|" * (len(groups) + 2)]
    for r in results:
        cells = [f"{r['groups'][g]['accuracy']:.2f}" if g in r["groups"] else "" for g in groups]
        budget = "full" if r["budget"] is None else f"{r['budget']:g}"
        lines.append(f"| {r['policy']} | {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _swap_projector(loaded, path: Path) -> None:
    """Put the projector stored at ``path`` into ``loaded``'s model (for checkpoints during training)."""
    import torch

    from vlkv.eval import vision_tune
    from vlkv.runtime.models import lm_lora
    from vlkv.runtime.models.projector_order import ORDER_KEY
    from vlkv.runtime.models.projector_pool import POOL_KEY, match_processor
    from vlkv.runtime.models.projector_position import POSITION_KEY
    from vlkv.runtime.models.smollm2_llava import PROJECTOR_KEYS, apply_projector

    if not path.is_file():
        raise ValueError(f"projector file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        ckpt = torch.load(path, weights_only=False, map_location="cpu")
        state = dict(ckpt["projector"])
        if "lm_lora" in ckpt:  # a training checkpoint's adapters, in the shipped (scale-folded) form
            cfg = ckpt["config"]
            state |= lm_lora.fold(ckpt["lm_lora"], cfg["lm_lora_alpha"] / cfg["lm_lora_rank"])
        state |= ckpt.get("vision", {})
    state, vision = vision_tune.split(state)  # trained vision blocks, if the run had them
    if set(lm_lora.split(state)[0]) - {POSITION_KEY, ORDER_KEY, POOL_KEY} != PROJECTOR_KEYS:
        raise ValueError(f"{path} holds {sorted(state)}, not a projector's {sorted(PROJECTOR_KEYS)}")
    apply_projector(loaded.model, state)
    vision_tune.load(loaded.model, vision)
    match_processor(loaded.processor, loaded.model)  # a pooled projector: fewer tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlkv.eval.vqa", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--policies", nargs="+", default=["full"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5], help="ignored for the full cache")
    ap.add_argument("--n-single", type=int, default=20)
    ap.add_argument("--n-two", type=int, default=20)
    ap.add_argument("--n-multi", type=int, default=6, help="questions per picture count")
    ap.add_argument(
        "--groups",
        nargs="+",
        default=list(GROUPS),
        help="ask only these groups (single, two, multi) of the set the --n-* arguments draw: the "
        "same items as a run of every group, which fewer --n-* would not give (one draw feeds all)",
    )
    ap.add_argument("--counts", nargs="+", type=int, default=list(MULTI_COUNTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--labels",
        default="none",
        help=f"picture labels in several-picture prompts, one of {', '.join(LABELS)} "
        "('ordinal': 'The seventh picture:' before the seventh image)",
    )
    ap.add_argument(
        "--question-order",
        default="after",
        help=f"where the question stands, one of {', '.join(QUESTION_ORDERS)} ('after' the images: the "
        "product's prompt; 'before' them; 'both'); match the projector's training",
    )
    ap.add_argument("--out", type=Path, default=None, help="write every result (rows included) as JSON")
    ap.add_argument(
        "--projector",
        type=Path,
        default=None,
        help="a projector to evaluate instead of the model's own: a safetensors file or a "
        "train_projector checkpoint.pt (smollm2-llava models only; not checksum-verified)",
    )
    args = ap.parse_args(argv)
    try:
        import torch

        from vlkv.runtime.engine import Engine
        from vlkv.runtime.models.registry import load_model

        if args.threads:
            torch.set_num_threads(args.threads)
        from vlkv.runtime.policies import make_policy

        if args.labels not in LABELS:
            raise ValueError(f"--labels must be one of {', '.join(LABELS)}, got {args.labels!r}")
        if args.question_order not in QUESTION_ORDERS:
            raise ValueError(
                f"--question-order must be one of {', '.join(QUESTION_ORDERS)}, got {args.question_order!r}"
            )
        bad = sorted(set(args.groups) - set(GROUPS))
        if bad:
            raise ValueError(f"--groups must be among {', '.join(GROUPS)}, got {', '.join(bad)}")
        items = build_set(args.n_single, args.n_two, args.n_multi, tuple(args.counts), args.seed)
        items = [item for item in items if item.group.split("-")[0] in args.groups]
        for name in args.policies:  # a bad policy or budget fails here, not after minutes of others
            for budget in [None] if name == "full" else args.budgets:
                make_policy(name) if budget is None else make_policy(name, budget=budget)
        # another projector file replaces the shipped one whole, LM adapters included: start from the
        # untouched LM, not from one the shipped file's adapters were merged into
        base = (
            "smollm2-llava-random" if args.projector is not None and args.model == "smollm2-llava" else None
        )
        loaded = load_model(base or args.model)
        if args.projector is not None:
            _swap_projector(loaded, args.projector)
        engine = Engine(loaded)
        results = []
        for name in args.policies:
            for budget in [None] if name == "full" else args.budgets:
                results.append(
                    evaluate(engine, items, name, budget, args.batch, args.labels, args.question_order)
                )
                print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    except ValueError as exc:
        print(f"vqa: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, "results": results}
        if args.projector is not None:  # which file made these answers (its name, not a machine path)
            digest = hashlib.sha256(args.projector.read_bytes()).hexdigest()
            record["projector"] = {"file": args.projector.name, "sha256": digest}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
