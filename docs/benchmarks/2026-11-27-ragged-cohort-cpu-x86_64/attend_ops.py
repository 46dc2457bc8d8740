"""A-VL with a core on image prompts of different lengths (tiny LLaVA, 4 requests, 9 decode steps, 6 of
them restricting attention to the core): the ops and host syncs of ``Scheduler._entries`` (each
request's statistics request and attend lists) with the cohort's one pass over the stacked rows
(``policies.cohort.cohort_attends``) and with every request asked alone, in one process.

Usage: PYTHONPATH=<checkout> python attend_ops.py
"""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

import vlkv.runtime.scheduler as sch
from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request

TEXTS = [
    "Describe the picture in detail, every part of it please.",
    "Hi",
    "What is in it?",
    "Tell me what the picture shows and why.",
]


def main() -> None:
    torch.set_num_threads(1)
    engine = Engine(load_model("tiny-llava"))
    rng = [np.random.default_rng(i) for i in range(3)]
    images = [Image.fromarray(g.integers(0, 255, (112, 112, 3), dtype=np.uint8)) for g in rng]
    real = sch.cohort_attends
    for mode in ("cohort", "alone"):
        sch.cohort_attends = real if mode == "cohort" else (lambda entries: {})
        sched = sch.Scheduler(engine)
        for i, text in enumerate(TEXTS):
            policy = make_policy("avl", budget=0.5, core=0.3, text_min=2)
            sched.submit(Request(Prompt(text, [images[i % 3]]), policy, 16, stop_at_eos=False))
        sched.step()
        sched.step()
        total = {"ops": 0, "syncs": 0}
        inner = sched._entries

        def counted(inner=inner, total=total):
            with count_ops() as c:
                out = inner()
            total["ops"] += c.ops
            total["syncs"] += c.syncs
            return out

        sched._entries = counted
        steps = 9
        for _ in range(steps):
            sched.step()
        assert len(sched.running) == len(TEXTS)
        row = {"mode": mode, "steps": steps, "ops": total["ops"] / steps, "syncs": total["syncs"] / steps}
        print(json.dumps(row), flush=True)
    sch.cohort_attends = real


if __name__ == "__main__":
    main()
