"""``manifest.json``: what a stage built, from which config, with which tool versions.

A stage writes its manifest *last* (atomically), so a directory with a manifest is complete. A stage
is up to date when its manifest names the same stage, config hash, tool versions and upstream inputs,
and every file it lists is still on disk with the recorded sha256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
_VERSIONED = ("torch", "transformers", "onnx")


def package_versions() -> dict[str, str | None]:
    """Versions of the tools whose output format could change an artifact (None: not installed)."""
    import vlkv

    versions: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["vlkv"] = vlkv.__version__
    return versions


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def output_files(out_dir: str | Path) -> dict[str, str]:
    """sha256 of every file under ``out_dir`` except the manifest, keyed by POSIX relative path."""
    root = Path(out_dir)
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in files}


def files_digest(files: dict[str, str]) -> str:
    """One digest over a manifest's file table; downstream stages record it as their input."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


@dataclass
class Manifest:
    """Contents of ``manifest.json``.

    ``inputs`` maps an upstream stage name to :func:`files_digest` of its manifest, so a rebuilt
    upstream with different outputs invalidates this stage. ``metrics`` holds validation numbers
    (e.g. ``max_abs_err``) that the stage reported.
    """

    stage: str
    config_hash: str
    versions: dict[str, str | None]
    inputs: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def write(self, out_dir: str | Path) -> Path:
        """Write atomically (temp file + rename) so that a crash never leaves a half manifest."""
        path = Path(out_dir) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path


def read_manifest(out_dir: str | Path) -> Manifest | None:
    """The manifest in ``out_dir``, or None when it is missing or unreadable."""
    path = Path(out_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
        return Manifest(**data)
    except (OSError, json.JSONDecodeError, TypeError):
        return None


def stale_reason(
    out_dir: str | Path, stage: str, config_hash: str, inputs: dict[str, str], versions: dict[str, str | None]
) -> str | None:
    """Why the stage must run again, or None when its manifest still matches what is on disk."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        return "no manifest"
    if manifest.stage != stage:
        return f"manifest is for stage {manifest.stage!r}"
    if manifest.config_hash != config_hash:
        return "config changed"
    if manifest.versions != versions:
        return "tool versions changed"
    if manifest.inputs != inputs:
        return "upstream outputs changed"
    root = Path(out_dir)
    for rel, digest in manifest.files.items():
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        if sha256_file(path) != digest:
            return f"{rel} changed on disk"
    return None
