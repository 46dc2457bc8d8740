"""A build lock file left by a killed builder no longer hangs every later engine start."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch.utils.cpp_extension as cpp_extension

from vlkv.plugins import build_lock, paged_cpu_kernel

CHILD = """
import sys, time
from pathlib import Path
from vlkv.plugins import build_lock
d = Path(sys.argv[1])
with build_lock.held(d):
    (d / "lock").touch()  # what torch writes while it builds
    print("building", flush=True)
    time.sleep(60)
"""


def test_a_dead_builders_lock_file_is_removed(tmp_path, capsys):
    d = tmp_path / "vlkv_x"
    d.mkdir()
    (d / "lock").touch()
    with build_lock.held(d):
        assert not (d / "lock").exists()
    assert "did not finish" in capsys.readouterr().err


def test_a_live_builder_is_waited_for_and_its_lock_cleared_when_it_dies(tmp_path):
    d = tmp_path / "vlkv_y"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        got = threading.Event()

        def wait_for_lock():
            with build_lock.held(d):
                got.set()

        t = threading.Thread(target=wait_for_lock, daemon=True)
        t.start()
        assert not got.wait(0.5), "took the lock while a live builder held it"
        assert (d / "lock").exists()  # a live build's marker stays
        child.kill()  # the builder dies mid-build: the OS releases its flock
        assert got.wait(20), "the lock was not released when its holder died"
        assert not (d / "lock").exists()
    finally:
        child.kill()
        child.wait(10)


def test_load_extension_builds_under_the_lock(tmp_path, monkeypatch):
    d = tmp_path / "vlkv_fake"
    d.mkdir()
    (d / "lock").touch()
    seen = []

    def fake_load_inline(name, **kwargs):
        seen.append((name, (d / "lock").exists()))
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(paged_cpu_kernel, "_build_dir", lambda name: d)
    built = []
    assert paged_cpu_kernel.load_extension(built, "vlkv_fake", "", ["f"], "test kernel", "none") == "module"
    assert seen == [("vlkv_fake", False)]  # the dead builder's marker was gone before the build
    assert built == ["module"]
