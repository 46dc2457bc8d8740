"""``scripts/bench_decode_parts.py --tiny`` end to end: a decode step split into its parts (the layers'
two C++ calls, the paged read, the head, the policy hook, the rest), per GEMM form, with the layers
and head alone on the same weights in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_decode_parts.py"


def test_tiny_run_splits_each_step_into_its_parts_per_gemm_form(tmp_path):
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--policies", "h2o", "--budgets", "0.5",
        "--forms", "0", "2", "--alone-reps", "2", "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert sorted(rows) == ["full/0", "full/2", "h2o@0.5/0", "h2o@0.5/2"]
    for name, row in rows.items():
        ms = row["ms"]
        # every part was timed inside the step: the parts' sum is the step (rest is what is left)
        assert set(ms) == {"pre", "post", "attention", "head", "policy", "rest"}
        assert ms["pre"] > 0 and ms["post"] > 0 and ms["attention"] > 0 and ms["head"] > 0, name
        assert abs(sum(ms.values()) - row["step_ms"]) < 1e-6 * max(1.0, row["step_ms"])
        assert row["bound_ms"] > 0 and row["kv_bytes"] > 0
    # H2O's decode hook scores and evicts every step; the full cache's returns nothing
    assert rows["h2o@0.5/0"]["ms"]["policy"] > rows["full/0"]["ms"]["policy"] >= 0
    assert res["layer_bytes"] > 0 and res["head_bytes"] > 0 and res["probe_gb_s"] > 0
    assert set(res["alone_s"]) == {"layers", "head", "sum_weights"}
    assert all(0 < v["best"] <= v["median"] for v in res["alone_s"].values())
    text = md.read_text()
    assert "| h2o@0.5/2 |" in text and "pre + post ms" in text and "| sum_weights |" in text


def test_kv_4k_runs_each_configuration_beside_its_pool_in_4k_pages(tmp_path):
    out = tmp_path / "k.json"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--policies", "snapkv", "--budgets", "0.5",
        "--kv-4k", "--alone-reps", "1", "--layout", "image-first", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["layout"] == "image-first"
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["full", "full+kv4k", "snapkv@0.5", "snapkv@0.5+kv4k"]  # each twin beside its config
    for name in ("full", "snapkv@0.5"):
        assert rows[name]["step_vs_kv4k"] > 0 and rows[name]["attention_vs_kv4k"] > 0
        assert rows[name + "+kv4k"]["step_vs_kv4k"] is None
        assert rows[name]["kv_bytes"] == rows[name + "+kv4k"]["kv_bytes"]
        assert 0.0 <= rows[name]["kv_huge_share"] <= 1.0
