"""``scripts/bench_decode.py`` end to end on the tiny model: the decode cadence option and the plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_decode.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny-llava", "--batch", "2", "--repeats", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tokens", [["64"], ["48", "64"]], ids=["one-context", "two-contexts"])
def test_cadence_run_writes_rows_and_a_plot(tmp_path, tokens):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    done = _run(
        "--tokens", *tokens, "--policies", "h2o", "snapkv", "--budgets", "0.5", "--steps", "4",
        "--evict-every", "2", "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["evict_every"] == 2 and "mean of 4 steps, decode eviction every 2 steps" in done.stdout
    assert sorted((r["policy"], r["budget"]) for r in res["rows"]) == sorted(
        [("h2o", 0.5), ("snapkv", 0.5)] * len(tokens)
    )
    assert all(r["step_ms"] > 0 and r["limit"] >= 1.0 for r in res["rows"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steps_not_a_multiple_of_the_cadence_is_one_line():
    done = _run("--tokens", "64", "--steps", "3", "--evict-every", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--steps (3) must be a multiple of --evict-every (2)" in done.stderr


def test_interleaved_run_pairs_every_step_with_a_full_step(tmp_path):
    out = tmp_path / "d.json"
    done = _run(
        "--tokens", "64", "--policies", "local", "snapkv", "--budgets", "0.5", "0.2", "--steps", "3",
        "--interleave", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["interleave"] is True and "stepped in lockstep with the full cache" in done.stdout
    assert done.stdout.count("(interleaved)") == 4
    rows = {(r["policy"], r["budget"]): r for r in res["rows"]}
    assert sorted(rows) == [("local", 0.2), ("local", 0.5), ("snapkv", 0.2), ("snapkv", 0.5)]
    fulls = {r["full_step_ms"] for r in rows.values()}
    assert len(fulls) == 1  # one full cache stepped beside every configuration
    for r in rows.values():  # the reported step is the paired ratio applied to the full step
        assert abs(r["speedup"] - r["full_step_ms"] / r["step_ms"]) < 1e-9
