"""Where a KV pool's K/V tensors live: on the CPU, in memory advised to transparent huge pages.

A decode step's paged read takes each request's K/V rows through its slot table; after evictions the rows
are scattered over the pool, and in 4 KiB pages nearly every row costs its own TLB entry. A CPU pool's K/V
therefore come from ``weight_pages.zeros`` (its own 2 MiB-aligned mapping, ``MADV_HUGEPAGE``): the same
bytes, the same values, read through ~512× fewer entries where the kernel gives huge pages (THP
``always`` or ``madvise``). Nothing else changes: the tensors are ordinary contiguous CPU tensors, so every
path reads and writes them as before (bit-equal results). Measured on the 2-core EPYC VM (smollm2-llava, 8k
tokens × 4, 1 thread, each configuration paired with a 4 KiB-page pool): the paged read ≥ 1.05× in 29
of 35 configuration-runs, no slowdown reproduced (docs/benchmarks/2026-11-27-kv-huge-pages-cpu-x86_64/).

Used for the fixed pool's tensors and every re-allocation of a growable pool's (growth, shrinking after
compaction). Where it does not apply, K/V take ``torch.zeros``: a pool on another device (CUDA), a tensor
smaller than one huge page (``MIN_BYTES``: it could not fill one), ``VLKV_KV_HUGE_PAGES=0``
(``weight_pages.HUGE_KV``, read when a pool is made: each pool keeps its choice for its whole life), or no
C++ compiler to build the allocator.

:func:`huge_advised` and :func:`huge_backed_bytes` read back (Linux ``/proc/self/smaps``) whether a
tensor's memory is advised to huge pages and how much of it the kernel really holds in them, for tests
and benchmarks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vlkv.plugins import weight_pages

__all__ = [
    "MIN_BYTES",
    "huge_advised",
    "huge_backed_bytes",
    "huge_share",
    "kv_zeros",
    "mapping_of",
    "mappings",
    "thp_mode",
    "wants_huge",
]

# one huge page: a smaller tensor cannot fill one, so it keeps ordinary (cheaper to allocate) memory
MIN_BYTES = 2 << 20


def wants_huge(device: torch.device | str) -> bool:
    """Whether a new pool on ``device`` asks for huge pages (``VLKV_KV_HUGE_PAGES``, CPU only)."""
    return weight_pages.HUGE_KV and torch.device(device).type == "cpu"


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, huge: bool) -> Tensor:
    """Zeros of ``shape`` (a pool layer's ``(H_kv, S, D)``) and ``dtype``: in huge-page-advised memory when
    ``huge`` (a CPU pool that asked, :func:`wants_huge`) and the tensor fills at least one huge page, else
    ``torch.zeros``. Either way a contiguous tensor holding the same zeros."""
    if huge and torch.device(device).type == "cpu" and math.prod(shape) * dtype.itemsize >= MIN_BYTES:
        got = weight_pages.zeros(tuple(shape), dtype)
        if got is not None:
            return got
    return torch.zeros(shape, dtype=dtype, device=device)


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), None where unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def mappings() -> list[tuple[int, int, dict[str, str]]] | None:
    """This process's mappings from ``/proc/self/smaps``: ``(lo, hi, fields)`` with fields such as
    ``AnonHugePages: "2048 kB"`` and ``VmFlags: "rd wr mr mw me ac hg"`` (``hg``: advised to huge pages);
    None where that cannot be read (not Linux)."""
    out: list[tuple[int, int, dict[str, str]]] = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode path"
                    lo, _, hi = head.partition("-")
                    out.append((int(lo, 16), int(hi, 16), {}))
                elif out:
                    out[-1][2][head[:-1]] = rest.strip()
    except (OSError, ValueError):
        return None
    return out


def mapping_of(t: Tensor) -> dict[str, str] | None:
    """The smaps fields of the mapping holding ``t``'s first byte (:func:`mappings`), None where unknown."""
    at = t.data_ptr()
    return next((f for lo, hi, f in mappings() or [] if lo <= at < hi), None)


def huge_advised(t: Tensor) -> bool | None:
    """Whether ``t``'s memory is advised to huge pages (``hg`` in its mapping's ``VmFlags``), None where
    unknown."""
    fields = mapping_of(t)
    return None if fields is None or "VmFlags" not in fields else "hg" in fields["VmFlags"].split()


def _kib(fields: dict[str, str], name: str) -> int:
    return int(fields.get(name, "0 kB").split()[0]) * 1024


def huge_backed_bytes(t: Tensor) -> int | None:
    """Bytes of the mapping holding ``t`` that the kernel backs with huge pages now (``AnonHugePages``;
    neighbouring mappings with the same flags may be merged into it), None where unknown."""
    fields = mapping_of(t)
    return None if fields is None or "AnonHugePages" not in fields else _kib(fields, "AnonHugePages")


def huge_share(tensors: list[Tensor]) -> tuple[int, int] | None:
    """``(huge, mapped)``: bytes in huge pages and in all of the mappings that hold ``tensors`` (each
    mapping once; a pool's merged neighbours, such as another pool's, count too), None where unknown."""
    maps = mappings()
    if maps is None:
        return None
    ptrs = [t.data_ptr() for t in tensors if t.numel()]
    held = [(lo, hi, f) for lo, hi, f in maps if any(lo <= at < hi for at in ptrs)]
    return sum(_kib(f, "AnonHugePages") for *_, f in held), sum(hi - lo for lo, hi, _ in held)
