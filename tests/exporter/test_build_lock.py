"""One build-engine per --out: a second run fails in one line naming the holder and touches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vlkv.exporter.build_lock import LOCK_FILE, build_lock
from vlkv.exporter.cli import EXIT_ERROR, main
from vlkv.exporter.errors import BuildLocked

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "recipes" / "demo.yaml")

_HOLDER = """
import sys, time
from vlkv.exporter.build_lock import build_lock
with build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding the build lock of tmp_path / "out"."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc, out
    proc.kill()
    proc.wait(timeout=30)


def test_second_build_on_one_out_fails_in_one_line_and_deletes_nothing(holder, capsys):
    proc, out = holder
    (out / "vision_onnx").mkdir()
    (out / "vision_onnx" / "vision.onnx").write_bytes(b"being written by the first build")
    (out / "resolved_recipe.yaml").write_text("first build's recipe\n")
    code = main([DEMO, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_ERROR and len(err.splitlines()) == 1
    assert err.startswith(
        f"build-engine: error: {out} is being built by another build-engine (pid {proc.pid} on "
    )
    assert err.endswith("wait for it or use another --out")
    assert (out / "vision_onnx" / "vision.onnx").read_bytes() == b"being written by the first build"
    assert (out / "resolved_recipe.yaml").read_text() == "first build's recipe\n"


def test_a_killed_holder_does_not_block_the_next_build(holder):
    proc, out = holder
    with pytest.raises(BuildLocked), build_lock(out):
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with build_lock(out) as path:
        assert path == out / LOCK_FILE and str(os.getpid()) in path.read_text()


def test_the_lock_is_reentrant_in_one_process(tmp_path):
    with build_lock(tmp_path / "out"):
        with build_lock(tmp_path / "out"):
            pass
        with build_lock(tmp_path / "out"):  # still held by the outer block
            pass
    assert (tmp_path / "out" / LOCK_FILE).read_text() == ""  # released and cleared
