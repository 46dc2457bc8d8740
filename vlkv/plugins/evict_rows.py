"""A decode step's one-entry-per-row eviction of every layer as one C++ call (CPU, built on first use).

H2O evicts one entry per (sample, KV head) row at every decode step, in every layer. The cache closes
each row's gap in place (``kv.drops.shift_kept``): for the five per-entry tables (slots,
positions, modality, order, the running score) a ``where`` of two shifted views and a copy back, plus
the dropped slots' gather and the first dropped column's ``min`` — about 30 aten ops per layer, ~900
per step, each a few µs of dispatch and a pass over half of each row. :func:`drop_columns` does the
same moves for every layer in one call: per row, one ``memmove`` of the columns after the dropped one
(what the ``where`` computed: column ``j`` takes ``j + 1`` from the dropped column on), and returns the
dropped slot ids read before the move. Nothing is computed, only moved: the tables are bit-equal to
the ``where`` path's (tested).

The selection before it, where every row drops its one lowest-ranked column (H2O's step), is
:func:`lowest_columns`: one pass over every layer's running scores, in place of stacking them, masking
the invalid and protected columns, flipping and an ``argmin`` (six passes over a copy). It compares
integer keys of the same order, so it picks the same column (tested). And H2O's running attention
(each KV head's group of query rows summed into its score table, every layer) is
:func:`add_group_sums`, one call in place of a ``view``, ``sum``, ``narrow`` and ``add_`` per layer;
A-VL's text-score update and text counts (about 30 ops per layer and step) are :func:`avl_text_step`.

The last three are reached through ``vlkv/runtime/kv/score_ops.py``, which chooses between them and
their torch references (policies never call this module). ``add_group_sums`` and ``avl_text_step``
run every layer's rows in one parallel region (:func:`tables_apart`: the tables they write share no
memory). The C++ lives in ``evict_rows_cpp``. Built like the other CPU kernels
(``paged_cpu_kernel.load_extension``; None with one warning where it cannot be built: the cache keeps
the per-layer torch path). Switch: ``FUSED_DROP`` (``VLKV_CPU_EVICT=0``: off).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from vlkv.plugins import paged_cpu_kernel
from vlkv.plugins.evict_rows_cpp import SOURCE as _SOURCE

__all__ = [
    "FUSED_DROP",
    "MAX_GROUP_SUM",
    "add_group_sums",
    "avl_text_step",
    "drop_columns",
    "kernel",
    "lowest_columns",
    "tables_apart",
]

FUSED_DROP = os.environ.get("VLKV_CPU_EVICT", "1") != "0"
# the largest GQA group :func:`add_group_sums` takes: up to 4 rows torch's ``sum`` adds them in order
# (bit-equal, tested); from 5 on its vectorised body and scalar tail add them in other orders
MAX_GROUP_SUM = 4

_BUILT: list = []


def kernel():
    """The compiled extension, built on the first call; None, with one warning, where it cannot be
    built (the cache keeps its per-layer torch edit)."""
    if _BUILT:
        return _BUILT[0]
    return paged_cpu_kernel.load_extension(
        _BUILT,
        paged_cpu_kernel.build_name(_SOURCE, "vlkv_evict_rows"),
        _SOURCE,
        ["drop_columns", "lowest_columns", "add_group_sums", "avl_text_step", "tables_apart"],
        "CPU decode eviction",
        "closing each layer's gaps with torch ops",
    )


def drop_columns(tables: list[list[Tensor]], cols: Tensor, k: int) -> Tensor:
    """Close one gap per row in every layer's tables, in place.

    Args:
        tables: per layer its per-entry tables, the slot table ``(B, H_kv, C)`` int64 first, then any
            ``(B, H_kv, C, ...)`` of any dtype (positions, modality, order, scores), each with
            contiguous columns, ``C > k``; the same count per layer.
        cols: ``(L, B, H_kv)`` int64, the column each row drops, in ``[0, k]`` (``k + 1`` held).
        k: the entries each row keeps.

    Returns:
        ``(L, B, H_kv)`` int64 the dropped slot ids (read before the move). Each row's columns
        ``(cols, k]`` move one to the left; column ``k`` keeps its value (past the new length).
    """
    mod = kernel()
    if mod is None:
        raise RuntimeError("the CPU decode eviction kernel is not built here")
    per = len(tables[0]) if tables else 0
    if any(len(t) != per for t in tables) or len(tables) != cols.shape[0]:
        raise ValueError(f"tables: {cols.shape[0]} layers of the same number of tables each")
    return mod.drop_columns([t for group in tables for t in group], per, cols.to(torch.long).contiguous(), k)


def lowest_columns(scores: list[Tensor], valid: Tensor, forced: Tensor | None) -> Tensor:
    """Each row's lowest-ranked column, over several layers' scores in one pass.

    Args:
        scores: ``G`` tensors ``(B, H_kv, W)`` float32 with unit column stride (views of the running
            score tables).
        valid: ``(B, 1 or H_kv, W)`` bool, selectable columns (the others rank lowest, as ``-inf``).
        forced: ``(B, 1 or H_kv, W)`` bool or None, columns always kept (ranked ``+inf``, as NaN is).

    Returns:
        ``(G, B, H_kv)`` int64: per row the column of the lowest rank, the highest column among equal
        ranks (``-0.0`` equals ``0.0``) — ``(W - 1) - ranked.flip(-1).argmin(-1)`` of
        ``kv.score_ops.rank_keys`` (``kv.score_ops.lowest_columns`` calls it), without the stacked copy, the masks and the flip.
    """
    mod = kernel()
    if mod is None:
        raise RuntimeError("the CPU decode eviction kernel is not built here")
    none = torch.empty(0, dtype=torch.bool)
    return mod.lowest_columns(scores, valid, none if forced is None else forced)


def tables_apart(written: list[Tensor], read: list[Tensor]) -> bool:
    """Whether :func:`add_group_sums` / :func:`avl_text_step` take these tables: the ``written``
    ``(B, H_kv, C)`` tables share no memory with each other or with the ``read`` ones, no written row
    overlaps another, no stride is negative (byte ranges compared). The kernels refuse others."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the CPU decode eviction kernel is not built here")
    return mod.tables_apart(written, read)


