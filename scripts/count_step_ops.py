"""Torch ops and host syncs of one scheduler decode step (tiny LLaVA, a batch of running requests).

Usage: python scripts/count_step_ops.py [--batch 4] [--layers 2 4 8] [--split-append] [--gpu-path]
[--policies full h2o avl snapkv] [--paths STEPS [--shapes equal ragged]]
Prints, per policy and layer count, the ops and syncs one decode step dispatches (see
:mod:`vlkv.runtime.op_count`), the scheduler's own share, and the syncs by module, so a change's
effect on launch overhead is a number; then per policy its ops per layer (the slope between the
fewest and the most layers counted) and the rest of the step (``"per_layer"`` rows). The counts are
the same on any device (CPU here).
``--split-append``: each row again with the decode layers' cache append in Python and the paged read a
separate call (``VLKV_CPU_APPEND=0``, the path before the fused append-and-read), ``"append": "split"``.
``--gpu-path``: the path a CUDA device runs, counted here: every CPU C++ kernel off (``gpu_parts``'
``CPU_KERNEL_SWITCHES`` = 0) and the Triton kernels forced (``VLKV_FORCE_TRITON=1``) under Triton's
interpreter; the script runs itself again with that environment. A Triton launch counts as one op (one
kernel launch on the device), not the interpreter's host copies around it (``"launches"``: how many).
The step that admits (prefills) the batch runs on the PyTorch path (:func:`torch_path_prefill`): it is
not counted, and under the interpreter it was ~85 % of the run's time.
``--paths STEPS``: per policy the ops per decode step (averaged over ``STEPS``) of the scheduler and of
``Engine.decode`` over one batched cache, on the same prompt (``"steps_of"``: which path);
``--shapes ragged``: on prompts of different lengths instead (``"shape"``: which), the common case in
serving (the engine's batch is then padded; the scheduler's requests hold different lengths).
``--device cuda``: the model on a GPU, the path itself (no interpreter): a Triton launch dispatches no
aten op there, so its ops are ``--gpu-path``'s less its launches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

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
# counted with --policies only (snapkv compresses once: its decode steps are plain reads; local and
# elastic cut while decoding, without statistics)
MORE_POLICIES = {"snapkv": {"budget": 0.5}, "local": {"budget": 0.5}, "elastic": {"budget": 0.5}}
OWN = SCHEDULER_MODULES


def tiny_engine(num_layers: int, device: str = "cpu") -> Engine:
    model, processor = build_tiny_llava(TinySpec(num_layers=num_layers))
    return Engine(LoadedModel(model.eval().to(device), processor, "tiny-llava", "llava"))


def gpu_path_env() -> dict[str, str]:
    """The environment under which this machine runs the path CUDA runs (see the module docstring)."""
    from gpu_parts import CPU_KERNEL_SWITCHES  # scripts/ is on the path of a script run

    return {"VLKV_FORCE_TRITON": "1", "TRITON_INTERPRET": "1", **dict.fromkeys(CPU_KERNEL_SWITCHES, "0")}


@contextlib.contextmanager
def triton_launches_as_ops(count):
    """Under Triton's interpreter, count each kernel launch in ``count`` (an :class:`OpCount`) as one op
    and hide the interpreter's own host copies of its arguments (what a device launch does not
    dispatch). Yields a one-item list: the number of launches. Outside the interpreter: nothing."""
    launches = [0]
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield launches
        return
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        count.ops += 1
        launches[0] += 1
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def torch_path_prefill():
    """The block on the PyTorch path: ``VLKV_FORCE_TRITON`` unset and the device layer off (CPU tensors
    then take neither the Triton kernels nor their glue). The admitting step's prefill leaves the same
    pool, tables and policy state on either path, in a fraction of the interpreter's time (its glue
    kernels run a program per token and head); the decode steps after it, the counted one's warm-up
    included, take the path counted."""
    from vlkv.runtime.models import device_layer

    was, on = os.environ.pop("VLKV_FORCE_TRITON", None), device_layer.DEVICE_LAYER
    device_layer.DEVICE_LAYER = False
    try:
        yield
    finally:
        device_layer.DEVICE_LAYER = on
        if was is not None:
            os.environ["VLKV_FORCE_TRITON"] = was


def count_decode_step(engine: Engine, policy: str, batch: int = 4, warm: int = 2):
    """The :class:`OpCount` of one decode step over ``batch`` running requests under ``policy`` (its
    ``launches``: the Triton launches among its ops, counted as one op each)."""
    texts = ["Describe the scene in detail.", "Hi", "What colour is the sky today?", "Count them."]
    sched = Scheduler(engine)
    for i in range(batch):
        prompt = Prompt(texts[i % len(texts)] + " x" * i)
        settings = {**POLICIES, **MORE_POLICIES}[policy]
        sched.submit(Request(prompt, make_policy(policy, **settings), 16, stop_at_eos=False))
    with torch_path_prefill():  # admit (prefill) everyone: not counted, ~85 % of the time it took
        sched.step()
    for _ in range(warm - 1):  # then a plain decode step or more
        sched.step()
    assert len(sched.running) == batch and not sched.waiting
    with count_ops() as c, triton_launches_as_ops(c) as launches:
        sched.step()
    c.launches = launches[0]
    return c


# ``--paths``: the requests of both paths decode one prompt (the engine's batch is then unpadded)
SAME_TEXT = "Describe the scene in detail please, every part of it."


def path_prompts(batch: int, shape: str = "equal") -> list[Prompt]:
    """``--paths``' prompts: ``batch`` of :data:`SAME_TEXT` (``"equal"``), or ``"ragged"``: each a few
    words longer than the one before (every request holds a different length, 2 to 3 tokens apart)."""
    if shape == "equal":
        return [Prompt(SAME_TEXT)] * batch
    return [Prompt(SAME_TEXT + " and more" * i) for i in range(batch)]


def scheduler_steps(engine: Engine, policy: str, batch: int = 4, shape: str = "equal"):
    """A step function decoding ``batch`` requests of :func:`path_prompts` through :meth:`Scheduler.step`
    (admitted and decoding twice already, so its counted steps line up with :func:`engine_steps`')."""
    settings = {**POLICIES, **MORE_POLICIES}[policy]
    sched = Scheduler(engine)
    for prompt in path_prompts(batch, shape):
        sched.submit(Request(prompt, make_policy(policy, **settings), 32, stop_at_eos=False))
    with torch_path_prefill():
        sched.step()
    sched.step()
    assert len(sched.running) == batch and not sched.waiting
    return sched.step


def engine_steps(engine: Engine, policy: str, batch: int = 4, shape: str = "equal"):
    """A step function decoding the same ``batch`` prompts through :meth:`Engine.decode` over one
    batched cache (the benchmarks' path), after its prefill and two decode steps."""
    pol = make_policy(policy, **{**POLICIES, **MORE_POLICIES}[policy])
    prompts = engine.encode(path_prompts(batch, shape))
    cache = engine.new_cache(prompts)
    with torch_path_prefill():
        out = engine.prefill(prompts, pol, cache)
    state = {"tok": out.logits.argmax(-1), "step": 0}

    def step():
        state["step"] += 1
        state["tok"] = engine.decode(state["tok"], prompts, pol, cache, state["step"]).logits.argmax(-1)

    step()
    step()
    return step


def count_steps(step, steps: int):
    """The :class:`OpCount` of ``steps`` calls of ``step`` (its ``launches`` as in :func:`count_decode_step`):
    a decode-evicting policy evicts on some steps only (its target grows by ``budget`` a step)."""
    with count_ops() as c, triton_launches_as_ops(c) as launches:
        for _ in range(steps):
            step()
    c.launches = launches[0]
    return c


# the modules whose functions are Triton kernels (``@triton.jit``): under the interpreter, Python
KERNEL_FILES = ("_kernels.py", "flash_tiles.py", "ptx.py")


def profile_steps(step, steps: int, top: int = 5) -> tuple[float, list[str]]:
    """The host time of ``steps`` calls of ``step`` under cProfile (ms per step) and its ``top``
    functions by own time, as called from ``vlkv``'s host code: a builtin's or torch method's own time
    counts only its calls from a ``vlkv`` function, so Triton's interpreter and the kernels it runs
    (they stand for a device's kernels, ``KERNEL_FILES``) are left out."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()

    def ours(path: str) -> bool:  # vlkv's host code, not a Triton kernel's body the interpreter runs
        return "/vlkv/" in path and not path.endswith(KERNEL_FILES)

    rows = []
    for (f, _, name), v in pstats.Stats(prof).stats.items():
        if ours(f):
            own = v[2]
        elif f == "~" or "/torch/" in f:  # builtins, torch's methods: the calls vlkv made
            own = sum(edge[2] for caller, edge in v[4].items() if ours(caller[0]))
        else:
            continue
        where = f.split("/vlkv/")[-1] if "/vlkv/" in f else f.split("/site-packages/")[-1]
        rows.append((own, f"{where}:{name}"))
    total = sum(own for own, _ in rows) / steps * 1e3
    return round(total, 2), [
        f"{name} {own / steps * 1e3:.2f}" for own, name in sorted(rows, reverse=True)[:top]
    ]


def per_layer(rows: list[dict]) -> list[dict]:
    """Per policy (and append form): ops per layer, the slope between the fewest and the most layers
    counted, and the step's ops outside the layers (the intercept)."""
    out = []
    keys = dict.fromkeys((r["policy"], r["append"]) for r in rows)
    for policy, append in keys:
        mine = {r["layers"]: r for r in rows if r["policy"] == policy and r["append"] == append}
        lo, hi = min(mine), max(mine)
        if lo == hi:
            continue
        slope = (mine[hi]["ops"] - mine[lo]["ops"]) / (hi - lo)
        out.append(
            {
                "per_layer": slope,
                "policy": policy,
                "append": append,
                "rest": mine[lo]["ops"] - slope * lo,
                "launches_per_layer": (mine[hi]["launches"] - mine[lo]["launches"]) / (hi - lo),
                "layers": [lo, hi],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--split-append", action="store_true", help="also count with VLKV_CPU_APPEND=0")
    ap.add_argument("--gpu-path", action="store_true", help="count the path CUDA runs (see the docstring)")
    ap.add_argument("--device", default="cpu", help="the model's device (cuda: the path itself, see below)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=[*POLICIES, *MORE_POLICIES])
    ap.add_argument(
        "--paths",
        type=int,
        metavar="STEPS",
        help="instead: per policy the ops per decode step, averaged over STEPS steps, of the scheduler "
        "and of Engine.decode over one batched cache, every request decoding one prompt",
    )
    ap.add_argument("--profile", action="store_true", help="with --paths: cProfile's top own times too")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=["equal"],
        choices=["equal", "ragged"],
        help="with --paths: one prompt for every request (equal) and/or prompts of different lengths (ragged)",
    )
    args = ap.parse_args()
    if args.gpu_path:
        env = gpu_path_env()
        if any(os.environ.get(k) != v for k, v in env.items()):  # the switches are read at import
            os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **env})
    torch.set_num_threads(1)
    if args.paths:
        for n in args.layers:
            engine = tiny_engine(n, args.device)
            for policy, shape in [(p, s) for p in args.policies for s in args.shapes]:
                for name, make in (("scheduler", scheduler_steps), ("engine", engine_steps)):
                    step = make(engine, policy, args.batch, shape)
                    c = count_steps(step, args.paths)
                    row = {
                        "layers": n,
                        "policy": policy,
                        "shape": shape,
                        "steps_of": name,
                        "steps": args.paths,
                    }
                    row.update(
                        ops=c.ops / args.paths, launches=c.launches / args.paths, syncs=c.syncs / args.paths
                    )
                    if args.profile:
                        row["host_ms"], row["top_own_ms"] = profile_steps(step, args.paths)
                    print(json.dumps(row), flush=True)
        return
    rows = []
    for n in args.layers:
        engine = tiny_engine(n, args.device)
        for policy in args.policies:
            for split in (False, True) if args.split_append else (False,):
                on = paged_append.FUSED_APPEND
                paged_append.FUSED_APPEND = on and not split
                try:
                    c = count_decode_step(engine, policy, args.batch)
                finally:
                    paged_append.FUSED_APPEND = on
                row = {"layers": n, "policy": policy, "ops": c.ops, "syncs": c.syncs, "kinds": dict(c.kinds)}
                row["append"] = "fused" if on and not split and paged_append.kernel() is not None else "split"
                row["path"] = "gpu" if args.gpu_path or args.device != "cpu" else "cpu"
                row["launches"] = c.launches
                row["scheduler_syncs"] = c.syncs_in(*OWN)
                row["modules"] = dict(c.modules)
                rows.append(row)
                print(json.dumps(rows[-1]))
    for row in per_layer(rows):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
