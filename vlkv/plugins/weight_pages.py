"""A CPU model's fp32 weights moved into memory backed by transparent huge pages (Linux).

A decode step streams every weight once; the few-row GEMM (``skinny_gemm``) reads a block of weight rows
side by side, and a checkpoint's weights are memory-mapped from its file in 4 KiB pages: each 4 KiB of a
0.54 GB step (smollm2-llava) takes its own TLB entry. Copied into 2 MiB-aligned anonymous memory advised
to huge pages (``MADV_HUGEPAGE``; the VM's THP mode is ``madvise``), the same products read the same bytes
through ~512× fewer entries: measured on the 2-core EPYC VM, 1 thread, 4 rows, smollm2-llava's decoder
layers alone 1.07-1.15×, a decode step 1.05-1.11×, bit-equal (docs/benchmarks/2026-11-26-layer-cpu-x86_64/).

:func:`move` copies the parameters of the given modules (fp32, CPU, contiguous, at least ``MIN_ELEMENTS``;
tied parameters once) into one such buffer and points each parameter's ``.data`` at its slice — the same
values, the same ``Parameter`` objects, so the model and every path that reads it are unchanged;
:func:`restore` points them back. :func:`place` is the engine-start form (a CPU fp32 model's decoder
layers, final norm and output head; ``VLKV_CPU_HUGE_WEIGHTS=0`` leaves them). Without the C++ extension
(no compiler) nothing moves. The buffer comes from this module's own small extension: it does not need
(nor build) the fused decode layer's (``VLKV_CPU_LAYER=0`` still moves the weights).

:func:`zeros` is that extension's memory for any tensor (bytes, so any dtype): a CPU KV pool's K/V live in it
too (``vlkv/runtime/kv/pool_memory.py``; ``VLKV_KV_HUGE_PAGES=0`` leaves them in ordinary pages), so the
paged read's scattered rows cost fewer TLB misses.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vlkv.plugins import paged_cpu_kernel, skinny_gemm

__all__ = ["HUGE_KV", "HUGE_WEIGHTS", "MIN_ELEMENTS", "Moved", "move", "place", "restore", "zeros"]

# VLKV_CPU_HUGE_WEIGHTS=0: :func:`place` leaves the weights where the checkpoint put them
HUGE_WEIGHTS = skinny_gemm.env_switch("VLKV_CPU_HUGE_WEIGHTS")
# VLKV_KV_HUGE_PAGES=0: a CPU KV pool's K/V stay in ordinary 4 KiB pages (read when a pool is made,
# vlkv/runtime/kv/pool_memory.py; on by default: the paged read >= 1.05x in 29 of 35 paired runs at 8k x 4,
# docs/benchmarks/2026-11-27-kv-huge-pages-cpu-x86_64/)
HUGE_KV = skinny_gemm.env_switch("VLKV_KV_HUGE_PAGES")

# below this a weight is not worth a slot (norm weights, biases): they stay where they are
MIN_ELEMENTS = 1 << 14
# each slice starts on a 64-byte line (16 floats)
_ALIGN = 16
# the attribute place() leaves on the decoder layers' ModuleList: what it moved
_PLACED = "_vlkv_weight_pages"

_SOURCE = r"""
#include <torch/extension.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#ifdef __linux__
#include <sys/mman.h>
#endif

// nbytes zero bytes (uint8) in memory of their own, starting on a 2 MiB boundary and (Linux) advised to
// transparent huge pages: what is read from them goes through ~512x fewer TLB entries; unmapped with the
// tensor. Its own mapping, rounded up only to 4 KiB: a tail short of 2 MiB stays in 4 KiB pages rather
// than hold a huge page it half uses (the resident memory is what was asked for)
torch::Tensor huge_bytes(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 1, "huge_bytes: nbytes >= 1");
  const size_t huge = size_t(2) << 20, page = 4096;
  const size_t len = ((size_t(nbytes) + page - 1) / page) * page;
#ifdef __linux__
  const size_t span = len + huge;  // room to start on a 2 MiB boundary; the slack is unmapped again
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "huge_bytes: could not map ", span, " bytes");
  const uintptr_t lo = reinterpret_cast<uintptr_t>(raw), at = (lo + huge - 1) & ~(uintptr_t(huge) - 1);
  if (at > lo) munmap(raw, at - lo);
  if (lo + span > at + len) munmap(reinterpret_cast<void*>(at + len), lo + span - (at + len));
  char* p = reinterpret_cast<char*>(at);
  madvise(p, len, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
  // fault the pages in now (one write per 4 KiB; the kernel zeroes them), as huge ones where it can
  volatile char* touch = p;
  for (size_t i = 0; i < len; i += page) touch[i] = 0;
  return torch::from_blob(p, {nbytes}, [len](void* q) { munmap(q, len); },
                          torch::TensorOptions().dtype(torch::kUInt8));
#else
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, huge, len) == 0 && p, "huge_bytes: could not allocate ", len, " bytes");
  std::memset(p, 0, len);
  return torch::from_blob(p, {nbytes}, [](void* q) { std::free(q); },
                          torch::TensorOptions().dtype(torch::kUInt8));
#endif
}

