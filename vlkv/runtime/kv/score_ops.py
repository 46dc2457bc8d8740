"""Score-table operations: what a policy asks of the per-entry score tables at a decode step.

A policy decides from statistics which entries to keep; how the tables it reads and updates are
walked is the backend's business. The three steps below run over every layer at once. Each picks its
form here, never in the policy: one C++ call over every layer's tables where they are CPU float32 and
the kernel is built (``vlkv/plugins/evict_rows.py``; ``VLKV_CPU_EVICT=0`` off) and takes the tables
(the tables it writes share no memory with any other: ``evict_rows.tables_apart``), else the torch
reference beside it. Both give the same floats and columns (tested bit for bit, ``torch.equal``):

- :func:`add_group_sums`: each KV head's GQA group of attention sums added to its running score (H2O).
- :func:`text_step`: A-VL's text-score update and its text counts.
- :func:`lowest_columns`: each row's lowest-ranked column, when every row drops one (H2O's step),
  ranked as :func:`rank_keys` orders columns (the order every policy's ranking uses).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins import evict_rows

__all__ = ["add_group_sums", "group_sums", "lowest_columns", "rank_keys", "text_step"]

TEXT = 0  # the region code the kernel's text step counts (A-VL's ``TEXT``)


def _kernel_takes(tensors: list[Tensor]) -> bool:
    """The switch is on, every tensor is CPU float32 with unit last stride and the kernel is built
    (else the torch form runs)."""
    if not evict_rows.FUSED_DROP:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != torch.float32 or t.stride(-1) != 1:
            return False
    return evict_rows.kernel() is not None


def _group(colsums: list[Tensor], kv_heads: int) -> int | None:
    """The GQA group of ``colsums`` ``(B, H_kv · G, S)`` each, where the kernel adds it in torch's order
    (3-D, ``G <= MAX_GROUP_SUM``), else None."""
    h = colsums[0].shape[1] if colsums and colsums[0].dim() == 3 else 0
    if not h or h % kv_heads or h > kv_heads * evict_rows.MAX_GROUP_SUM:
        return None
    if any(c.dim() != 3 or c.shape[1] != h for c in colsums):
        return None
    return h // kv_heads


def group_sums(colsum: Tensor, kv_heads: int) -> Tensor:
    """``colsum (B, H, S)`` per query head → ``(B, H_kv, S)`` summed over each GQA group (in order
    from the group's first head: torch's ``sum`` over up to ``MAX_GROUP_SUM`` rows)."""
    b, h, s = colsum.shape
    return colsum.view(b, kv_heads, h // kv_heads, s).sum(2)


def add_group_sums(scores: list[Tensor], colsums: list[Tensor], kv_heads: int) -> None:
    """``scores[l][:, :, :S_l] += group_sums(colsums[l])`` for every layer, in place.

    Args:
        scores: per layer the running score table ``(B, H_kv, C)``.
        colsums: per layer the step's attention sums ``(B, H_kv · G, S_l)``, ``S_l <= C``.
        kv_heads: ``H_kv``.
    """
    group = _group(colsums, kv_heads)
    if (
        group is not None
        and all(t.dim() == 3 and c.shape[2] <= t.shape[2] for t, c in zip(scores, colsums))
        and _kernel_takes([*scores, *colsums])
        and evict_rows.tables_apart(scores, colsums)
    ):
        evict_rows.add_group_sums(scores, colsums, group)
        return
    for score, colsum in zip(scores, colsums, strict=True):
        # ``narrow``: one op, where ``score[:, :, :s] +=`` dispatches six slices (per layer and step)
        score.narrow(2, 0, colsum.shape[-1]).add_(group_sums(colsum, kv_heads))


def text_step(
    regions: list[Tensor],
    scores: list[Tensor],
    colsums: list[Tensor],
    widths: list[int],
    lengths: list[Tensor],
    kv_heads: int,
) -> Tensor:
    """A-VL's decode-step text bookkeeping of every layer: the running text scores updated in place
    and each sample's valid text entries counted in head 0.

    Per layer ``l`` with ``W = widths[l]``: ``scores[:, :, :W] += group_sums(colsums[:, :, :W]) *
    (regions[:, :, :W] == TEXT)`` (attention sums are >= 0: a non-text column gains ``+0.0``, which
    turns a ``-0.0`` score into ``+0.0`` on either path) and ``((regions[:, 0, :W] == TEXT) & (j <
    lengths)).sum(-1)``.

    Args:
        regions: per layer ``(B, H_kv, C)`` float32 region codes.
        scores: per layer ``(B, H_kv, C)`` float32 running text scores.
        colsums: per layer ``(B, H_kv · G, S_l)`` the step's attention sums, ``W <= S_l``.
        widths: per layer the columns it holds (``W <= min(S_l, C)``).
        lengths: per layer ``(B,)`` int64 entries per sample.
        kv_heads: ``H_kv``.

    Returns:
        ``(L, B)`` int64 the text counts.
    """
    group = _group(colsums, kv_heads)
    if (
        group is not None
        and len(regions) == len(scores) == len(lengths) == len(widths)
        and all(n.is_cpu and n.dtype == torch.long for n in lengths)
        and _kernel_takes([*regions, *scores, *colsums])
        and evict_rows.tables_apart(scores, [*regions, *colsums])
    ):
        lengths = [n.contiguous() for n in lengths]
        return evict_rows.avl_text_step(regions, scores, colsums, widths, lengths, group)
    held = []
    for region, score, colsum, w, n in zip(regions, scores, colsums, widths, lengths, strict=True):
        is_text = region.narrow(2, 0, w) == TEXT
        sums = group_sums(colsum.narrow(2, 0, w), kv_heads)
        # where, not a product: an inf / NaN sum at a non-text column must add 0, as the kernel skips it
        score.narrow(2, 0, w).add_(torch.where(is_text, sums, 0.0))
        valid = torch.arange(w, device=n.device) < n[:, None]
        held.append((is_text[:, 0] & valid).sum(-1))
    return torch.stack(held)


def rank_keys(scores: Tensor, valid: Tensor, force: Tensor | None) -> Tensor:
    """The order every ranking of entries uses, as floats: ``scores`` (any float dtype, cast to
    float32) with NaN as ``+inf``, columns not ``valid`` as ``-inf`` and ``force``d valid columns as
    ``+inf``. ``scores (..., H_kv, S)``; ``valid``, ``force``: bool broadcastable to it."""
    ranked = scores.float().nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    ranked = ranked.masked_fill(~valid, float("-inf"))
    if force is not None:
        ranked = ranked.masked_fill(force & valid, float("inf"))
    return ranked


def lowest_columns(scores: list[Tensor], valid: Tensor, force: Tensor | None, ragged: bool = False) -> Tensor:
    """Each row's lowest-ranked column over several layers' score tables where they lie.

    Args:
        scores: ``G`` tensors ``(B, H_kv, S)`` (views of the running score tables).
        valid: ``(B, 1 or H_kv, S)`` bool, selectable columns (the others rank lowest).
        force: ``(B, 1 or H_kv, S)`` bool or None, columns always kept (ranked highest).
        ragged: ``valid`` is a prefix ``[0, n_b)`` of each sample's columns, ``n_b`` not all ``S`` (a
            scheduler cohort's rows of different lengths): each row's lowest *valid* column.

    Returns:
        ``(G·B, H_kv, 1)`` int64: per row the column of the lowest :func:`rank_keys` key, the highest
        column among equal keys (``-0.0`` equals ``0.0``); ``ragged``: among the row's valid columns.
    """
    b, h, s = scores[0].shape
    if ragged:
        return _lowest_valid(scores, valid, force)
    masks = [valid] if force is None else [valid, force]
    if all(m.is_cpu and m.dtype == torch.bool and m.dim() == 3 for m in masks) and _kernel_takes(scores):
        return evict_rows.lowest_columns(scores, valid, force).view(len(scores) * b, h, 1)
    # the layers stacked (G, B, H_kv, S): the masks broadcast over G, no repeated copies
    ranked = rank_keys(torch.stack(scores), valid, force).view(len(scores) * b, h, s)
    return (s - 1) - ranked.flip(-1).argmin(-1, keepdim=True)


def _lowest_valid(scores: list[Tensor], valid: Tensor, force: Tensor | None) -> Tensor:
    """:func:`lowest_columns` with ``valid`` the prefix ``[0, n_b)`` of each sample's columns: the
    invalid columns rank highest (as forced ones), not lowest, and a row whose lowest key is then
    ``+inf`` everywhere (every valid column forced, NaN or ``+inf``: the highest column among equals is
    an invalid one) takes its last valid column ``n_b - 1`` — the column a ranking of ``[0, n_b)`` alone
    drops then. So the same column as :func:`rank_keys`' order of the row's own columns, on either path."""
    g, (b, h, s) = len(scores), scores[0].shape
    last = valid.narrow(1, 0, 1).sum(-1, keepdim=True) - 1  # (B, 1, 1) each row's last valid column
    high = ~valid if force is None else ~valid | force
    if high.is_cpu and high.dim() == 3 and _kernel_takes(scores):
        every = torch.ones_like(valid)
        cols = evict_rows.lowest_columns(scores, every, high).view(g, b, h)
    else:
        ranked = (
            torch.stack(scores)
            .float()
            .nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
        )
        ranked = ranked.masked_fill(high, float("inf")).view(g, b, h, s)
        cols = (s - 1) - ranked.flip(-1).argmin(-1)
    return torch.minimum(cols, last.view(1, b, 1)).view(g * b, h, 1)
