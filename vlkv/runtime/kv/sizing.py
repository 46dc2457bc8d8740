"""How large a fixed KV pool a long-running server takes: a fraction of the memory left free once the
model is loaded (vLLM's ``gpu_memory_utilization``, applied to what is free rather than the total).

A fixed pool never moves what it holds (a growable one compacts as it grows), and admission and
preemption have a real budget to work against. One-shot scripts keep growable pools: they size
themselves to the batch they run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from vlkv.runtime.kv.pool import PoolSpec

DEFAULT_KV_FRACTION = 0.5


def check_fraction(fraction: float, name: str = "--kv-memory-fraction") -> float:
    """``fraction`` if it is in (0, 1], else a one-line ``ValueError`` naming ``name`` (NaN too)."""
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise ValueError(f"{name} must be in (0, 1] (a share of the free memory), got {fraction}")
    return float(fraction)


def free_memory_bytes(device: torch.device | str) -> int:
    """Bytes free on ``device`` now: CUDA's free memory, or on CPU the memory the OS can hand out
    without swapping (``MemAvailable`` of ``/proc/meminfo``; free pages where that file is absent)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class PoolSize:
    """A fixed pool's size and how it was chosen.

    Attributes:
        nbytes: K/V bytes of the pool (what ``--pool-bytes`` gives; the pool's slot bookkeeping comes
            on top, a few bytes per slot and KV head).
        free: bytes free on the device when it was sized.
        fraction: share of ``free`` asked for, in (0, 1].
        cap: bytes of every running request at the model's position limit (None: no limit known);
            a larger pool is never used.
    """

    nbytes: int
    free: int
    fraction: float
    cap: int | None

    def describe(self) -> str:
        """One line for the server's banner."""
        mib = 2**20
        capped = self.cap is not None and self.nbytes == self.cap
        how = f"{self.fraction:g} of {self.free / mib:.0f} MiB free"
        return f"fixed KV pool of {self.nbytes / mib:.1f} MiB ({how}{', capped at what it can use' if capped else ''})"


def pool_size(
    spec: PoolSpec, fraction: float, free: int, max_running: int, position_limit: int | None
) -> PoolSize:
    """The fixed pool for ``fraction`` of ``free`` bytes, capped at ``max_running`` requests of
    ``position_limit`` tokens each; a one-line ``ValueError`` when it would not hold one token."""
    check_fraction(fraction)
    token = spec.entry_bytes * spec.num_layers
    nbytes = int(fraction * free)
    cap = None if position_limit is None else max_running * position_limit * token
    if cap is not None:
        nbytes = min(nbytes, cap)
    nbytes -= nbytes % token  # whole tokens
    if nbytes < token:
        raise ValueError(
            f"--kv-memory-fraction {fraction:g} of the {free} bytes free leaves no room for one token "
            f"({token} bytes): raise it, free memory, or give --pool-bytes"
        )
    return PoolSize(nbytes, free, fraction, cap)
