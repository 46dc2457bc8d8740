"""Storage tiers of the context store: device memory, host memory, disk — each an LRU with a byte budget.

A tier is a dumb keyed store; the :class:`~vlkv.runtime.store.store.ContextStore` above it verifies
what it reads, promotes hits and demotes the victims a tier names (:meth:`Tier.victims`) before it
writes. Host and disk tiers hold a record's bytes (:meth:`Record.to_bytes`), so every read is checked
against the record's checksum; the device tier holds decoded :class:`Record` s whose tensors live on
the device (verified when they entered it).

Disk layout: one file ``<key>.vkr`` per record in the store directory (keys are 64 hex digits, never
a path). A write goes to a temp file ``.<key>.<random>.tmp`` in the same directory, is fsynced, then
renamed over the final name and the directory fsynced: a reader sees the old file or the new one,
never half of one, and a crash leaves only a temp file that no read ever opens (:meth:`DiskTier.gc_temp`
removes it). LRU order on disk is the files' mtimes (touched on every read), so it survives restarts.

Reads trust nothing about the directory's contents: a record file is opened without following
symlinks (``O_NOFOLLOW``) and without blocking (a FIFO), must be a regular file, and is read only when
its size is the one its header states (a 5 GB file behind a 2 MB header is never read whole); its
mtime is touched through the open descriptor, never through a path. A file failing these checks
comes back as its header bytes only (or none), which the store rejects as corrupt and deletes —
deleting a symlink removes the link, never its target.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from vlkv.runtime.store.identity import validate_key
from vlkv.runtime.store.record import (
    PREFIX_SIZE,
    CorruptRecord,
    Record,
    StaleRecord,
    header_size,
    record_size,
)

SUFFIX = ".vkr"
TEMP_SUFFIX = ".tmp"


@runtime_checkable
class Tier(Protocol):
    """One level of the store. ``holds`` is ``"bytes"`` (host, disk) or ``"record"`` (device)."""

    name: str
    holds: str
    max_bytes: int

    def get(self, key: str, touch: bool = True) -> bytes | Record | None: ...  # touch: mark used
    def __contains__(self, key: str) -> bool: ...
    def put(self, key: str, value: bytes | Record) -> None: ...
    def delete(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...  # least recently used first
    def bytes_used(self) -> int: ...
    def victims(self, nbytes: int) -> list[str]: ...  # LRU keys to drop so nbytes more fit


def _size(value: bytes | Record) -> int:
    return value.nbytes if isinstance(value, Record) else len(value)


def _check_fits(name: str, nbytes: int, max_bytes: int) -> None:
    if nbytes > max_bytes:
        raise ValueError(f"a record of {nbytes} bytes exceeds the {name} tier's budget of {max_bytes} bytes")


def _check_budget(name: str, max_bytes: int) -> int:
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"{name} max_bytes must be an int >= 0, got {max_bytes!r}")
    return max_bytes


class _MemoryTier:
    """An in-process LRU (``OrderedDict``: oldest first) with a byte budget."""

    holds = "bytes"

    def __init__(self, name: str, max_bytes: int):
        self.name, self.max_bytes = name, _check_budget(name, max_bytes)
        self._items: OrderedDict[str, bytes | Record] = OrderedDict()
        self._used = 0

    def get(self, key: str, touch: bool = True):
        value = self._items.get(key)
        if value is not None and touch:
            self._items.move_to_end(key)
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, value) -> None:
        validate_key(key)
        _check_fits(self.name, _size(value), self.max_bytes)
        self.delete(key)
        for victim in self.victims(_size(value)):
            self.delete(victim)
        self._items[key] = value
        self._used += _size(value)

    def delete(self, key: str) -> bool:
        value = self._items.pop(key, None)
        if value is None:
            return False
        self._used -= _size(value)
        return True

    def keys(self) -> list[str]:
        return list(self._items)

    def bytes_used(self) -> int:
        return self._used

    def victims(self, nbytes: int) -> list[str]:
        out, used = [], self._used
        for key, value in self._items.items():
            if used + nbytes <= self.max_bytes:
                break
            out.append(key)
            used -= _size(value)
        return out


class HostTier(_MemoryTier):
    """Host memory: record bytes in an LRU, at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int):
        super().__init__("host", max_bytes)

    def put(self, key: str, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"host tier holds record bytes, got {type(value).__name__}")
        super().put(key, bytes(value))


class DeviceTier(_MemoryTier):
    """Device memory: decoded records whose tensors live on ``device``, at most ``max_bytes`` of tensors."""

    holds = "record"

    def __init__(self, max_bytes: int, device: torch.device | str):
        super().__init__("device", max_bytes)
        self.device = torch.device(device)

    def put(self, key: str, value: Record) -> None:
        if not isinstance(value, Record):
            raise TypeError(f"device tier holds Records, got {type(value).__name__}")
        super().put(key, value.to(self.device))


