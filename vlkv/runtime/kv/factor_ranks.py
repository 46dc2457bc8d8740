"""AttentionPack's attention-aware decompression, batched: the reconstruction ranks of every factored
sample of many layers (and of many requests' caches) set from their rows' importance in one fixed set of
tensor ops, however many requests and layers hold factors, with no read back.

A sample's factor rows (:class:`~vlkv.runtime.kv.lowrank.Factors`, ``T`` rows) each get an importance:
the most that any valid column of the layer's table naming that row (``slot = -(1 + row)``) scored in a
running statistic (``LayerKV.scores[name]``, ``(B, H_kv, C)`` float32). The ``ceil(top_fraction · T)``
most important rows are reconstructed with ``rank`` components, the others with ``rank_lo`` (values
always, keys too when ``lo_keys``), each clamped to the rank the sample stores.

The per-sample loop this replaces (a scatter, a top-k and the rank tensors per request and layer) cost
~29 dispatched ops per request and layer. Here the layers' tables and scores are concatenated along
their columns (one group per batch size and head count; the scheduler's requests are batch 1), every
column sends its score to its row in one stack of every sample's rows (``scatter_reduce`` ``amax``:
the same maxima, bit for bit), and the rows are ranked within their sample by two stable sorts (by
importance, descending, then by sample). Ties are broken by the lower row index; ``torch.topk`` leaves
the order of ties unspecified, so on exactly tied importances the chosen rows may differ from a
per-sample ``topk`` (never otherwise).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# columns per parameter row (rank, rank_lo, lo_keys, stored key rank, stored value rank)
_PARAMS = 5


def rank_jobs(jobs: list[tuple]) -> list[tuple]:
    """The ``(layer, edit)`` pairs of ``jobs`` whose :class:`~vlkv.runtime.policies.base.FactorEdit`
    sets ranks by importance and whose layer holds factors (host attributes only)."""
    return [
        (layer, edit)
        for layer, edit in jobs
        if edit.importance is not None
        and edit.rank_lo != edit.rank
        and layer.lowrank is not None
        and any(f is not None for f in layer.lowrank.samples)
    ]


def importances(jobs: list[tuple]) -> list[list[Tensor | None]]:
    """Per job and sample, the ``(T,)`` float32 importance of each factor row (None where the sample
    holds no factors): what :func:`set_ranks_by_importance` ranks (a view of one stacked tensor)."""
    out: list[list[Tensor | None]] = [[None] * layer.batch for layer, _ in jobs]
    for group in _groups(jobs):
        imp, held = _stacked_importance([jobs[j] for j in group])
        for (i, s, _), piece in zip(held, imp.split([f.rows for _, _, f in held])):
            out[group[i]][s] = piece
    return out


def set_ranks_by_importance(jobs: list[tuple]) -> None:
    """Set every factored sample's ``rank_k, rank_v (T,)`` of ``jobs`` (``(layer, FactorEdit)`` pairs,
    the edits' ``importance`` set and ``rank_lo < rank``: :func:`rank_jobs`) by its rows' importance:
    a fixed number of tensor ops per group of layers with one batch size and head count, no read
    back. Replaces each sample's rank tensors (new tensor objects: the static step copies ranks whose
    identity changed)."""
    for group in _groups(jobs):
        items = [jobs[j] for j in group]
        imp, held = _stacked_importance(items)
        sizes = [f.rows for _, _, f in held]
        dev = imp.device
        n = imp.shape[0]
        params = []
        for i, _, f in held:
            edit = items[i][1]
            params.append([edit.rank, edit.rank_lo, int(edit.lo_keys), f.kbar.shape[1], f.vbar.shape[1]])
        param = torch.tensor(params, dtype=torch.long, device=dev)  # (M, _PARAMS)
        starts = torch.tensor(_starts(sizes), dtype=torch.long, device=dev)  # (M,)
        top = torch.tensor(
            [math.ceil(items[i][1].top_fraction * f.rows) for i, _, f in held], dtype=torch.long, device=dev
        )
        row = torch.arange(n, device=dev)
        sample = torch.searchsorted(starts, row, right=True) - 1  # (N,) each row's sample
        # rows grouped by sample, each sample's by importance descending (ties: lower row first)
        by_imp = torch.sort(imp, descending=True, stable=True).indices
        order = by_imp[torch.sort(sample[by_imp], stable=True).indices]
        # the k-th of its sample's rows in that order is among the top ``top`` (sample[order] == sample)
        hi = torch.empty(n, dtype=torch.bool, device=dev)
        hi[order] = (row - starts[sample]) < top[sample]
        p = param[sample]  # (N, _PARAMS)
        lo = torch.where(hi, p[:, 0], p[:, 1])
        rank_k = torch.where(p[:, 2] != 0, lo, p[:, 0]).minimum(p[:, 3])
        rank_v = lo.minimum(p[:, 4])
        for (_, _, f), rk, rv in zip(held, rank_k.split(sizes), rank_v.split(sizes)):
            f.rank_k, f.rank_v = rk, rv


def _groups(jobs: list[tuple]) -> list[list[int]]:
    """Indices of ``jobs`` by (batch, KV heads, device): layers whose tables concatenate by columns."""
    groups: dict[tuple, list[int]] = {}
    for j, (layer, _) in enumerate(jobs):
        groups.setdefault((layer.batch, layer.kv_heads, str(layer.device)), []).append(j)
    return list(groups.values())


def _starts(sizes: list[int]) -> list[int]:
    """Exclusive prefix sums of ``sizes``."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _stacked_importance(items: list[tuple]) -> tuple[Tensor, list[tuple]]:
    """``(imp (N,) float32, held)``: the importance of every factor row of ``items`` (layers of one
    batch size ``B`` and head count ``H_kv``), stacked in (item, sample) order, and ``held``, that
    order's ``(item, sample, Factors)``.

    One column-wise concatenation of the items' tables ``(B, H_kv, ΣC)`` and scores; each column's
    segment (its item) by ``searchsorted`` on the segments' first columns; a column names a row where
    its slot is negative, it is inside its sample's length and the sample holds factors. Every other
    column goes to a spare last row, dropped."""
    held = [
        (i, s, f)
        for i, (layer, _) in enumerate(items)
        for s, f in enumerate(layer.lowrank.samples)
        if f is not None
    ]
    dev = items[0][0].device
    widths = [layer.slots.shape[2] for layer, _ in items]
    rows = [f.rows for _, _, f in held]
    n = sum(rows)
    # per (item, sample) the first row of its factors in the stack, -1 where it holds none
    first = [[-1] * layer.batch for layer, _ in items]
    for (i, s, _), at in zip(held, _starts(rows)):
        first[i][s] = at
    slots = torch.cat([layer.slots for layer, _ in items], dim=2).long()  # (B, H_kv, ΣC)
    score = torch.cat([layer.scores[edit.importance] for layer, edit in items], dim=2)
    lengths = torch.stack([layer.lengths for layer, _ in items])  # (J, B)
    firsts = torch.tensor(first, dtype=torch.long, device=dev)  # (J, B)
    col_starts = torch.tensor(_starts(widths), dtype=torch.long, device=dev)  # (J,)
    col = torch.arange(slots.shape[2], device=dev)
    seg = torch.searchsorted(col_starts, col, right=True) - 1  # (ΣC,) each column's item
    # (B, ΣC): inside the sample's length; the sample's first row (or -1)
    valid = (col - col_starts[seg])[None, :] < lengths[seg].T
    base = firsts[seg].T
    named = (slots < 0) & (valid & (base >= 0))[:, None, :]
    at = torch.where(named, base[:, None, :] - slots - 1, n)
    imp = torch.full((n + 1,), float("-inf"), dtype=torch.float32, device=dev)
    imp.scatter_reduce_(0, at.reshape(-1), score.reshape(-1).to(imp), "amax")
    return imp[:n], held
