"""The lock a build of a vlkv C++ extension holds: an OS file lock that ends with its process.

torch's extension builder marks a build in progress with an empty ``lock`` file in the build directory,
and every other process that loads the same extension waits until that file is gone. A builder killed
mid-build (Ctrl-C during an engine's first start, a job stopped at its time limit) leaves the file
behind, and from then on every process that loads the extension waits forever. Every vlkv build
therefore runs while holding :func:`held`'s ``flock``, which the OS releases when the holder dies: a
``lock`` file found while holding it belongs to no live vlkv builder, so it is removed (one line says so).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock file only
    fcntl = None

__all__ = ["held"]

# torch.utils.cpp_extension's in-progress marker, in the extension's build directory
TORCH_LOCK = "lock"


@contextlib.contextmanager
def held(build_dir: Path | None) -> Iterator[None]:
    """Hold the exclusive build lock of ``build_dir`` (an extension's torch build directory; None: no
    lock) for the block, removing a ``lock`` file a dead builder left there first."""
    if build_dir is None or fcntl is None:
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.vlkv-build-lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                print(
                    f"vlkv: removing {stale}, left by a build that did not finish",
                    file=sys.stderr,
                    flush=True,
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
