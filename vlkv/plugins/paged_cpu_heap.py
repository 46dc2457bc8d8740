"""The C heap's policy for a CPU decode: keep freed memory for the next step instead of giving it back.

A statistics decode step (H2O every step, A-VL's text scores, SnapKV's window...) gets each layer's
attention probabilities from the fused read: ``(B, H_kv, G, C)`` float32, 1.2 MB per layer at 8k × 4
on smollm2-llava, all 30 alive until the policy has read them. glibc's malloc serves such blocks from
the top of its heap (its mmap threshold rises to the size of the first one freed) and, once the step
frees them, the free space at the top exceeds its trim threshold (twice the mmap threshold), so it
hands it back to the kernel: every page of the next step's probabilities is a fresh page fault (2,312
faults per 8 layers, measured). On the 2-core EPYC VM that made the fused read with probabilities
1.26x the plain read; with the freed memory kept, 1.10x and no faults (paired medians, one process:
``docs/benchmarks/2026-11-27-compressed-cpu-x86_64``).

:func:`keep_freed` fixes glibc's thresholds (``mallopt``): blocks below :data:`MMAP_MAX` (32 MiB, the
largest glibc allows; the K/V pools and weights are larger and still mapped on their own) come from
the heap, and up to :data:`TRIM` of free space at its top stays there. The process keeps the memory its
busiest step used (as a caching allocator does); nothing else changes, no value or aliasing. Called by
``paged_cpu.warm_up`` where a model decodes on the CPU; ``VLKV_CPU_HEAP=0`` leaves the heap alone.
Linux with glibc only (elsewhere a no-op returning False).
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["KEEP_FREED", "MMAP_MAX", "TRIM", "keep_freed", "set_heap"]

# on by default; ``VLKV_CPU_HEAP=0``: the C heap as glibc sets it
KEEP_FREED = os.environ.get("VLKV_CPU_HEAP", "1") != "0"
# glibc's mallopt parameters (malloc.h) and its defaults
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_DEFAULT = 128 * 1024
# blocks below this come from the heap (glibc refuses more than 32 MiB on 64-bit)
MMAP_MAX = 32 * 2**20
# free space at the heap's top kept rather than given back
TRIM = 2**30

_LIBC: list = []  # [CDLL or None] once looked up


def _libc():
    if not _LIBC:
        lib = None
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                lib = ctypes.CDLL("libc.so.6")
                lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            except (OSError, AttributeError):
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def set_heap(keep: bool) -> bool:
    """``keep``: the thresholds above; else glibc's documented defaults, fixed (128 KiB each: every
    block from 128 KiB is mapped and unmapped on its own, as the probabilities were — glibc's dynamic
    raise of the threshold cannot be switched back on in a running process). True where glibc took
    both settings; False elsewhere (not Linux / glibc), where nothing changes."""
    lib = _libc()
    if lib is None:
        return False
    trim, mmap = (TRIM, MMAP_MAX) if keep else (_DEFAULT, _DEFAULT)
    return bool(lib.mallopt(_M_TRIM_THRESHOLD, trim)) and bool(lib.mallopt(_M_MMAP_THRESHOLD, mmap))


def keep_freed() -> bool:
    """:func:`set_heap` ``(True)`` unless ``VLKV_CPU_HEAP=0`` (:data:`KEEP_FREED`); True where the heap
    now keeps freed memory."""
    return KEEP_FREED and set_heap(True)
