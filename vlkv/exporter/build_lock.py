"""One build per output folder: an ``fcntl.flock`` on ``<out>/.build-engine.lock``.

Two ``build-engine`` runs on one ``--out`` would empty each other's stage folders. The first run holds
the lock for its whole life and writes who it is into the file; a second run fails at once with
:class:`~vlkv.exporter.errors.BuildLocked`, one line naming the holder, before it writes or deletes
anything. The kernel drops the lock when the holder exits or is killed, so a crashed build never
blocks the next one. The lock is re-entrant within a process (the CLI and ``run_stages`` both take it).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vlkv.exporter.errors import BuildLocked

LOCK_FILE = ".build-engine.lock"

# resolved output folder -> [file descriptor, depth] for the locks this process holds
_held: dict[str, list[int]] = {}


@contextmanager
def build_lock(out_dir: str | Path) -> Iterator[Path]:
    """Hold the build lock of ``out_dir`` (created if missing) for the block; yields the lock file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    key = str(out.resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield path
        finally:
            _held[key][1] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder unknown"
        os.close(fd)
        raise BuildLocked(
            f"{out} is being built by another build-engine ({holder}); wait for it or use another --out"
        ) from None
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200]
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {command}\n".encode(), 0)
    _held[key] = [fd, 1]
    try:
        yield path
    finally:
        del _held[key]
        os.ftruncate(fd, 0)
        os.close(fd)
