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

from vlkv.exporter import export_cache
from vlkv.exporter.export_cache import (
    CHECKSUMS,
    cached_export,
    clean_stale_temps,
    seal,
    temp_dir,
    verify,
)

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    "damage,problem",
    [
        (
            lambda p: p.write_bytes(p.read_bytes()[:100]),
            "is 100 bytes, expected 2048 (truncated or replaced)",
        ),
        (
            lambda p: p.write_bytes(bytes(reversed(p.read_bytes()))),
            "fails its sha256 check (modified)",
        ),  # same size
        (lambda p: p.unlink(), "is missing"),
    ],
)
def test_damaged_entries_are_named_and_rebuilt(tmp_path, caplog, damage, problem):
    calls: list = []
    cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    data = tmp_path / "k1" / "model.onnx.data"
    damage(data)
    assert verify(tmp_path / "k1") == f"export cache file {data} {problem}"
    with caplog.at_level(logging.WARNING, logger="vlkv.exporter"):
        cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 2 and verify(tmp_path / "k1") is None
    assert caplog.messages == [f"export cache file {data} {problem}; rebuilding {tmp_path / 'k1'}"]


def test_unsealed_entries_are_not_trusted(tmp_path, caplog):
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "model.onnx").write_bytes(b"written by an exporter that kept no checksums")
    calls: list = []
    with caplog.at_level(logging.WARNING, logger="vlkv.exporter"):
        cached_export(tmp_path, "k1", "model.onnx", _builder(calls))
    assert len(calls) == 1 and verify(tmp_path / "k1") is None
    assert caplog.messages[0].startswith(f"export cache entry {tmp_path / 'k1'} has no {CHECKSUMS}")


_HOLDER = """
import sys, time
from pathlib import Path
from vlkv.exporter.export_cache import temp_dir
with temp_dir(Path(sys.argv[1])) as tmp:
    (tmp / "half.onnx").write_bytes(b"x" * 10)
    print(tmp, flush=True)
    time.sleep(60)
"""


def _holder(root: Path) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )
    return proc, Path(proc.stdout.readline().strip())


def test_temps_of_killed_builders_are_removed_and_live_ones_kept(tmp_path):
    killed, killed_tmp = _holder(tmp_path)
    live, live_tmp = _holder(tmp_path)
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


def test_unlocked_temps_count_as_stale_only_when_old(tmp_path):
    old, fresh = tmp_path / ".export-old", tmp_path / ".export-fresh"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "decoder.onnx").write_bytes(b"partial")
    past = time.time() - export_cache.UNLOCKED_STALE_AFTER_S - 60
    for path in (old, old / "decoder.onnx"):
        os.utime(path, (past, past))
    assert clean_stale_temps(tmp_path) == [old] and fresh.is_dir()


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


# ------------------------------------------------------------------ the decoder_onnx stage, end to end
def _build_decoder(out: Path, capsys) -> tuple[int, str]:
    from vlkv.exporter.cli import main

    code = main(["recipes/demo.yaml", "--stage", "decoder_onnx", "--out", str(out), "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncate", "same-size tamper", "truncate, no checksums"])
def test_decoder_stage_rebuilds_a_damaged_cache_entry(tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("VLKV_ONNX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    code, _ = _build_decoder(tmp_path / "a", capsys)
    assert code == 0
    (entry,) = (tmp_path / "cache").iterdir()
    assert verify(entry) is None  # sealed on first use, after the stage validated it
    graph = entry / "decoder.onnx"
    data = graph.read_bytes()
    if damage.startswith("truncate"):
        graph.write_bytes(data[: len(data) // 2])
        if damage.endswith("no checksums"):  # an entry written before the cache kept checksums
            (entry / CHECKSUMS).unlink()
    else:  # same size, different weights: flip bytes in the middle of the file
        middle = len(data) // 2
        graph.write_bytes(
            data[:middle] + bytes(b ^ 0x55 for b in data[middle : middle + 64]) + data[middle + 64 :]
        )
    code, err = _build_decoder(tmp_path / "b", capsys)
    assert code == 0, err
    named = (
        f"export cache entry {entry} cannot be loaded"
        if "no checksums" in damage
        else f"export cache file {graph}"
    )
    assert named in err and f"; rebuilding {entry}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert graph.read_bytes() == data and verify(entry) is None


def test_build_engine_removes_folders_of_killed_exports_at_start(tmp_path, monkeypatch, capsys):
    from vlkv.exporter.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("VLKV_ONNX_CACHE", str(cache))
    killed, killed_tmp = _holder(cache)
    live, live_tmp = _holder(cache)
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        code = main([str(ROOT / "recipes" / "demo.yaml"), "--stage", "trtllm_checkpoint", "--out", str(tmp_path / "o"),
                     "--no-progress"])  # fmt: skip
        assert code == 0
        assert not killed_tmp.exists() and live_tmp.is_dir()
        err = capsys.readouterr().err.strip()
        assert err == f"build-engine: removed the stale export folder {killed_tmp} (its writer is gone)"
    finally:
        live.kill()
        live.wait(timeout=30)