// n float32 zeros the same way (a weight ring's buffer, scripts/bench_skinny_gemm.py)
torch::Tensor huge_buffer(int64_t n) {
  TORCH_CHECK(n >= 1, "huge_buffer: n >= 1 floats");
  return huge_bytes(n * 4).view(torch::kFloat);
}
"""

_BUILT: list = []  # [module or None] once a build was tried


def kernel():
    """The compiled ``huge_bytes`` / ``huge_buffer`` extension, built on the first call (None, with one
    warning, when it cannot be built here: nothing moves, KV pools take ordinary memory)."""
    if _BUILT:
        return _BUILT[0]
    name = paged_cpu_kernel.build_name(_SOURCE, "vlkv_weight_pages")
    return paged_cpu_kernel.load_extension(
        _BUILT, name, _SOURCE, ["huge_bytes", "huge_buffer"], "huge-page buffer", "ordinary pages kept"
    )


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """A contiguous zero tensor of ``shape`` and ``dtype`` (any: fp32, fp16, bf16, ints) on the CPU, in
    memory of its own that starts on a 2 MiB boundary and is advised to huge pages (the extension's
    ``huge_bytes``); None where the extension is not built here."""
    mod = kernel()
    if mod is None:
        return None
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return mod.huge_bytes(nbytes).view(dtype).view(shape)


@dataclass
class Moved:
    """What :func:`move` moved: the parameters, their former tensors, and the buffer they now share."""

    params: list[nn.Parameter] = field(default_factory=list)
    before: list[Tensor] = field(default_factory=list)
    slots: list[Tensor] = field(default_factory=list)
    buffer: Tensor | None = None

    def __post_init__(self):
        if not len(self.params) == len(self.before) == len(self.slots):
            raise ValueError(
                f"params, before and slots differ in length: {len(self.params)}, {len(self.before)}, {len(self.slots)}"
            )

    @property
    def bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.params)


def _movable(p: Tensor) -> bool:
    return p.is_cpu and p.dtype is torch.float32 and p.is_contiguous() and p.numel() >= MIN_ELEMENTS


def available_bytes() -> int | None:
    """The memory the kernel says a process can still take (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _movable_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            if _movable(p.data) and id(p) not in seen:
                seen[id(p)] = p
    return list(seen.values())


def move(modules: list[nn.Module]) -> Moved:
    """Copy the fp32 CPU weights of ``modules`` into one huge-page buffer (see the module docstring).
    Returns what moved (empty where the extension is not built)."""
    return _move(_movable_params(modules))


def _move(params: list[nn.Parameter]) -> Moved:
    """:func:`move` for parameters already listed (``_movable_params``: each once)."""
    if not params or kernel() is None:
        return Moved()
    sizes = [-(-p.numel() // _ALIGN) * _ALIGN for p in params]
    buffer = zeros((sum(sizes),), torch.float32)
    before, slots, at = [], [], 0
    with torch.no_grad():
        for p, size in zip(params, sizes):
            slot = buffer[at : at + p.numel()].view(p.shape)
            slot.copy_(p.data)
            before.append(p.data)
            slots.append(slot)
            p.data = slot
            at += size
    return Moved(params, before, slots, buffer)


def restore(moved: Moved, huge: bool = False) -> None:
    """Point the moved parameters back at their former tensors, or (``huge``) at their huge-page slots
    again (a benchmark's two configurations in one run)."""
    if not huge and len(moved.before) != len(moved.params):
        raise ValueError(
            "these weights were placed for good (weight_pages.place): there is nothing to restore"
        )
    for p, t in zip(moved.params, moved.slots if huge else moved.before):
        p.data = t


def place(adapter, device: torch.device | str, dtype: torch.dtype) -> Moved:
    """At engine start: the decoder layers', final norm's and output head's weights of a CPU fp32 model
    (``adapter``: a ``FamilyAdapter``) moved into huge pages (:func:`move`), unless
    ``VLKV_CPU_HUGE_WEIGHTS=0``; on another device or dtype nothing moves."""
    if not HUGE_WEIGHTS or torch.device(device).type != "cpu" or dtype != torch.float32:
        return Moved()
    # several engines over one loaded model (the tests' shared fixtures, a server's workers): the weights
    # move once, while they are still where the first engine put them
    done = getattr(adapter.layers, _PLACED, None)
    if done is not None and all(p.data.data_ptr() == t.data_ptr() for p, t in zip(done.params, done.slots)):
        return done
    params = _movable_params([adapter.layers, adapter.norm, adapter.lm_head])
    # the copy holds a second set of the weights until the checkpoint's is let go: a model that fills most of
    # the machine's memory (a 7B fp32 model is 28 GB) stays where it is rather than risk running out
    need, free = sum(p.numel() * 4 for p in params), available_bytes()
    if free is not None and 2 * need > free:
        warnings.warn(
            f"vlkv: weights left out of huge pages: copying {need / 2**30:.1f} GiB needs twice that free, "
            f"{free / 2**30:.1f} GiB is available (VLKV_CPU_HUGE_WEIGHTS=0 silences this)",
            stacklevel=2,
        )
        return Moved()
    moved = _move(params)
    # for good: the checkpoint's tensors are let go (memory back to one copy), so there is no restore
    moved.before.clear()
    setattr(adapter.layers, _PLACED, moved)
    return moved
