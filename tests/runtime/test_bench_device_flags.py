"""Every benchmark script takes ``--device`` and ``--dtype bf16``; a device missing here is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NAMES = (
    "bench_attnpack",
    "bench_decode",
    "bench_image_qa",
    "bench_kernels",
    "bench_link",
    "bench_ort",
    "bench_overhead",
    "bench_policies",
    "bench_prefill_stats",
    "bench_rope_read",
    "bench_runtime",
    "bench_serve",
    "bench_store",
)
SCRIPTS = [ROOT / "scripts" / f"{name}.py" for name in NAMES]


def test_the_listed_scripts_exist():
    assert all(s.is_file() for s in SCRIPTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda is valid here")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_cuda_without_a_gpu_is_one_line(script):
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cuda", "--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert (
        "cuda" in out[-1].lower()
        and len([line for line in out if "error" in line.lower() or "cuda" in line.lower()]) == 1
    )
