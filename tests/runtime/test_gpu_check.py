"""The prepared GPU check's CPU dry run: every part at toy sizes, the report's schema, part isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

from gpu_check import BUDGETS, check_report  # noqa: E402
from gpu_parts import CPU_KERNEL_SWITCHES, DECODE_POLICIES, PROFILE_POLICIES, pytest_summary  # noqa: E402


def _run(tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    # the CPU C++ kernels off, as on a GPU: the dry run checks the script, and a first build of those kernels
    # (minutes on a loaded 2-core machine) would spend its parts' time limits before they measure anything
    env = dict(os.environ, PYTHONPATH=str(ROOT)) | {name: "0" for name in CPU_KERNEL_SWITCHES}
    # one torch thread per part: beside another test file on CI's two cores, two threads' OpenMP
    # barriers stall (the dry run's decode part 68 s at 2 threads, 18 s at 1, side by side, loaded)
    flags = ("--device", "cpu", "--tiny", "--threads", "1", "--out", str(tmp))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    report = json.loads((tmp / "report.json").read_text()) if (tmp / "report.json").exists() else {}
    return proc, report


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry-run")
    return (*_run(out), out)


def test_dry_run_runs_every_part(dry_run):
    proc, report, out = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert check_report(report) == []
    assert list(report["parts"]) == list(BUDGETS)
    for name, part in report["parts"].items():
        want = "skipped" if name in ("compile", "tensorrt") else "ok"
        assert part["status"] == want, (name, part)
    md = (
        Path(report["parts"]["env"]["result"] and proc.args[proc.args.index("--out") + 1]) / "report.md"
    ).read_text()
    assert "# vlkv GPU check" in md and "| decode | ok |" in md
    assert "| toy-qwen2-vl × 1 | 4 |" in md  # the low-rank split cut's table
    assert "1 torch threads" in report["parts"]["env"]["result"]["cpu"]  # --threads reached the parts


def test_dry_run_measures_what_it_reports(dry_run):
    parts = dry_run[1]["parts"]
    env = parts["env"]["result"]
    assert env["bandwidth"]["copy_gbps"] > 0 and env["versions"]["transformers"]
    kernels = parts["kernels"]["result"]
    for name in ("stats", "selected", "lowrank", "merge"):
        assert not isinstance(kernels[name], str), (name, kernels[name])
    assert all(r["colsum_max_err"] < 1e-5 for r in kernels["stats"])
    assert kernels["selected"]["max_err"] < 1e-5 and kernels["merge"]["max_err"] < 1e-5
    # the paged low-rank read's two split cuts and the dense read, each against its reference (interpreter)
    split = kernels["lowrank_split"]
    assert isinstance(split, list) and {r["model"] for r in split} == {"toy-qwen2-vl", "toy-llava"}, split
    for r in split:
        assert ("M-RoPE" if r["model"] == "toy-qwen2-vl" else "1-D RoPE") in r["rope"], r
        for name in ("default", "chunk1", "dense"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_max_err"] < 1e-5 and r[f"{name}_within_tol"], (name, r)
        assert r["default_over_chunk1"] > 0 and r["splits"] == 4
        # the toy cells cut differently: the default gives the span one split, chunk=1 two (more loads)
        assert r["cut_default"]["basis_loads"] < r["cut_chunk1"]["basis_loads"], r
        assert r["cut_default"]["factored_bytes"] < r["cut_chunk1"]["factored_bytes"], r
    cells = parts["decode"]["result"]["cells"]
    first = cells[0]
    assert not first["errors"], first["errors"]
    assert {r["policy"] for r in first["rows"]} == set(DECODE_POLICIES)
    assert all(r["bound_ms"] > 0 and r["of_bound"] > 0 for r in first["rows"])
    assert any(c["model"] == "shape:toy-qwen2-vl" and c.get("rows") for c in cells)  # M-RoPE shape ran
    assert {r["config"] for r in parts["prefill"]["result"]["rows"]} >= {"plain", "snapkv", "every row"}
    # where a statistics prefill's time goes, beside the plain one's (profiled once each)
    split = parts["prefill"]["result"]["breakdown"]
    assert set(split) == {"plain", "snapkv"} and all(
        b["ops"] > 0 and b["top"][0]["ms"] > 0 for b in split.values()
    )
    assert split["snapkv"]["ops"] > split["plain"]["ops"]  # the statistics add operators
    profile = parts["profile"]["result"]["policies"]
    assert set(profile) == set(PROFILE_POLICIES)
    for name, row in profile.items():  # both paths measured: the engine's and the scheduler's step
        assert set(row) == {"engine", "scheduler"}, (name, row)
        assert all(isinstance(p, dict) and p["ops_per_step"] > 0 for p in row.values()), (name, row)
        assert row["scheduler"]["running"] == parts["profile"]["result"]["batch"], (name, row)
        for p in row.values():  # where the host Python goes: the step's own functions, timed unprofiled
            assert p["step_ms"] > 0 and p["host"]["step_ms_cprofile"] > 0, (name, p)
            assert any(o["fn"].startswith("vlkv/") for o in p["host"]["top_own"]), (name, p["host"])
    # without CUDA every gpu-marked test is collected and skipped, none errors
    counts = parts["pytest"]["result"]["counts"]
    assert str(SCRIPT.parent.parent) not in parts["pytest"]["result"]["tail"]  # no machine paths committed
    assert counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("error")


def test_the_gpu_tests_turn_off_every_cpu_kernel_build():
    # the GPU pytest part runs CPU references; a CPU C++ kernel switch left out of the list builds that
    # extension on the lent machine first (H200 run 4: the whole part went to such builds)
    import re

    plugins = SCRIPT.parent.parent / "vlkv" / "plugins"
    named = set()
    for path in plugins.glob("*.py"):
        named |= set(re.findall(r"[\"'](VLKV_CPU_[A-Z_]+)[\"']", path.read_text()))
    assert named, "no VLKV_CPU_* switch found: the search no longer matches how switches are read"
    assert named <= set(CPU_KERNEL_SWITCHES), sorted(named - set(CPU_KERNEL_SWITCHES))


def test_a_part_past_its_limit_is_stopped_and_the_rest_still_run(tmp_path):
    # pytest -m gpu cannot even import torch and collect in 2 s: the part is killed with its child
    proc, report = _run(tmp_path, "--parts", "pytest", "tensorrt", "--limit", "pytest=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert check_report(report) == []
    part = report["parts"]["pytest"]
    assert part["status"] == "timeout" and "limit" in part["reason"] and part["wall_s"] < 30
    assert report["parts"]["tensorrt"]["status"] == "skipped"


def test_an_unfinished_gpu_pytest_run_keeps_its_verdicts_and_each_failures_error():
    # run 7: the tail (last 4000 characters) held the end of one assertion's repr, not the compile error
    # above it; a rerun stopped at its limit kept nothing
    out = "\n".join([
        "collected 417 items / 378 deselected / 39 selected",
        "tests/a.py::test_one PASSED [ 10%]",
        "tests/a.py::test_two FAILED [ 20%]",
        "tests/b.py::test_three PASSED [ 30%]",
        "____________ test_two ____________",
        "E       RuntimeError: PassManager::run failed",
        f"{ROOT}/vlkv/plugins/k.py:63:19: error: 'tt.load' op failed to verify that mask type matches ptr type",
        "x" * 5000,
    ])  # fmt: skip
    got = pytest_summary(out, ROOT, "timeout")
    assert got["counts"] == {"deselected": 378, "passed": 2, "failed": 1} and got["exit_code"] == "timeout"
    assert (
        "PassManager::run failed" in got["errors"]
        and "<repo>/vlkv/plugins/k.py:63:19: error" in got["errors"]
    )
    assert "PassManager" not in got["tail"]  # what the tail alone would have lost
    assert str(ROOT) not in got["errors"] + got["tail"]
    done = pytest_summary(out + "\n==== 1 failed, 2 passed, 378 deselected in 3.1s ====", ROOT, 1)
    assert done["counts"] == {"failed": 1, "passed": 2, "deselected": 378}


def test_check_report_names_what_is_wrong():
    good = {"schema": "vlkv.gpu_check/1", "device": "cpu", "started": "now", "wall_s": 1.0, "tiny": True,
            "targets": [], "parts": {"env": {"status": "ok", "reason": None, "wall_s": 1.0, "budget_s": 5, "result": {}}}}  # fmt: skip
    assert check_report(good) == []
    bad = json.loads(json.dumps(good))
    bad["schema"] = "other/1"
    bad["parts"]["env"]["status"] = "failed"
    bad["parts"]["nope"] = {}
    problems = "\n".join(check_report(bad))
    assert "schema" in problems and "must say why" in problems and "parts.nope" in problems


def test_bad_arguments_are_one_line(tmp_path):
    for extra in (["--parts", "nope"], ["--limit", "decode=abc"], ["--scale", "0"], ["--threads", "-1"]):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), *extra],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            timeout=120,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
