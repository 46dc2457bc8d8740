"""``scripts/bench_skinny_gemm.py`` end to end on one small shape: every form timed (the kernel's
session-7 form beside it), JSON + markdown; ``--huge`` puts the ring in huge pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_skinny_gemm.py"


@pytest.mark.parametrize("huge", [False, True])
def test_one_shape_every_form(tmp_path, huge):
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    cmd = [
        sys.executable, str(SCRIPT), "--threads", "1", "--rows", "1", "4", "--rounds", "3", "--ring-mib", "4",
        "--shapes", "k/v 192x576", "--json", str(out), "--md", str(md), *(["--huge"] if huge else []),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    rows = res["threads"]["1"]
    assert res["huge"] is huge
    assert sorted(rows) == ["k/v 192x576 x1", "k/v 192x576 x4"]
    for row in rows.values():
        assert set(row["gbps"]) == {"F.linear", "(W@xT)T", "kernel", "kernel-s7", "kernel-s8", "sum"}
        assert all(v > 0 for v in row["gbps"].values())
        assert all(row["us_best"][f] <= row["us_median"][f] for f in row["us_best"])
    assert "| k/v 192x576 x4 |" in md.read_text() and "kernel vs kernel-s8 (median)" in md.read_text()


def test_rows_out_of_range_is_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "9"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--rows must lie in 1..8" in done.stderr
