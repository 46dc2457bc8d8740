"""The ONNX export cache (``$VLKV_ONNX_CACHE``, default ``~/.cache/vlkv/onnx``): checksummed entries.

An entry is a folder ``<root>/<key>`` holding an export (``decoder.onnx`` and its external data) and
``checksums.json``: the size and sha256 of every other file in it, written before the entry is
published. A read verifies them; a missing, truncated or modified file is reported in one line that
names the cache file, and the entry is discarded and rebuilt. Entries are built in a temporary
``<root>/.export-*`` folder and renamed into place, so a reader never sees half an export.

A temporary folder is held by an ``fcntl.flock`` on its sibling ``.export-*.lock`` file for as long as
its builder lives; the kernel drops the lock when the process dies, even by SIGKILL, so
:func:`clean_stale_temps` removes exactly the folders no live process is writing. Folders without a
lock file (written by an exporter that does not take one) count as stale once untouched for
:data:`UNLOCKED_STALE_AFTER_S`.

Hashing reads every byte (a 7B float16 decoder is ~14 GB, tens of seconds); that is the price of never
running a corrupted graph.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "VLKV_ONNX_CACHE"
CHECKSUMS = "checksums.json"
TEMP_PREFIX = ".export-"
LOCK_SUFFIX = ".lock"
UNLOCKED_STALE_AFTER_S = 6 * 3600
_CHUNK = 1 << 20

log = logging.getLogger("vlkv.exporter")


def cache_root() -> Path:
    """``$VLKV_ONNX_CACHE`` or ``~/.cache/vlkv/onnx``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vlkv" / "onnx")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _payload(entry: Path) -> list[Path]:
    return sorted(p for p in entry.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def seal(entry: Path) -> dict[str, dict]:
    """Write ``entry/checksums.json`` (``{relative path: {"size", "sha256"}}``) for every file; returns it."""
    sums = {
        str(p.relative_to(entry)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in _payload(entry)
    }
    tmp = entry / f".{CHECKSUMS}.tmp"
    tmp.write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n")
    tmp.replace(entry / CHECKSUMS)
    return sums


def is_sealed(entry: Path) -> bool:
    return (entry / CHECKSUMS).is_file()


def verify(entry: Path) -> str | None:
    """None when every file matches ``checksums.json``, else one line naming the first bad cache file."""
    try:
        sums = json.loads((entry / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"export cache entry {entry} has no {CHECKSUMS}"
    except (OSError, ValueError) as exc:
        return f"export cache file {entry / CHECKSUMS} is unreadable ({type(exc).__name__})"
    for name, want in sorted(sums.items()):
        path = entry / name
        if not path.is_file():
            return f"export cache file {path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return (
                f"export cache file {path} is {size} bytes, expected {want['size']} (truncated or replaced)"
            )
        if file_sha256(path) != want["sha256"]:
            return f"export cache file {path} fails its sha256 check (modified)"
    extra = sorted(
        str(p.relative_to(entry)) for p in _payload(entry) if str(p.relative_to(entry)) not in sums
    )
    if extra:
        return f"export cache entry {entry} holds unexpected file(s) {extra}"
    return None


def discard(entry: Path) -> None:
    """Remove an entry; it is first renamed aside so that no reader ever sees it half deleted."""
    if not entry.exists():
        return
    aside = entry.with_name(f"{TEMP_PREFIX}discard-{entry.name}-{os.getpid()}")
    try:
        entry.rename(aside)
    except OSError:
        aside = entry
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def temp_dir(root: Path) -> Iterator[Path]:
    """A fresh ``root/.export-*`` folder, locked for this process until the block exits, then removed."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))
    lock_path = tmp.with_name(tmp.name + LOCK_SUFFIX)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock_path.unlink(missing_ok=True)
        os.close(fd)


def _held(lock_path: Path) -> bool:
    """Whether a live process holds the flock on ``lock_path``."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if we took it
    return False


def clean_stale_temps(root: Path, now: float | None = None) -> list[Path]:
    """Remove ``root/.export-*`` folders (and lock files) no live process holds; returns those removed."""
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for path in sorted(root.glob(TEMP_PREFIX + "*")):
        if path.name.endswith(LOCK_SUFFIX):
            if not path.with_name(path.name[: -len(LOCK_SUFFIX)]).exists() and not _held(path):
                path.unlink(missing_ok=True)  # a lock file whose folder is already gone
            continue
        if not path.is_dir():
            continue
        lock_path = path.with_name(path.name + LOCK_SUFFIX)
        if lock_path.exists():
            stale = not _held(lock_path)
        else:
            newest = max((p.stat().st_mtime for p in path.rglob("*")), default=path.stat().st_mtime)
            stale = now - max(newest, path.stat().st_mtime) > UNLOCKED_STALE_AFTER_S
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def cached_export(root: Path, key: str, filename: str, build: Callable[[Path], None]) -> Path:
    """``root/key/filename``, built by ``build(folder)`` when the entry is absent or fails verification.

    A bad or unsealed entry is logged (one line naming the cache file) and rebuilt; a concurrent builder
    that publishes the same key first wins, and its entry is verified like any other.
    """
    entry = root / key
    for path in clean_stale_temps(root):
        log.warning(f"removed the stale export folder {path} (its writer is gone)")
    if (entry / filename).is_file():
        problem = verify(entry)
        if problem is None:
            return entry / filename
        log.warning(f"{problem}; rebuilding {entry}")
        discard(entry)
    with temp_dir(root) as tmp:
        build(tmp)
        if not (tmp / filename).is_file():
            raise RuntimeError(f"the export into {tmp} wrote no {filename}")
        seal(tmp)
        try:
            tmp.rename(entry)
        except OSError:  # another process published first
            problem = verify(entry)
            if problem is not None:
                raise RuntimeError(problem) from None
    return entry / filename


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


def stage_export(
    run_export: Callable[[], object], out_dir: Path, filename: str, root: Path | None = None
) -> dict:
    """Run a stage exporter that copies a cache entry into ``out_dir``, with that entry verified.

    The exporter (``decoder_onnx.export``) builds or reuses an entry and copies it into ``out_dir``; it
    does not verify the entry, so this does. A sealed entry that fails :func:`verify`, or an unsealed
    one the exporter could not load, is discarded and the export runs once more (said in one log
    line naming the cache file). An unsealed entry the exporter validated is sealed on first use.
    Failures name the cache entry. Returns ``{"entry": name, "rebuilt": reason or None}``.
    """
    from vlkv.exporter.errors import StageError

    root = cache_root() if root is None else root
    for path in clean_stale_temps(root):
        log.warning(f"removed the stale export folder {path} (its writer is gone)")
    failure: Exception | None = None
    try:
        run_export()
    except Exception as exc:  # noqa: BLE001 - judged below against the cache entry
        failure = exc
    entry = source_entry(out_dir / filename, root)
    if entry is None:
        if failure is not None:
            raise failure
        return {"entry": None, "rebuilt": None}
    if is_sealed(entry):
        problem = verify(entry)
    elif failure is None:
        seal(entry)
        problem = None
    elif isinstance(failure, StageError):
        raise StageError(f"{failure} (export cache entry {entry})") from None
    else:
        problem = f"export cache entry {entry} cannot be loaded ({_one_line(failure)})"
    if problem is None:
        if failure is not None:
            raise StageError(f"{_one_line(failure)} (export cache entry {entry}, checksums intact)") from None
        return {"entry": entry.name, "rebuilt": None}
    log.warning(f"{problem}; rebuilding {entry}")
    discard(entry)
    for path in out_dir.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        run_export()
    except Exception as exc:  # noqa: BLE001 - one line naming what was rebuilt
        raise StageError(
            f"{_one_line(exc)} (after rebuilding export cache entry {entry}: {problem})"
        ) from None
    rebuilt = source_entry(out_dir / filename, root)
    if rebuilt is not None and not is_sealed(rebuilt):
        seal(rebuilt)
    return {"entry": rebuilt.name if rebuilt else None, "rebuilt": problem}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    from vlkv.exporter.errors import StageError

    return first if isinstance(exc, StageError) else f"{type(exc).__name__}: {first}"
