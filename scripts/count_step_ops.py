"""Torch ops and host syncs of one scheduler decode step (tiny LLaVA, a batch of running requests).

Usage: python scripts/count_step_ops.py [--batch 4] [--layers 2 4 8] [--split-append]
Prints, per policy and layer count, the ops and syncs one decode step dispatches (see
:mod:`vlkv.runtime.op_count`), the scheduler's own share, and the syncs by module, so a change's
effect on launch overhead is a number. The counts are the same on any device (CPU here).
``--split-append``: each row again with the decode layers' cache append in Python and the paged read a
separate call (``VLKV_CPU_APPEND=0``, the path before the fused append-and-read), ``"append": "split"``.
"""

from __future__ import annotations

import argparse
import json

import torch

import vlkv.plugins.paged_append as paged_append
from vlkv.runtime.engine import Engine
from vlkv.runtime.models.registry import LoadedModel
from vlkv.runtime.models.tiny import TinySpec, build_tiny_llava
from vlkv.runtime.op_count import SCHEDULER_MODULES, count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

# avl with a small text floor: its decode steps evict text on tiny prompts too
POLICIES = {"full": {}, "h2o": {"budget": 0.5}, "avl": {"budget": 0.5, "text_min": 2}}
OWN = SCHEDULER_MODULES


def tiny_engine(num_layers: int) -> Engine:
    model, processor = build_tiny_llava(TinySpec(num_layers=num_layers))
    return Engine(LoadedModel(model.eval(), processor, "tiny-llava", "llava"))


def count_decode_step(engine: Engine, policy: str, batch: int = 4, warm: int = 2):
    """The :class:`OpCount` of one decode step over ``batch`` running requests under ``policy``."""
    texts = ["Describe the scene in detail.", "Hi", "What colour is the sky today?", "Count them."]
    sched = Scheduler(engine)
    for i in range(batch):
        prompt = Prompt(texts[i % len(texts)] + " x" * i)
        sched.submit(Request(prompt, make_policy(policy, **POLICIES[policy]), 16, stop_at_eos=False))
    for _ in range(warm):  # admit (prefill) everyone, then a plain decode step or two
        sched.step()
    assert len(sched.running) == batch and not sched.waiting
    with count_ops() as c:
        sched.step()
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--split-append", action="store_true", help="also count with VLKV_CPU_APPEND=0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.layers:
        engine = tiny_engine(n)
        for policy in POLICIES:
            for split in (False, True) if args.split_append else (False,):
                on = paged_append.FUSED_APPEND
                paged_append.FUSED_APPEND = on and not split
                try:
                    c = count_decode_step(engine, policy, args.batch)
                finally:
                    paged_append.FUSED_APPEND = on
                row = {"layers": n, "policy": policy, "ops": c.ops, "syncs": c.syncs, "kinds": dict(c.kinds)}
                row["append"] = "fused" if on and not split and paged_append.kernel() is not None else "split"
                row["scheduler_syncs"] = c.syncs_in(*OWN)
                row["modules"] = dict(c.modules)
                rows.append(row)
                print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
