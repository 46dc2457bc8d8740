"""Step 0: classify a model's two-object misses on the held-out VQA (draws given on the command line).

    python classify_misses.py ../2026-11-27-stage2-cpu-x86_64/vqa-st-C300-seed{0,1,2,3}.json

Per miss, word by word against the expected answer ("colour shape", captions "c1 s1 and c2 s2",
colour-by-shape "colour"): which word is wrong (first = colour, second = shape); whether the wrong
word is the *other* object's word in the same scene (binding) or absent from the scene; whether the
answered colour–shape pair is a training pair (pair prior: every held-out pair with one word changed
is a training pair unless it hits another held-out pair, so this is the usual case, not evidence alone).
The scenes are rebuilt from the VQA's seed (``vlkv.eval.vqa.build_set``), so no model is loaded.
"""

from __future__ import annotations

import collections
import json
import re
import sys

from vlkv.eval.scenes import HELD_OUT
from vlkv.eval.vqa import build_set


def classify(row: dict, scene) -> list[str]:
    exp, ans = row["expected"].split(), row["answer"].split()
    words = {w for o in scene.objects for w in (o.colour, o.shape)}
    tags = [row["kind"]]
    if len(ans) != len(exp):
        return tags + ["length"]
    wrong = [i for i, (e, a) in enumerate(zip(exp, ans)) if e != a]
    if row["kind"] == "two-colour":
        return tags + ["colour", "in-scene" if ans[0] in words else "absent"]
    # position of each wrong word inside its object ("c s" = 0 1, "c s and c s" = 0 1 - 0 1)
    pos = sorted({("first", "second", None)[i % 3] for i in wrong})
    tags.append("both" if pos == ["first", "second"] else pos[0])
    tags.append("in-scene" if all(ans[i] in words for i in wrong) else "absent")
    # the answered pairs of the objects with a wrong word
    pairs = [(ans[i], ans[i + 1]) for i in range(0, len(ans), 3) if {i, i + 1} & set(wrong)]
    tags.append("training-pair" if all(p not in HELD_OUT for p in pairs) else "held-out-pair")
    return tags


def main(paths: list[str]) -> None:
    counts = collections.Counter()
    misses = []
    for path in paths:
        seed = int(re.search(r"seed(\d+)", path).group(1))
        items = build_set(24, 24, 6, seed=seed)
        with open(path) as f:
            rows = json.load(f)["results"][0]["rows"]
        for row, item in zip(rows, items):
            assert row["expected"] == item.sample.answer, (path, row)
            if row["group"] != "two" or row["correct"]:
                continue
            tags = classify(row, item.sample.scenes[0])
            counts.update(tags[1:])
            counts[tuple(tags[1:3])] += 1
            misses.append(
                (seed, row["question"], row["expected"], row["answer"], item.sample.scenes[0].caption, tags)
            )
    for m in misses:
        print(*m, sep=" | ")
    print(
        json.dumps(
            {" ".join(k) if isinstance(k, tuple) else k: v for k, v in sorted(counts.items(), key=str)},
            indent=1,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
