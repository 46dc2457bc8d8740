"""``scripts/count_step_ops.py``: a decode step's ops with the fused decode append and without it, and
the ops per layer of the path a CUDA device runs (``--gpu-path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_step_ops.py"


def _gpu_path_rows(*args: str) -> list[dict]:
    """The script's JSON rows on the path a CUDA device runs (``--gpu-path``), its environment given
    here: the script need not run itself again (a second start, ~7 s)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from count_step_ops import gpu_path_env

    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--gpu-path", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **gpu_path_env()},
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_the_fused_append_dispatches_fewer_ops_and_no_more_syncs():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "2", "--split-append"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by = {(r["policy"], r["append"]): r for r in rows}
    assert {p for p, _ in by} == {"full", "h2o", "avl"} and {a for _, a in by} == {"fused", "split"}
    for policy in ("full", "h2o"):  # avl's selected attention keeps the separate read: no fewer ops
        assert by[policy, "fused"]["ops"] < by[policy, "split"]["ops"], policy
    for policy in ("full", "h2o", "avl"):
        assert by[policy, "fused"]["syncs"] <= by[policy, "split"]["syncs"], policy


# ops per decoder layer of a decode step on the path CUDA runs (tiny LLaVA, batch 4), counted with a
# Triton launch as one op. Full cache: 138 before the device layer and append (session 9), 62 after, 20
# since the step's table rows (kv/step_tables: each request's table column and the read table written by
# the append's one launch, no longer ~8 ops per request and ~9 for the read table a layer). Of the 20, 6
# are launches (two norms, RoPE, the append, the paged read, SiLU x up), 4 GEMMs, 7 views, the residual
# add and two output allocations. h2o / avl: 200 / 268 -> 156 / 224, the rest is their statistics and
# edits (policies/, paged_probs, kv/edits); avl 212 since its core flags went. h2o / avl 156 / 212 -> 148 /
# 196 since the append's launch zeroes the running scores' new column (the reservation spent 2 ops per
# score table and request). 148 / 196 -> 104 / 152 since the statistics read is one Triton kernel and its
# normalise pass (triton_paged_probs: no gather of K and V, no fp32 copy, no separate softmax and P·V).
# Bounds: the measured counts plus a margin of 2 / 3
GPU_PATH_PER_LAYER = {"full": 22, "h2o": 107, "avl": 155}
# on CUDA a Triton launch dispatches no aten op: the full cache's 20 less its 6 launches, 14, plus a
# margin of 4 for what may differ there (a host tensor's copy to the device, which is no op on the CPU)
CUDA_FULL_PER_LAYER = 18


def test_the_gpu_path_dispatches_a_bounded_number_of_ops_per_layer():
    rows = _gpu_path_rows("--layers", "2", "4")
    steps = [r for r in rows if "ops" in r]
    assert steps and all(r["path"] == "gpu" for r in steps)
    per = {r["policy"]: r for r in rows if "per_layer" in r}
    assert set(per) == set(GPU_PATH_PER_LAYER)
    for policy, bound in GPU_PATH_PER_LAYER.items():
        assert per[policy]["per_layer"] <= bound, (policy, per[policy])
    # the full cache's layer: one paged read and the five glue launches, each counted once
    assert per["full"]["launches_per_layer"] == 6, per["full"]
    # a statistics step's layer: the five glue launches and the paged read with probabilities (its kernel
    # and normalise pass) in place of the paged read
    for policy in ("h2o", "avl"):
        assert per[policy]["launches_per_layer"] == 7, per[policy]
    # no host sync added on the way (the scheduler's one read back of the step's tokens)
    assert all(r["syncs"] == 1 for r in steps if r["policy"] == "full")


@pytest.mark.gpu
def test_on_cuda_the_decode_layer_dispatches_the_counted_ops():
    """On a GPU the same count, the model on CUDA and the kernels compiled (its Triton launches dispatch
    no aten op): the device layer and append are what the step runs there too."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("VLKV_FORCE_TRITON", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--layers", "2", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    per = {r["policy"]: r for r in map(json.loads, done.stdout.splitlines()) if "per_layer" in r}
    assert per["full"]["per_layer"] <= CUDA_FULL_PER_LAYER, per["full"]


# ops per decode step of the scheduler path (--gpu-path, 2 layers, 4 requests of one prompt, averaged
# over 4 steps: h2o and avl evict on some steps only), next to Engine.decode over one batched cache.
# Before the policies' decode bookkeeping ran once per cohort of equal policies (policies/cohort.py)
# the scheduler dispatched h2o 483 / avl 631 a step (engine 264.5 / 307.5): every policy op once per
# request and layer. 363 / 415 with the cohorts; 320 / 372 since a one-column drop moves every
# layer's (and every cohort request's) tables by a few multi-tensor ops (kv/drops.shift_one_each);
# 314 / 366 since the plan's positions and marks are one ``cat`` each (avl: no cohort cache where no
# attend list is made).
# "ragged": 4 prompts of different lengths (the common case in serving). Cohorts of equally long
# requests only: h2o 503 / avl 651 a step (engine 378 / 420), 7 syncs (every request's bookkeeping
# alone); 403 / 465, 3 syncs, since a cohort takes rows of any length (padded score tables, each row's
# own one-column drop, one multi-tensor shift for every length).
# Session 19: 320.5 / 372.5 equal, 429 / 487 ragged, since the multi-tensor shift blends contiguous tables
# whole as flat dense views (masks made per dtype, column size and run of equal capacities: a few more
# ops here, most in ragged steps) — on CUDA its foreach ops then take the multi-tensor kernels instead of
# one launch per table, layer and request (H200 run 7: 15-18 ms of the h2o / A-VL scheduler step).
# Bounds: the measured counts plus a margin of 2 %
SCHEDULER_STEP_OPS = {
    ("h2o", "equal"): 327,
    ("avl", "equal"): 380,
    ("h2o", "ragged"): 438,
    ("avl", "ragged"): 497,
}


def test_the_scheduler_runs_a_policys_decode_bookkeeping_once_per_cohort():
    rows = _gpu_path_rows(
        "--layers", "2", "--paths", "4", "--policies", "h2o", "avl", "--shapes", "equal", "ragged"
    )
    by = {(r["policy"], r["shape"], r["steps_of"]): r for r in rows}
    assert set(by) == {(*k, s) for k in SCHEDULER_STEP_OPS for s in ("scheduler", "engine")}
    for (policy, shape), bound in SCHEDULER_STEP_OPS.items():
        sched, engine = by[policy, shape, "scheduler"], by[policy, shape, "engine"]
        assert sched["ops"] <= bound, (policy, shape, sched)
        # the same kernels on both paths, the scheduler one more per layer (its fused append)
        assert sched["launches"] == engine["launches"] + 2, (sched, engine)
        # the batched bookkeeping reads back no more than the engine's batched cache does
        assert sched["syncs"] <= engine["syncs"], (sched, engine)
    # requests of different lengths share their bookkeeping too: a ragged step's host reads stay those of
    # one cohort (3 a step), not one per request
    for policy in ("h2o", "avl"):
        assert by[policy, "ragged", "scheduler"]["syncs"] <= 3, by[policy, "ragged", "scheduler"]
