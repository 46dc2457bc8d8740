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


def interleaved_ms(
    fns: dict[str, Callable[[], object]], device: str, repeats: int, warmup: int = 2, per_call: int = 1
) -> dict[str, float]:
    """Median milliseconds of each of ``fns``, timed in turn within every repeat (the order rotated each
    repeat, so a clock or thermal drift falls on all alike): CUDA events around each call on a GPU (no
    host sync between calls), wall time around it on a CPU. ``per_call``: calls one ``fn`` stands for (a
    CUDA graph replaying several): the times are divided by it."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        events = []
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end))
    else:
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) / per_call for name, t in times.items()}
