"""A built model's cache directory and its manifest: every file's size and sha256, written last.

A directory is a complete cache only when its ``manifest.json`` names the expected format and every file
it lists has its recorded size and checksum (:func:`problem`); :func:`write` records them after the files
are saved, so a build cut off half way leaves no manifest and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def problem(path: Path, fmt: int) -> str | None:
    """Why ``path`` is not a complete cache of format ``fmt`` (a short phrase), or None when every
    checksum matches."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest" if path.exists() else "not built yet"
    except (OSError, ValueError) as err:
        return f"unreadable manifest: {err}"
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        return f"manifest format is not {fmt}"
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return "manifest lists no model.safetensors"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry.get("size"):
            return f"{name} has the wrong size"
        if sha256(file) != entry.get("sha256"):
            return f"{name} has the wrong checksum"
    return None


def write(path: Path, fmt: int, versions: dict[str, str | None]) -> None:
    """Record every file under ``path`` (size, sha256), format ``fmt`` and the installed ``versions``
    in ``path / MANIFEST``: the last file a build writes."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    entries = {str(p.relative_to(path)): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    manifest = {"format": fmt, "files": entries, "versions": versions}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
