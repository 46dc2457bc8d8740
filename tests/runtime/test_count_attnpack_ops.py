"""``scripts/count_static_step.py --eager-only --policy attnpack``: the ops per decoder layer of an eager
AttentionPack decode step (low-rank factors read in place by the paged low-rank kernel) on the path a
CUDA device runs, at 1 and 4 requests, bounded so that per-request work creeping back into every layer
fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_static_step.py"

# ops per layer (slope between 2 and 4 layers; a Triton launch counts as one op), tiny LLaVA, each request
# one image factored at rank 4. Session 18: 142 / 189 / 283 at 1 / 2 / 4 requests (~47 a request and
# layer: the factor stacks padded and copied per request, each request's table column written by tensor
# ops, its held slots counted by a mask per layer). Session 19: 84 / 99 / 131.7 (the stacks kept while
# the factor tensors are the same, the device append's one launch, one held count a request).
# Bounds: the measured counts plus a margin of 2 %
EAGER_PER_LAYER = {1: 86, 4: 134}


def _per_layer(requests: int) -> tuple[dict, list[dict]]:
    sys.path.insert(0, str(SCRIPT.parent))
    from count_step_ops import gpu_path_env

    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--eager-only", "--policy", "attnpack", "--batch", str(requests)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **gpu_path_env()},
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (slope,) = (r for r in rows if "per_layer_ops" in r)
    return slope, [r for r in rows if "ops" in r]


@pytest.mark.parametrize("requests", sorted(EAGER_PER_LAYER))
def test_the_eager_attnpack_step_dispatches_a_bounded_number_of_ops_per_layer(requests):
    slope, steps = _per_layer(requests)
    assert slope["config"] == "eager" and {r["config"] for r in steps} == {"eager"}
    assert slope["per_layer_ops"] <= EAGER_PER_LAYER[requests], slope
    # the five glue launches, the append's and the low-rank read with probabilities (attnpack's statistics)
    assert slope["per_layer_launches"] == 7, slope
    # no host sync in a layer: the step's one read back (step_reads) at any layer count
    assert slope["per_layer_syncs"] == 0 and all(r["syncs"] == 1 for r in steps), steps