def add_group_sums(scores: list[Tensor], colsums: list[Tensor], group: int) -> None:
    """``scores[l][:, :, :S] += colsums[l].view(B, H_kv, group, S).sum(2)`` for every layer in one
    call (H2O's running attention, through ``kv.score_ops.add_group_sums``), the group summed in order,
    as torch's ``sum`` does for ``group <= MAX_GROUP_SUM``: the same floats (tested). ``scores``:
    ``(B, H_kv, C)`` float32 tables, ``colsums``: ``(B, H_kv · group, S)`` float32, ``S <= C``, both
    with unit column stride."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the CPU decode eviction kernel is not built here")
    mod.add_group_sums(scores, colsums, group)


def avl_text_step(
    regions: list[Tensor],
    scores: list[Tensor],
    colsums: list[Tensor],
    widths: list[int],
    lengths: list[Tensor],
    group: int,
) -> Tensor:
    """A-VL's decode-step text bookkeeping of every layer in one call (through ``kv.score_ops.text_step``): per layer
    ``scores[:, :, :W] += colsum.view(B, H_kv, group, S)[..., :W].sum(2) * (regions[:, :, :W] == 0)``
    (the running text scores; the group summed in order, ``group <= MAX_GROUP_SUM`` for torch's
    floats) and the valid text entries of head 0 per sample (``(regions[:, 0, :W] == 0) & (j <
    lengths)`` summed). ``regions``, ``scores``: ``(B, H_kv, C)`` float32; ``colsums``: ``(B, H_kv ·
    group, S)`` float32; ``widths[l] <= min(S, C)``; ``lengths``: ``(B,)`` int64. Returns ``(L, B)``
    int64 the text counts."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the CPU decode eviction kernel is not built here")
    return mod.avl_text_step(regions, scores, colsums, widths, lengths, group)
