"""A decode layer's cache append and paged read as one C++ call (CPU, fp32, built on first use).

A decode step used to write each layer's new K/V rows into their pool slots (``KVPool.write``: a flat
index, two ``index_copy_``, a pre-RoPE flag scatter), build the slot table the read takes
(``kv/paged.py``: a table copy, holes masked to ``-1``, lengths widened per head, the attended count)
and then call the fused read (``paged_cpu``: a plan matched by value, the query scaled and regrouped,
the output merged and transposed): ~60 aten ops per layer around one kernel. :func:`append_attend`
does all of it in one call: it writes the new rows (and clears their pre-RoPE flags), then reads every
(request, KV head)'s slot row where it lies — the tables as the caches keep them (one tensor per cache,
strided rows, holes as their bool table), nothing copied — and returns the attention output already in
the ``(B, 1, H, D)`` layout the decoder layer's output projection takes, plus the entries each
request attended.

The read is ``paged_cpu_kernel``'s (the same C++ ``segment`` routine: each K and V row read once, runs
read as contiguous rows, scattered slots prefetched); the append's C++ (``paged_append_cpp``) is
compiled into that same extension, so the read and the append are one build, once per CPU kind. Where
it cannot be built (no compiler), :func:`kernel` is None (one warning) and the runtime keeps the Python
append and the separate read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.plugins import paged_cpu_kernel

__all__ = ["FUSED_APPEND", "NewColumns", "append_attend", "fits", "kernel"]

# the fused append-and-read (default on; ``VLKV_CPU_APPEND=0``: the Python append, then the read). Its
# caller also follows the fused read's switch (``VLKV_CPU_KERNEL=0`` / ``paged_cpu.FUSED_KERNEL``): it is
# that read with the append in front
FUSED_APPEND = os.environ.get("VLKV_CPU_APPEND", "1") != "0"


@dataclass(frozen=True)
class NewColumns:
    """The tables' new column of a decode step (one entry per request), written by the kernel.

    positions, modality, order: per cache (as ``tables``) its ``(b_i, H_kv, C_i, P)`` int64 positions,
    ``(b_i, H_kv, C_i)`` int8 modality and int64 order tables. cols: ``(B,)`` int64 each request's
    column. pos_new ``(B, P)`` int64, mod_new ``(B,)`` int8, ord_new ``(B,)`` int64: what each request's
    new entry gets there (every head the same). scores: per cache its float32 running-score tables
    shaped like its slot table (``LayerKV.scores``' values), zeroed at the new column (empty: none; a
    statistics policy's reservation zeroed them with 2 ops per table, request and layer).
    """

    positions: list[Tensor]
    modality: list[Tensor]
    order: list[Tensor]
    cols: Tensor
    pos_new: Tensor
    mod_new: Tensor
    ord_new: Tensor
    scores: list[list[Tensor]] | tuple = ()

    def __post_init__(self) -> None:
        if not len(self.positions) == len(self.modality) == len(self.order):
            raise ValueError("positions, modality, order: one table per cache each")
        if self.scores and len(self.scores) != len(self.positions):
            raise ValueError("scores: one list of score tables per cache (or none at all)")
        for name in ("cols", "pos_new", "mod_new", "ord_new"):
            if getattr(self, name).shape[0] != self.cols.shape[0]:
                raise ValueError(f"{name}: one row per request ({self.cols.shape[0]})")


def kernel():
    """The compiled extension holding :func:`append_attend`'s entry point: the paged read's own
    (``paged_cpu_kernel.kernel()``, built with this entry point: one build for both), or None (one
    warning) where it cannot be built (the caller keeps the Python append and the separate read)."""
    return paged_cpu_kernel.kernel()


def fits(spec, heads: int, dim: int) -> bool:
    """The fused append-and-read takes a decode step on a pool of ``spec`` (a ``PoolSpec``) with
    ``heads`` query heads of size ``dim``: its switch on, fp32 CPU pools, GQA group and head size within
    what the kernel reads, the kernel built (built here on the first call). (The fused read's own switch,
    ``paged_cpu.FUSED_KERNEL``, is the caller's to check: ``paged_cpu`` builds this module at start.)"""
    return (
        FUSED_APPEND
        and spec.device.type == "cpu"
        and spec.dtype == torch.float32
        and heads % spec.kv_heads == 0
        and heads // spec.kv_heads <= paged_cpu_kernel.MAX_ROWS
        and dim == spec.head_dim
        and dim <= paged_cpu_kernel.MAX_DIM
        and kernel() is not None
    )


def append_attend(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    prerope: Tensor,
    ids: Tensor,
    tables: list[Tensor],
    holes: list[Tensor],
    columns: NewColumns,
    lengths: Tensor,
    scale: float,
    probs_width: int | None = None,
) -> tuple[Tensor, ...]:
    """Write a decode step's new entries into one layer's pool and tables, and attend every request's
    slot row.

    ``q (B, H_kv, G, D)`` (post-RoPE, unscaled; any strides), ``k_new / v_new (B, H_kv, 1, D)``,
    ``k_pool / v_pool (H_kv, S, D)`` fp32 contiguous, ``prerope (H_kv, S)`` bool (the pool's pre-RoPE
    flags, cleared at the new slots), ``ids (H_kv, B)`` int64 the new entries' slots (any strides),
    ``tables``: per cache its ``(b_i, H_kv, C_i)`` int64 slot table (unit column stride; ``Σ b_i = B``),
    ``holes``: per cache an empty tensor or its ``(b_i, H_kv, C_i)`` bool holes, ``columns``: the new
    column of each request and what the tables get there (:class:`NewColumns`, its running scores
    zeroed there), ``lengths (B,)`` int64
    entries after the append. Returns ``out (B, 1, H_kv·G, D)`` fp32 and ``attended (B,)`` float64 (live
    entries read, mean over KV heads); with ``probs_width`` also ``probs (B, H_kv, G, width)`` (softmax at
    each live entry's table column, 0 elsewhere) and ``held (B, H_kv, width)`` bool, the live columns (a
    statistics step's visibility).
    """
    mod = kernel()
    if mod is None:
        raise RuntimeError("the fused CPU decode append could not be built here (no C++ compiler?)")
    want = probs_width is not None
    c = columns
    scores = [s for per in c.scores for s in per]
    score_of = [t for t, per in enumerate(c.scores) for _ in per]
    return tuple(
        mod.append_rows(
            q, k_new, v_new, k_pool, v_pool, prerope, ids, tables, holes, c.positions, c.modality, c.order,
            scores, score_of, c.cols, c.pos_new, c.mod_new, c.ord_new, lengths, float(scale), want, probs_width if want else 0,
        )
    )  # fmt: skip
