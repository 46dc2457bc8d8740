"""The decoder_onnx stage over the ONNX export cache (``vlkv.runtime.onnx.export_cache``, tested in
``tests/runtime/onnx/test_export_cache.py``): damaged entries rebuilt, stale temps removed at start."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.runtime.onnx.test_export_cache import holder
from vlkv.exporter import export_cache
from vlkv.runtime.onnx import export_cache as runtime_cache
from vlkv.runtime.onnx.export_cache import CHECKSUMS, verify

ROOT = Path(__file__).resolve().parents[2]


def test_the_exporter_uses_the_runtime_cache():
    """One cache: the exporter's names are the runtime's functions, not a second implementation."""
    for name in ("cache_root", "cached_export", "clean_stale_temps", "verify", "seal", "temp_dir"):
        assert getattr(export_cache, name) is getattr(runtime_cache, name), name


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
    assert verify(entry) is None  # sealed before it was published
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
    # verified before use: an entry without checksums is not trusted, whatever it holds
    named = (
        f"export cache entry {entry} has no {CHECKSUMS}"
        if "no checksums" in damage
        else f"export cache file {graph}"
    )
    assert err.startswith(f"build-engine: {named}") and err.strip().endswith(f"; rebuilding {entry}")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert graph.read_bytes() == data and verify(entry) is None
    cache = json.loads((tmp_path / "b" / "decoder_onnx" / "metrics.json").read_text())["export_cache"]
    assert cache["entry"] == entry.name and cache["rebuilt"].startswith(named)


def test_build_engine_removes_folders_of_killed_exports_at_start(tmp_path, monkeypatch, capsys):
    from vlkv.exporter.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("VLKV_ONNX_CACHE", str(cache))
    killed, killed_tmp = holder(cache)
    live, live_tmp = holder(cache)
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
