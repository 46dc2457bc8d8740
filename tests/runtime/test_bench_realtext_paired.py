"""``scripts/bench_realtext_paired.py``: a run's NLL paired with an earlier run's stored window means."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_realtext_paired.py"
WINDOWS = ["kjv:A@0", "kjv:B@0", "kjv:C@0"]


def _runs(tmp_path: Path, stored_full_shift: float = 0.0) -> tuple[Path, Path]:
    """This run: full + one config as per-token NLL; the earlier run: window means of full + one config."""
    out, old = tmp_path / "new", tmp_path / "old"
    full = torch.tensor([[1.0, 2.0], [2.0, 2.0], [3.0, 1.0]])  # window means 1.5, 2.0, 2.0
    for label, nll in (("full@1", full), ("cheap@0.5", full + 0.1)):
        path = out / "nll" / "vlkv" / f"{label}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        rec = {
            "side": "vlkv",
            "label": label,
            "windows": WINDOWS,
            "nll": nll,
            "kl": torch.full_like(nll, 0.01),
        }
        torch.save(rec, path)
    old.mkdir()
    means = {
        "vlkv:full@1": [1.5 + stored_full_shift, 2.0, 2.0],
        "kvpress:press@0.5": [1.7, 2.2, 2.2],
    }
    (old / "per_window.json").write_text(json.dumps({"windows": WINDOWS, "window_mean_nll": means}))
    (old / "results.json").write_text(json.dumps([{"side": "kvpress", "label": "press@0.5", "kl": 0.02}]))
    return out, old


def _run(out: Path, old: Path, report: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, str(SCRIPT), "--out", str(out), "--stored", str(old), "--budgets", "0.5",
        "--series", "cheap::vlkv:cheap", "press::stored:kvpress:press", "--compare", "cheap::press",
        "--boot", "200", "--report", str(report),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_pairs_this_runs_nll_with_stored_window_means(tmp_path):
    out, old = _runs(tmp_path)
    report = tmp_path / "paired.md"
    done = _run(out, old, report)
    assert done.returncode == 0, done.stderr
    text = report.read_text()
    # every window +0.1 nats (this run) / +0.2 nats (stored): ΔPPL exp(0.1) − 1 and exp(0.2) − 1
    assert f"| cheap | {100 * (math.exp(0.1) - 1):+.2f} % [" in text
    assert "(0.0100)" in text and "(0.0200)" in text  # KL from this run's records / the stored results
    diff = 100 * (math.exp(0.1) - math.exp(0.2))  # every window moves alike: a zero-width interval
    assert f"| `cheap` − `press` | {diff:+.2f} [{diff:+.2f}, {diff:+.2f}] |" in text


def test_refuses_runs_whose_full_cache_differs(tmp_path):
    out, old = _runs(tmp_path, stored_full_shift=0.01)
    done = _run(out, old, tmp_path / "paired.md")
    assert done.returncode == 2 and "full cache" in done.stderr and "Traceback" not in done.stderr


def test_pairs_a_subset_of_the_stored_windows(tmp_path):
    out, old = _runs(tmp_path)
    raw = json.loads((old / "per_window.json").read_text())
    # the earlier run had one more window, first; its values there must not enter the pairing
    raw["windows"] = ["kjv:Z@0", *WINDOWS]
    raw["window_mean_nll"] = {k: [9.0, *v] for k, v in raw["window_mean_nll"].items()}
    (old / "per_window.json").write_text(json.dumps(raw))
    report = tmp_path / "paired.md"
    done = _run(out, old, report)
    assert done.returncode == 0, done.stderr
    diff = 100 * (math.exp(0.1) - math.exp(0.2))
    assert f"| `cheap` − `press` | {diff:+.2f} [{diff:+.2f}, {diff:+.2f}] |" in report.read_text()
    # windows the earlier run does not have: nothing pairs
    raw["windows"] = ["kjv:Z@0", "kjv:A@0", "kjv:B@0", "kjv:Y@0"]
    (old / "per_window.json").write_text(json.dumps(raw))
    done = _run(out, old, report)
    assert done.returncode == 2 and "not among" in done.stderr and "Traceback" not in done.stderr
