"""Ops, Triton launches and host syncs of one decode step: eager, and static (the forward a CUDA graph captures).

Usage: python scripts/count_static_step.py [--batch 4] [--layers 2 4] [--steps 3]
       [--policy full h2o kvzip avl-core] [--eager-only]
Counts, on the path a CUDA device runs (``count_step_ops.gpu_path_env``: the Triton kernels forced under
the interpreter, every CPU C++ kernel off; the script runs itself again with that environment), a
``Scheduler.step()`` of tiny LLaVA over ``--batch`` ragged requests on a fixed pool, per ``--policy``
(``full``: a plain step; ``h2o``: budget 0.5, a statistics step; ``kvzip``: budget 0.5, per-head holes,
a plain hole step; ``avl-core``: A-VL at budget 0.5 with ``core=0.3`` over one image per request, its
counted steps core steps, selected attention with statistics; ``linked``: full cache, the first request
linking (MPIC) an image record an earlier request computed, its keys kept pre-RoPE and rotated on read —
the random tiny model has no link check, so linking is opted into as ``VLKV_LINK_UNCHECKED=1`` does;
``attnpack``: rank 4 over one image per request, pre-RoPE low-rank factors read through the factor
stacks (``runtime/static_factors.py``); the policy's per-step factor edit runs in the scheduler's commit,
eagerly, outside both halves: in the step's totals, not in ``host`` or ``device``):

- ``eager``: the step as it runs today (``TorchBackend.step``'s layer loop);
- ``static``: the same step through ``runtime/static_step.py``, with its two halves counted apart:
  ``host`` (the reservations, the packed copy, the input copies: what still runs from the host each step
  under a graph) and ``device`` (the forward: what a CUDA graph captures and replays as one launch);
  a statistics step also ``stats`` (``static_step.step_stats``: the statistics from the probabilities
  the forward left in its buffers, host-half work after the replay), and a step with low-rank factors
  ``edit`` (the policy's factor edit in the scheduler's commit, eager: ``kv/lowrank.factor_due``, each
  layer's factoring where due, and ``kv/factor_ranks.set_ranks_by_importance``, every layer's and
  request's ranks at once).

A Triton launch counts as one op (one kernel launch on the device). Prints one JSON line per
configuration and layer count, then per configuration the ops per layer (slope between the fewest and
the most layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from count_step_ops import gpu_path_env, tiny_engine, torch_path_prefill, triton_launches_as_ops  # noqa: E402

from vlkv.runtime import static_step  # noqa: E402
from vlkv.runtime.op_count import count_ops  # noqa: E402
from vlkv.runtime.policies import make_policy  # noqa: E402
from vlkv.runtime.prompt import Prompt  # noqa: E402
from vlkv.runtime.request import Request  # noqa: E402
from vlkv.runtime.scheduler import Scheduler  # noqa: E402

TEXTS = ["Describe the scene in detail.", "Hi", "What colour is the sky today?", "Count them."]


# the policies counted: a plain step, a statistics step (h2o evicts as it decodes), a hole step (kvzip's
# adaptive head budgets leave per-head holes after its prefill), and A-VL's core steps (selected attention;
# an update step only every 64: the counted steps are core steps)
POLICIES = {
    "full": {},
    "h2o": {"budget": 0.5},
    "kvzip": {"budget": 0.5},
    "avl-core": {"budget": 0.5, "core": 0.3, "interval": 64},
    "linked": {},
    "attnpack": {"rank": 4},  # low-rank factors (pre-RoPE, path (a)): the static step's factor stacks
}


def _running(engine, batch: int, policy: str = "full") -> Scheduler:
    if policy == "linked":
        return _linked(engine, batch)
    sched = Scheduler(engine, pool_bytes=1 << 22)
    for i in range(batch):
        text = TEXTS[i % len(TEXTS)] + " x" * i
        pol = make_policy(policy.split("-")[0], **POLICIES[policy])
        # a core to restrict to, image entries to factor: vision entries
        images = [_image(i)] if policy in ("avl-core", "attnpack") else []
        sched.submit(Request(Prompt(text, images), pol, 32, stop_at_eos=False))
    return _admitted(sched, batch)


def _linked(engine, batch: int) -> Scheduler:
    """``batch`` full-cache requests, the first linking an image record a finished request computed."""
    from vlkv.runtime.link.gate import UNCHECKED_ENV
    from vlkv.runtime.link.spec import LinkSpec

    os.environ[UNCHECKED_ENV] = "1"
    sched = Scheduler(engine, pool_bytes=1 << 23, link_threshold=0.0)
    spec = LinkSpec("mpic", 2)
    with torch_path_prefill():
        sched.submit(
            Request(Prompt("Describe it.", [_image(0)]), make_policy("full"), 1, stop_at_eos=False, link=spec)
        )
        sched.run()
    first = Request(Prompt("What is it?", [_image(0)]), make_policy("full"), 32, stop_at_eos=False, link=spec)
    sched.submit(first)
    for i in range(1, batch):
        sched.submit(
            Request(Prompt(TEXTS[i % len(TEXTS)] + " x" * i), make_policy("full"), 32, stop_at_eos=False)
        )
    sched = _admitted(sched, batch)
    assert first.cached_tokens > 0 and any(la.linked for la in first.cache.layers)
    return sched


def _admitted(sched: Scheduler, batch: int) -> Scheduler:
    """``sched`` once its ``batch`` requests run (their prefills on the PyTorch path)."""
    with torch_path_prefill():
        for _ in range(batch):  # image prompts may take a prefill a step
            if len(sched.running) == batch:
                break
            sched.step()
    assert len(sched.running) == batch
    return sched


def _image(seed: int):
    """A small random RGB image (the tests' kind: nothing downloaded)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))


class _Halves:
    """Counts the static step's host half and device half apart (each wrapped while counting)."""

    def __init__(self):
        self.host = self.device = self.stats = self.edit = None

    def __enter__(self):
        from vlkv.runtime.kv import factor_ranks, lowrank

        self._prepare, self._forward = static_step.prepare, static_step.forward
        self._stats = static_step.step_stats
        self._edit = lowrank.factor_due, factor_ranks.set_ranks_by_importance

        def counted(fn, half: str):
            def run(*a, **k):
                with count_ops() as c, triton_launches_as_ops(c) as n:
                    got = fn(*a, **k)
                c.launches = n[0]
                setattr(self, half, _add(getattr(self, half), c))
                return got

            return run

        static_step.prepare = counted(self._prepare, "host")
        static_step.forward = counted(self._forward, "device")
        static_step.step_stats = counted(self._stats, "stats")
        # the factor edit's two halves (edits.py imports them when it runs): the factoring where due,
        # and the ranks by importance of every layer and request at once
        lowrank.factor_due = counted(self._edit[0], "edit")
        factor_ranks.set_ranks_by_importance = counted(self._edit[1], "edit")
        return self

    def __exit__(self, *exc):
        from vlkv.runtime.kv import factor_ranks, lowrank

        static_step.prepare, static_step.forward = self._prepare, self._forward
        static_step.step_stats = self._stats
        lowrank.factor_due, factor_ranks.set_ranks_by_importance = self._edit


def _add(acc: dict | None, c) -> dict:
    acc = acc or {"ops": 0, "launches": 0, "syncs": 0}
    acc["ops"] += c.ops
    acc["launches"] += c.launches
    acc["syncs"] += c.syncs
    return acc


def count(engine, batch: int, steps: int, policy: str = "full", eager_only: bool = False) -> list[dict]:
    be = engine.backend
    rows = []
    sched = _running(engine, batch, policy)
    sched.step()  # one more eager step: first-call work out of the way
    with count_ops() as c, triton_launches_as_ops(c) as n:
        for _ in range(steps):
            sched.step()
    rows.append({"config": "eager", "ops": c.ops / steps, "launches": n[0] / steps, "syncs": c.syncs / steps})
    rows[-1]["sync_sites"] = {k: v / steps for k, v in c.sites.items()}
    if eager_only:
        return rows
    sched = _running(engine, batch, policy)
    be.static = static = static_step.StaticDecode(be, capacity_step=64)
    sched.step()  # buffers made
    if static.taken == 0:  # refused: the reasons; the eager row above is what runs
        be.static = None
        rows.append({"config": "static", "refused": static.refused})
        return rows
    halves = _Halves()
    with count_ops() as c, triton_launches_as_ops(c) as n, halves:
        for _ in range(steps):
            sched.step()
    be.static = None
    assert static.taken == steps + 1, static.refused
    row = {"config": "static", "ops": c.ops / steps, "launches": n[0] / steps, "syncs": c.syncs / steps}
    row["sync_sites"] = {k: v / steps for k, v in c.sites.items()}
    # "holes": kvzip's, "select": A-VL core, "rope": linked entries or pre-RoPE factors (whose buffers'
    # key has a fourth part, the factor stacks' shape)
    row["reads"] = sorted(str(key[2]) for key in static._bufs)
    row["host"] = {k: v / steps for k, v in halves.host.items()}
    row["device"] = {k: v / steps for k, v in halves.device.items()}
    for half in ("stats", "edit"):  # the statistics (host, after the forward); the factor edit (commit)
        if getattr(halves, half) is not None:
            row[half] = {k: v / steps for k, v in getattr(halves, half).items()}
    rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", nargs="+", default=["full"], choices=sorted(POLICIES))
    ap.add_argument("--eager-only", action="store_true", help="count the eager step only (no static step)")
    args = ap.parse_args()
    env = gpu_path_env()
    if any(os.environ.get(k) != v for k, v in env.items()):  # the switches are read at import
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **env})
    torch.set_num_threads(1)
    rows = []
    for n in args.layers:
        engine = tiny_engine(n)
        for policy in args.policy:  # interleaved: every policy on one engine per layer count
            for row in count(engine, args.batch, args.steps, policy, args.eager_only):
                row.update(layers=n, batch=args.batch, policy=policy)
                rows.append(row)
                print(json.dumps(row), flush=True)
    lo, hi = min(args.layers), max(args.layers)
    if lo == hi:
        return
    for policy, config in ((p, c) for p in args.policy for c in ("eager", "static")):
        a, b = (
            next(
                (r for r in rows if r["config"] == config and r["layers"] == n and r["policy"] == policy),
                None,
            )
            for n in (lo, hi)
        )
        if b is None or "refused" in b:
            continue
        slope = {"config": config, "policy": policy, "per_layer_ops": (b["ops"] - a["ops"]) / (hi - lo)}
        slope["per_layer_launches"] = (b["launches"] - a["launches"]) / (hi - lo)
        slope["per_layer_syncs"] = (b["syncs"] - a["syncs"]) / (hi - lo)
        if config == "static":
            for half in ("host", "device", "stats", "edit"):
                if half in b:
                    slope[f"{half}_per_layer_ops"] = (b[half]["ops"] - a[half]["ops"]) / (hi - lo)
                    slope[f"{half}_syncs"] = b[half]["syncs"]
        print(json.dumps(slope), flush=True)


if __name__ == "__main__":
    main()
