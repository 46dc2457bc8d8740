"""``scripts/bench_decode_layer.py`` and ``scripts/bench_gemm_stream.py`` end to end on tiny inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_decode_layer_tiny(tmp_path):
    out, md = tmp_path / "l.json", tmp_path / "l.md"
    cmd = [sys.executable, str(SCRIPTS / "bench_decode_layer.py"), "--tiny", "--threads", "1", "--huge",
           "--json", str(out), "--md", str(md)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    lo = res["layers_only"]
    assert lo["bit_equal"] and lo["huge_bit_equal"] and lo["ops"]["fused"] < lo["ops"]["calls"]
    rows = {r["config"]: r for r in res["decode"]["rows"]}
    assert set(rows) == {f"{c}{s}" for c in ("full", "snapkv@0.1") for s in ("", "+calls", "+huge")}
    for c in ("full", "snapkv@0.1"):
        assert rows[c]["same_tokens"] and rows[f"{c}+huge"]["same_tokens"]
        assert rows[c]["ops_per_step"] < rows[f"{c}+calls"]["ops_per_step"]
    assert "| full+calls |" in md.read_text()


def test_bench_decode_layer_gemm_s7_layers_only(tmp_path):
    """``--gemm-s7 --read-mib``: the layers alone again with session 7's GEMM form, a read after each
    layer; bit-equal, a paired ratio."""
    out = tmp_path / "l.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_decode_layer.py"), "--tiny", "--threads", "1", "--layers-only",
           "--gemm-s7", "--read-mib", "1", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lo = json.loads(out.read_text())["layers_only"]
    assert lo["gemm_s7_bit_equal"] and lo["gemm_s7_speedup"] > 0 and lo["read_mib"] == 1
    assert "decode" not in json.loads(out.read_text())


def test_bench_gemm_stream_one_shape(tmp_path):
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    cmd = [sys.executable, str(SCRIPTS / "bench_gemm_stream.py"), "--rows", "1", "2", "--rounds", "3",
           "--ring-mib", "4", "--shapes", "k/v 192x576", "--json", str(out), "--md", str(md)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert sorted(rows) == ["k/v 192x576 x1", "k/v 192x576 x2"]
    for row in rows.values():
        assert set(row["gbps_best"]) == {"blocked", "stream", "sum"}  # the seat after sum is not reported
        assert all(v > 0 for v in row["gbps_best"].values())
    assert "| k/v 192x576 x2 |" in md.read_text()
