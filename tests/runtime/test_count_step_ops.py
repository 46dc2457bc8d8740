"""``scripts/count_step_ops.py``: a decode step's ops with the fused decode append and without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_step_ops.py"


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
