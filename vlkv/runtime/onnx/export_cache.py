"""The ONNX export cache (``$VLKV_ONNX_CACHE``, default ``~/.cache/vlkv/onnx``): checksummed, atomically
published entries, shared by the ONNX Runtime backend's layer graphs and the exporter's decoder graph.

An entry is a folder ``<root>/<key[:24]>`` (:func:`export_key`: graph format, model, versions, the
graph's code) holding an export and ``checksums.json``: the size and sha256 of every other file in it,
written before the entry is published. Every read verifies them (:func:`cached_export`); a missing,
truncated or modified file, or an entry without checksums, is reported in one log line that names the
cache file, and the entry is discarded and rebuilt, so a damaged file is never run.

Entries are built in a temporary ``<root>/.export-*`` folder and renamed into place, so a reader never
sees half an export. The folder is held by an ``fcntl.flock`` on its sibling ``.export-*.lock`` file
(which names the holder's pid) for as long as its builder lives; the kernel drops the lock when the
process dies, even by SIGKILL, so :func:`clean_stale_temps` removes exactly the folders no live process
is writing. Folders without a lock that names a holder count as stale once untouched for
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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CACHE_ENV = "VLKV_ONNX_CACHE"
CHECKSUMS = "checksums.json"
TEMP_PREFIX = ".export-"
LOCK_SUFFIX = ".lock"
UNLOCKED_STALE_AFTER_S = 6 * 3600
# Hex characters of the key that name an entry (96 bits).
KEY_CHARS = 24
# Elements of each weight tensor that enter the key (plus the tensor's sum): hashing all of a 7B
# model's bytes would cost seconds on every start; distinct weights differ in a strided sample.
_KEY_SAMPLE = 4096
_CHUNK = 1 << 20

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$VLKV_ONNX_CACHE`` or ``~/.cache/vlkv/onnx``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vlkv" / "onnx")


class CacheRootError(ValueError):
    """An export cache root that is a file or cannot be written (one line naming it and the variable)."""


def usable_root(root: Path) -> Path:
    """``root``, created if missing; :class:`CacheRootError` when it is a file or not writable."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CacheRootError(
            f"ONNX export cache {root} is not a directory (a file is in the way): set {CACHE_ENV} to a directory"
        ) from None
    except OSError as err:
        raise CacheRootError(
            f"cannot create the ONNX export cache {root} ({err.strerror or err}): set {CACHE_ENV} to a writable directory"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CacheRootError(
            f"ONNX export cache {root} is not writable: set {CACHE_ENV} to a writable directory"
        )
    return root


def export_key(head: dict, modules: Iterable[torch.nn.Module], code: Iterable[str | Path]) -> str:
    """Hex sha256 naming an export: ``head`` (format, family, opset, config...), the package versions,
    the source of the ``code`` files that define the graph (a changed graph must never be served from
    an old entry) and a strided sample plus the sum of every weight of ``modules``."""
    import onnx
    import transformers

    h = hashlib.sha256()
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
    }
    sources = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in code]
    h.update(json.dumps({**head, **versions, "code": sources}, sort_keys=True, default=str).encode())
    for module in modules:
        for name, t in module.state_dict().items():
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _KEY_SAMPLE)][:_KEY_SAMPLE].float().cpu().numpy()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{float(flat.sum(dtype=torch.float64))!r}".encode())
            h.update(sample.tobytes())
    return h.hexdigest()


def cached_export(
    root: str | Path | None,
    key: str,
    filename: str,
    build: Callable[[Path], None],
    logger: logging.Logger | None = None,
) -> Path:
    """``<root>/<key[:24]>/<filename>``, built by ``build(folder)`` when the entry is absent or fails
    :func:`verify` (``root`` None: :func:`cache_root`).

    A bad or unsealed entry is reported on ``logger`` (default: this module's) in one line naming the
    cache file, discarded and rebuilt; so are stale temporary folders, which are removed first. A
    concurrent builder that publishes the same key first wins, and its entry is verified like any other.
    """
    root = usable_root(cache_root() if root is None else Path(root))
    logger = log if logger is None else logger
    entry = root / key[:KEY_CHARS]
    for path in clean_stale_temps(root):
        logger.warning(f"removed the stale export folder {path} (its writer is gone)")
    if entry.exists():
        problem = verify(entry, filename)
        if problem is None:
            return entry / filename
        logger.warning(f"{problem}; rebuilding {entry}")
        discard(entry)
    with temp_dir(root) as tmp:
        build(tmp)
        if not (tmp / filename).is_file():
            raise RuntimeError(f"the export into {tmp} wrote no {filename}")
        seal(tmp)
        if not _publish(tmp, entry):  # another process published first: trust it only once verified
            problem = verify(entry, filename)
            if problem is not None:
                logger.warning(f"{problem}; replacing {entry}")
                discard(entry)
                if not _publish(tmp, entry):
                    raise RuntimeError(f"cannot publish the export cache entry {entry}: {problem}")
    return entry / filename


def _publish(tmp: Path, entry: Path) -> bool:
    """Rename ``tmp`` to ``entry``; False when a non-empty ``entry`` is already there."""
    try:
        tmp.rename(entry)
    except OSError:
        if not entry.exists():
            raise
        return False
    return True


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


def verify(entry: Path, filename: str | None = None) -> str | None:
    """None when every file matches ``checksums.json`` (and ``filename`` is among them), else one line
    naming the first bad cache file."""
    try:
        sums = json.loads((entry / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"export cache entry {entry} has no {CHECKSUMS}"
    except (OSError, ValueError) as exc:
        return f"export cache file {entry / CHECKSUMS} is unreadable ({type(exc).__name__})"
    if not isinstance(sums, dict):
        return f"export cache file {entry / CHECKSUMS} is unreadable (not a mapping)"
    if filename is not None and filename not in sums:
        return f"export cache file {entry / filename} is not in its {CHECKSUMS}"
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
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


@contextmanager
def temp_dir(root: Path) -> Iterator[Path]:
    """A fresh ``root/.export-*`` folder, locked for this process until the block exits, then removed."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))
    lock_path = tmp.with_name(tmp.name + LOCK_SUFFIX)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Written only once the lock is held: an unheld lock file that names a pid is a dead holder's.
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


def _untouched_for(path: Path, now: float) -> float:
    """Seconds since anything in the folder ``path`` (or the folder itself) was last modified."""
    newest = max((p.stat().st_mtime for p in path.rglob("*")), default=0.0)
    return now - max(newest, path.stat().st_mtime)


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
        try:
            if lock_path.exists() and _held(lock_path):
                continue
            if lock_path.exists() and lock_path.stat().st_size > 0:
                stale = True  # its holder took the lock, wrote its pid, and is gone
            else:  # no holder ever named: an exporter without locks, or one between open and flock
                stale = _untouched_for(path, now) > UNLOCKED_STALE_AFTER_S
        except FileNotFoundError:  # its builder finished (or another cleaner removed it) meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            removed.append(path)
    return removed