def check_store_dir(path: str | os.PathLike, create: bool = True, writable: bool = True) -> Path:
    """``path`` as a usable store directory, else a one-line ``ValueError`` naming it.

    A path that is a file, under a file, or (``writable``) not writable is refused; ``create=False``
    also refuses a missing directory (read-only commands never create a store).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"store path {str(p)!r} is not a directory")
    above = next((a for a in p.parents if a.exists()), None)
    if not p.exists() and above is not None and not above.is_dir():
        raise ValueError(f"store path {str(p)!r} is not a directory: {str(above)!r} is a file")
    if not p.exists():
        if not create:
            raise ValueError(f"store directory {str(p)!r} does not exist")
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create store directory {str(p)!r}: {exc.strerror or exc}") from None
    if not writable:
        return p
    probe = p / f".probe.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"store directory {str(p)!r} is not writable: {exc.strerror or exc}") from None
    return p


class DiskTier:
    """Record files in one directory: atomic writes, LRU by mtime, at most ``max_bytes`` of files.

    The in-memory index (key → size, LRU order) is rebuilt from the directory by :meth:`refresh`; a
    read of a key the index does not know (written by another process) still looks at the file.
    """

    name = "disk"
    holds = "bytes"

    def __init__(self, path: str | os.PathLike, max_bytes: int, create: bool = True, writable: bool = True):
        self.path = check_store_dir(path, create, writable)
        self.max_bytes = _check_budget("disk", max_bytes)
        self._index: OrderedDict[str, int] = OrderedDict()
        self.refresh()

    def file(self, key: str) -> Path:
        return self.path / f"{validate_key(key)}{SUFFIX}"

    def refresh(self) -> None:
        """Rebuild the index from the directory (oldest mtime first)."""
        found = []
        for entry in os.scandir(self.path):
            key = entry.name.removesuffix(SUFFIX)
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False) and _is_key(key):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, key, st.st_size))
        self._index = OrderedDict((key, size) for _, key, size in sorted(found))

    def get(self, key: str, touch: bool = True) -> bytes | None:
        try:
            fd = _open_record(self.file(key))
        except FileNotFoundError:
            self._index.pop(key, None)
            return None
        except OSError:  # a symlink (ELOOP) or something else no record is: rejected as corrupt
            return b""
        with os.fdopen(fd, "rb") as f:
            data = _read_record(f)
            if touch and os.utime in os.supports_fd:
                os.utime(f.fileno())  # LRU across processes: the file's mtime is its last use
        known = key in self._index
        self._index[key] = len(data)
        if touch or not known:
            self._index.move_to_end(key)
        return data

    def __contains__(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.file(key)).st_mode)
        except FileNotFoundError:
            return False

    def head(self, key: str) -> tuple[bytes, int] | None:
        """The first bytes of a record file up to the end of its header, and the file's size."""
        try:
            fd = _open_record(self.file(key))
        except FileNotFoundError:
            return None
        except OSError:
            return b"", 0
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return b"", 0
            return _read_head(f), size

    def put(self, key: str, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"disk tier holds record bytes, got {type(value).__name__}")
        final = self.file(key)
        _check_fits(self.name, len(value), self.max_bytes)
        tmp = self.path / f".{key}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.path)
        self._index.pop(key, None)
        for victim in self.victims(len(value)):
            self.delete(victim)
        self._index[key] = len(value)

    def delete(self, key: str) -> bool:
        self._index.pop(key, None)
        try:
            self.file(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def keys(self) -> list[str]:
        return list(self._index)

    def bytes_used(self) -> int:
        return sum(self._index.values())

    def victims(self, nbytes: int) -> list[str]:
        out, used = [], self.bytes_used()
        for key, size in self._index.items():
            if used + nbytes <= self.max_bytes:
                break
            out.append(key)
            used -= size
        return out

    def temp_files(self) -> list[Path]:
        return [p for p in self.path.iterdir() if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX)]

    def gc_temp(self, older_than_s: float = 600.0) -> int:
        """Remove temp files left by killed writers (older than ``older_than_s``, so live writes survive)."""
        now, removed = time.time(), 0
        for p in self.temp_files():
            try:
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


def _open_record(path: Path) -> int:
    """A read-only descriptor of ``path`` that never follows a symlink and never blocks (FIFOs)."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))


def _read_head(f) -> bytes:
    """A record file's prefix and header (at most 16 bytes + 1 MiB)."""
    prefix = f.read(PREFIX_SIZE)
    try:
        rest = header_size(prefix) - len(prefix)
    except ValueError:
        return prefix
    return prefix + f.read(rest)


def _read_record(f) -> bytes:
    """The file's bytes if it is a regular file of the size its header states; otherwise only its
    header (or nothing), which the store rejects: a huge or mislabelled file is never read whole."""
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        return b""
    head = _read_head(f)
    try:
        want = record_size(head)
    except (CorruptRecord, StaleRecord):
        return head
    if st.st_size != want:
        return head
    return head + f.read(want - len(head))


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
        return True
    except ValueError:
        return False


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
