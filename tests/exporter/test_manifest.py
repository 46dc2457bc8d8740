from __future__ import annotations

import hashlib
import json

from vlkv.exporter.manifest import (
    MANIFEST,
    Manifest,
    files_digest,
    output_files,
    package_versions,
    read_manifest,
    stale_reason,
)


def _stage_dir(tmp_path):
    out = tmp_path / "stage"
    (out / "sub").mkdir(parents=True)
    (out / "a.bin").write_bytes(b"alpha")
    (out / "sub" / "b.txt").write_text("beta")
    files = output_files(out)
    Manifest("s", "h" * 64, package_versions(), {"up": "d"}, files, {"max_abs_err": 1e-7}).write(out)
    return out, files


def test_output_files_hashes_every_file_but_the_manifest(tmp_path):
    out, files = _stage_dir(tmp_path)
    assert files == {
        "a.bin": hashlib.sha256(b"alpha").hexdigest(),
        "sub/b.txt": hashlib.sha256(b"beta").hexdigest(),
    }
    assert MANIFEST not in output_files(out)


def test_manifest_round_trip_and_contents(tmp_path):
    out, files = _stage_dir(tmp_path)
    data = json.loads((out / MANIFEST).read_text())
    assert data["stage"] == "s" and data["files"] == files and data["metrics"] == {"max_abs_err": 1e-7}
    assert set(data["versions"]) == {"torch", "transformers", "onnx", "vlkv"}
    assert all(data["versions"].values())
    assert read_manifest(out) == Manifest(**data)
    assert not (out / "manifest.json.tmp").exists()


def test_stale_reasons(tmp_path):
    out, files = _stage_dir(tmp_path)
    versions = package_versions()
    assert stale_reason(out, "s", "h" * 64, {"up": "d"}, versions) is None
    assert stale_reason(out, "t", "h" * 64, {"up": "d"}, versions) == "manifest is for stage 's'"
    assert stale_reason(out, "s", "x" * 64, {"up": "d"}, versions) == "config changed"
    assert stale_reason(out, "s", "h" * 64, {"up": "e"}, versions) == "upstream outputs changed"
    assert stale_reason(out, "s", "h" * 64, {"up": "d"}, versions | {"torch": "0"}) == "tool versions changed"
    (out / "sub" / "b.txt").write_text("gamma")
    assert stale_reason(out, "s", "h" * 64, {"up": "d"}, versions) == "sub/b.txt changed on disk"
    (out / "a.bin").unlink()
    assert stale_reason(out, "s", "h" * 64, {"up": "d"}, versions) == "a.bin is missing"
    (out / MANIFEST).write_text("{broken")
    assert stale_reason(out, "s", "h" * 64, {"up": "d"}, versions) == "no manifest"


def test_files_digest_is_order_independent():
    assert files_digest({"a": "1", "b": "2"}) == files_digest({"b": "2", "a": "1"})
    assert files_digest({"a": "1"}) != files_digest({"a": "2"})
