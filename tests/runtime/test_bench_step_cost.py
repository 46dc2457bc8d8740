"""``scripts/bench_step_cost.py --tiny`` end to end: before and after of every per-step policy in one
run, the phases timed, ops counted, tokens compared, JSON + markdown written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_step_cost.py"


def test_tiny_run_pairs_before_and_after_with_equal_tokens(tmp_path):
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--policies", "h2o", "avl", "--controls", "snapkv",
        "--budgets", "0.5", "0.2", "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    rows = {(r["config"], r["code"]): r for r in res["rows"]}
    per_step = [f"{p}@{b}" for p in ("h2o", "avl") for b in ("0.5", "0.2")]
    want = {(c, code) for c in per_step for code in ("after", "before")}
    want |= {("snapkv@0.5", "after"), ("snapkv@0.2", "after")}
    assert set(rows) == want
    for c in per_step:
        after = rows[(c, "after")]
        assert after["same_tokens"] is True, c
        assert after["before_over_after"] > 0 and len(after["step_ms_rounds"]) == res["repeats"]
        assert after["ops_per_step"] > 0 and rows[(c, "before")]["ops_per_step"] > 0
    assert "before / after" in md.read_text()


def test_bad_threads_is_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--threads", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--threads must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_tiny_run_of_the_pack_change(tmp_path):
    """``--change pack``: before is packing off; packed rows are one run after the prefill's
    eviction, the tokens equal."""
    out = tmp_path / "p.json"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--change", "pack", "--policies", "snapkv", "h2o",
        "--budgets", "0.5", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["change"] == "pack"
    rows = {(r["config"], r["code"]): r for r in res["rows"]}
    for c in ("snapkv@0.5", "h2o@0.5"):
        assert rows[(c, "after")]["same_tokens"] is True, c
        assert rows[(c, "after")]["runs_per_row"] == 1.0, c
        assert rows[(c, "before")]["runs_per_row"] >= 1.0, c
