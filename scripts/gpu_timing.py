"""Timing helpers the GPU check's parts share: a synchronised median wall time, and a part's sink type."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench_common import sync  # scripts/ is on sys.path: the GPU check's scripts put it there

Sink = Callable[[dict], None]


def timed_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
