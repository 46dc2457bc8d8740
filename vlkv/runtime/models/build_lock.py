"""A lock file beside a model cache that is built on first use: processes that find the cache missing
at once build it once; the others wait for the holder, saying so and naming it, then load its build."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def build_lock(target: Path, label: str):
    """Hold ``<target>.lock`` exclusively (``flock``: released when the holder exits, even killed). A
    waiter logs one warning naming the holder's PID (the file's content) rather than hanging silently.
    ``label`` names the model in that warning."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f"{target.name}.lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            logger.warning("%s: waiting for process %s to finish building %s", label, holder, target)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
