"""The ONNX export cache: checksummed entries, rebuilt when truncated or tampered, stale temps removed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlkv.runtime.onnx import export_cache
from vlkv.runtime.onnx.export_cache import (
    CHECKSUMS,
    cached_export,
    clean_stale_temps,
    seal,
    temp_dir,
    verify,
)

ROOT = Path(__file__).resolve().parents[3]
LOGGER = export_cache.log.name


def _builder(calls: list):
    def build(folder: Path) -> None:
        calls.append(folder)
        (folder / "model.onnx").write_bytes(b"graph" * 100)
        (folder / "model.onnx.data").write_bytes(bytes(range(256)) * 8)

    return build


def test_entries_are_sealed_and_reused(tmp_path):
    calls: list = []
    path = cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert path == tmp_path / "k1" / "model.onnx" and len(calls) == 1
    assert verify(tmp_path / "k1") is None and (tmp_path / "k1" / CHECKSUMS).is_file()
    assert cached_export(tmp_path, "k1", "model.onnx", _builder(calls)) == path and len(calls) == 1
    assert not list(tmp_path.glob(".export-*"))  # the temporary folder and its lock are gone


def test_entries_are_named_by_the_key_prefix_and_default_to_the_env_root(tmp_path, monkeypatch):
    monkeypatch.setenv(export_cache.CACHE_ENV, str(tmp_path / "env-root"))
    path = cached_export(None, "ab" * 32, "model.onnx", _builder([]))
    assert path == tmp_path / "env-root" / ("ab" * 12) / "model.onnx"


@pytest.mark.parametrize(
    "damage,problem",
    [
        (
            lambda p: p.write_bytes(p.read_bytes()[:100]),
            "is 100 bytes, expected {size} (truncated or replaced)",
        ),
        (
            lambda p: p.write_bytes(bytes(reversed(p.read_bytes()))),
            "fails its sha256 check (modified)",
        ),  # same size
        (lambda p: p.unlink(), "is missing"),
    ],
)
@pytest.mark.parametrize("name", ["model.onnx.data", "model.onnx"])
def test_damaged_entries_are_named_and_rebuilt(tmp_path, caplog, damage, problem, name):
    calls: list = []
    cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    data = tmp_path / "k1" / name
    problem = problem.format(size=data.stat().st_size)
    damage(data)
    assert verify(tmp_path / "k1") == f"export cache file {data} {problem}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 2 and verify(tmp_path / "k1") is None
    assert caplog.messages == [f"export cache file {data} {problem}; rebuilding {tmp_path / 'k1'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]  # the discarded copy is gone


def test_notes_go_to_the_callers_logger(tmp_path, caplog):
    cached_export(tmp_path, "k1", "model.onnx", _builder([]))
    (tmp_path / "k1" / "model.onnx").write_bytes(b"")
    mine = logging.getLogger("vlkv.test-caller")
    with caplog.at_level(logging.WARNING):
        cached_export(tmp_path, "k1", "model.onnx", _builder([]), logger=mine)
    assert [r.name for r in caplog.records] == ["vlkv.test-caller"]


def test_unsealed_entries_are_not_trusted(tmp_path, caplog):
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "model.onnx").write_bytes(b"written by an exporter that kept no checksums")
    calls: list = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 1 and verify(tmp_path / "k1") is None
    assert caplog.messages[0].startswith(f"export cache entry {tmp_path / 'k1'} has no {CHECKSUMS}")


def test_an_entry_sealed_without_the_wanted_file_is_rebuilt(tmp_path):
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "other.onnx").write_bytes(b"x")
    seal(tmp_path / "k1")
    (tmp_path / "k1" / "model.onnx").write_bytes(b"slipped in later, never sealed")
    assert "not in its checksums.json" in verify(tmp_path / "k1", "model.onnx")
    calls: list = []
    cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 1 and verify(tmp_path / "k1", "model.onnx") is None


def test_a_concurrent_publisher_wins_when_its_entry_verifies(tmp_path):
    calls: list = []

    def build_while_another_publishes(folder: Path) -> None:
        _builder(calls)(folder)
        cached_export(tmp_path, "k1", "model.onnx", _builder(calls))  # finishes first

    path = cached_export(tmp_path, "k1", "model.onnx", build_while_another_publishes)
    assert len(calls) == 2 and verify(path.parent) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]


_HOLDER = """
import sys, time
from pathlib import Path
from vlkv.runtime.onnx.export_cache import temp_dir
with temp_dir(Path(sys.argv[1])) as tmp:
    (tmp / "half.onnx").write_bytes(b"x" * 10)
    print(tmp, flush=True)
    time.sleep(60)
"""


def holder(root: Path) -> tuple[subprocess.Popen, Path]:
    """A live process writing into a locked temporary folder of ``root``; returns it and the folder."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )
    return proc, Path(proc.stdout.readline().strip())


def test_temps_of_killed_builders_are_removed_and_live_ones_kept(tmp_path):
    killed, killed_tmp = holder(tmp_path)
    live, live_tmp = holder(tmp_path)
    try:
        os.kill(killed.pid, signal.SIGKILL)  # mid-build: no finally block runs
        killed.wait(timeout=30)
        assert killed_tmp.is_dir()
        assert clean_stale_temps(tmp_path) == [killed_tmp]
        assert not killed_tmp.exists() and not Path(f"{killed_tmp}.lock").exists()
        assert live_tmp.is_dir() and clean_stale_temps(tmp_path) == []
    finally:
        live.kill()
        live.wait(timeout=30)


def test_the_next_read_removes_a_killed_export_and_builds(tmp_path, caplog):
    killed, killed_tmp = holder(tmp_path)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    calls: list = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        path = cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 1 and verify(path.parent) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]
    assert caplog.messages == [f"removed the stale export folder {killed_tmp} (its writer is gone)"]


def test_unlocked_temps_count_as_stale_only_when_old(tmp_path):
    old, fresh = tmp_path / ".export-old", tmp_path / ".export-fresh"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "decoder.onnx").write_bytes(b"partial")
    past = time.time() - export_cache.UNLOCKED_STALE_AFTER_S - 60
    for path in (old, old / "decoder.onnx"):
        os.utime(path, (past, past))
    assert clean_stale_temps(tmp_path) == [old] and fresh.is_dir()


def test_a_lock_file_that_names_no_holder_yet_is_not_taken_for_a_dead_one(tmp_path):
    """A builder between creating its lock file and taking the lock must not lose its folder."""
    folder = tmp_path / ".export-starting"
    folder.mkdir()
    Path(f"{folder}.lock").touch()
    assert clean_stale_temps(tmp_path) == [] and folder.is_dir()
    Path(f"{folder}.lock").write_text("12345\n")  # named a holder, which no longer holds the lock
    assert clean_stale_temps(tmp_path) == [folder] and not folder.exists()


def test_a_builder_that_fails_leaves_nothing(tmp_path):
    def broken(folder: Path) -> None:
        (folder / "model.onnx").write_bytes(b"half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        cached_export(tmp_path, "k1", "model.onnx", broken)
    assert list(tmp_path.iterdir()) == []
    with temp_dir(tmp_path) as tmp:
        seal(tmp)
    assert list(tmp_path.iterdir()) == []
