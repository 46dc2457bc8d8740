"""Item-for-item comparison of held-out VQA answers against the shipped file's (C@300's) on draws 0-3.

Run from the folder that holds the run's answers (this one, or another run's that calls this script):

    python compare.py st N150     # vqa-st-N150-seed{0..3}.json against ../2026-11-27-stage2-cpu-x86_64/vqa-st-C300-*
    python compare.py multi N150
    python compare.py st N150 N0150   # against vqa-st-N0150-* (the run's folder, else this one) instead

Prints per group: right answers per draw and in all, the items right in one and wrong in the other, the
two-sided sign test's p, (two objects) right answers by question kind, (several pictures) by count.
"""

from __future__ import annotations

import collections
import json
import sys
from math import comb
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "2026-11-27-stage2-cpu-x86_64"


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["results"][0]["rows"]


def sign_p(a: int, b: int) -> float:
    n, k = a + b, min(a, b)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def base_file(kind: str, base: str, seed: int, run: Path) -> Path:
    """The base's answers: the shipped file's in the stage-2 folder, else the run's folder's, else this one's."""
    name = f"vqa-{kind}-{base}-seed{seed}.json"
    if base == "C300":
        return SHIPPED / name
    return run / name if (run / name).exists() else HERE / name


def main(kind: str, name: str, base: str = "C300") -> None:
    run = Path.cwd()
    per = collections.defaultdict(lambda: {"draws": [], "gain": 0, "loss": 0, "kinds": collections.Counter()})
    ship_kinds = collections.Counter()
    for seed in range(4):
        ours = rows(run / f"vqa-{kind}-{name}-seed{seed}.json")
        ship = rows(base_file(kind, base, seed, run))
        draw = collections.Counter()
        for a, b in zip(ours, ship, strict=True):
            assert (a["question"], a["expected"]) == (b["question"], b["expected"]), (seed, a, b)
            group = "multi" if a["group"].startswith("multi") else a["group"]
            g = per[group]
            draw[group] += a["correct"]
            g["gain"] += a["correct"] and not b["correct"]
            g["loss"] += b["correct"] and not a["correct"]
            if group in ("two", "multi"):
                key = a["kind"] if group == "two" else a["group"]
                g["kinds"][key] += a["correct"]
                ship_kinds[key] += b["correct"]
        for group in draw:
            per[group]["draws"].append(draw[group])
    for group, g in per.items():
        line = f"{group}: {name} {g['draws']} = {sum(g['draws'])}; right where {base} wrong {g['gain']}, "
        line += f"reverse {g['loss']}, sign test p = {sign_p(g['gain'], g['loss']):.2f}"
        if group in ("two", "multi"):
            line += f"; by kind {dict(g['kinds'])} ({base} {dict(ship_kinds)})"
        print(line)


if __name__ == "__main__":
    main(*sys.argv[1:4])
