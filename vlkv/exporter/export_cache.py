"""The ``decoder_onnx`` stage's view of the ONNX export cache, which lives in the runtime.

The cache itself (checksummed entries verified on every read and rebuilt when damaged, atomic
publication, locked temporary folders, stale-folder cleanup) is :mod:`vlkv.runtime.onnx.export_cache`,
shared with the ONNX Runtime backend; its names are re-exported here. This module adds what only a
build needs: :func:`stage_export`, which names the cache entry a stage's output came from, and the
``vlkv.exporter`` logger, whose lines ``build-engine`` prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from vlkv.runtime.onnx.export_cache import (  # noqa: F401 - the cache's API, for the exporter
    CACHE_ENV,
    CHECKSUMS,
    cache_root,
    cached_export,
    clean_stale_temps,
    seal,
    temp_dir,
    verify,
)

log = logging.getLogger("vlkv.exporter")


def source_entry(copy: Path, root: Path) -> Path | None:
    """The cache entry ``copy`` was copied from (``shutil.copy2`` keeps size and mtime), or None."""
    if not copy.is_file() or not root.is_dir():
        return None
    stat = copy.stat()
    for entry in sorted(root.iterdir()):
        original = entry / copy.name
        if entry.name.startswith(".") or not original.is_file():
            continue
        other = original.stat()
        if (other.st_size, other.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns):
            return entry
    return None


class _Rebuilds(logging.Handler):
    """Collects the reasons of the cache's ``...; rebuilding <entry>`` lines while a stage runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "; rebuilding " in message:
            self.reasons.append(message.rsplit("; rebuilding ", 1)[0])


def stage_export(
    run_export: Callable[[], object], out_dir: Path, filename: str, root: Path | None = None
) -> dict:
    """Run a stage exporter that copies a cache entry into ``out_dir``; returns ``{"entry": name or None,
    "rebuilt": why the entry was rebuilt, or None}``.

    The exporter (``decoder_onnx.export``) reads the entry through :func:`cached_export`, which verifies
    it and rebuilds it when damaged, so what it copies is intact. A failure after the copy (the graph
    differs from PyTorch) is re-raised as one line naming the entry it came from.
    """
    from vlkv.exporter.errors import StageError

    root = cache_root() if root is None else root
    for path in clean_stale_temps(root):
        log.warning(f"removed the stale export folder {path} (its writer is gone)")
    rebuilds = _Rebuilds()
    log.addHandler(rebuilds)
    try:
        run_export()
    except Exception as exc:
        entry = source_entry(out_dir / filename, root)
        if entry is None:
            raise
        raise StageError(f"{_one_line(exc)} (export cache entry {entry}, checksums intact)") from None
    finally:
        log.removeHandler(rebuilds)
    entry = source_entry(out_dir / filename, root)
    return {
        "entry": entry.name if entry else None,
        "rebuilt": rebuilds.reasons[-1] if rebuilds.reasons else None,
    }


def _one_line(exc: BaseException) -> str:
    from vlkv.exporter.errors import StageError

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return first if isinstance(exc, StageError) else f"{type(exc).__name__}: {first}"
