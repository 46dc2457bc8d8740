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
        n = imp.shape[0]
        # per sample, from the host in one upload: its rows' end and start in the stack, how many are
        # important, the edit's two ranks and ``lo_keys``, and the ranks its factors store
        per = []
        for (i, _, f), start in zip(held, _starts(sizes)):
            edit = items[i][1]
            top = math.ceil(edit.top_fraction * f.rows)
            per.append((start + f.rows, start, top, edit.rank, edit.rank_lo, int(edit.lo_keys), *_stored(f)))
        meta = torch.tensor(list(zip(*per)), dtype=torch.long, device=imp.device)  # (8, M)
        row = torch.arange(n, device=imp.device)
        sample = torch.searchsorted(meta[0], row, right=True)  # (N,) each row's sample
        _, start, top, rank, rank_lo, lo_keys, cap_k, cap_v = meta[:, sample].unbind(0)  # each (N,)
        # rows grouped by sample, each sample's by importance descending (ties: lower row first)
        by_imp = torch.sort(imp, descending=True, stable=True).indices
        order = by_imp[torch.sort(sample[by_imp], stable=True).indices]
        # the k-th of its sample's rows in that order is among the top ``top`` (sample[order] == sample)
        hi = torch.empty(n, dtype=torch.bool, device=imp.device)
        hi[order] = (row - start) < top
        lo = torch.where(hi, rank, rank_lo)
        rank_k = torch.where(lo_keys != 0, lo, rank).minimum(cap_k)
        rank_v = lo.minimum(cap_v)
        for (_, _, f), rk, rv in zip(held, rank_k.split(sizes), rank_v.split(sizes)):
            f.rank_k, f.rank_v = rk, rv


def _stored(f) -> tuple[int, int]:
    """The ranks ``f`` stores for keys and values (a row's reconstruction rank is clamped to them)."""
    return f.kbar.shape[1], f.vbar.shape[1]


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
    segment (its item) by ``searchsorted`` on the segments' ends; a column names a row where
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
    # per item, from the host in one upload: its columns' end and start in the concatenation, and per
    # sample the first row of its factors in the stack (-1 where it holds none)
    first = [[-1] * layer.batch for layer, _ in items]
    for (i, s, _), at in zip(held, _starts(rows)):
        first[i][s] = at
    starts = _starts(widths)
    per = [(start + w, start, *f) for start, w, f in zip(starts, widths, first)]
    meta = torch.tensor(list(zip(*per)), dtype=torch.long, device=dev)  # (2 + B, J)
    slots = torch.cat([layer.slots for layer, _ in items], dim=2)  # (B, H_kv, ΣC)
    score = torch.cat([layer.scores[edit.importance] for layer, edit in items], dim=2)
    lengths = torch.stack([layer.lengths for layer, _ in items], dim=1)  # (B, J)
    col = torch.arange(slots.shape[2], device=dev)
    seg = torch.searchsorted(meta[0], col, right=True)  # (ΣC,) each column's item
    at_col = meta[:, seg]  # (2 + B, ΣC): the column's item's first column, each sample's first row
    base = at_col[2:]  # (B, ΣC)
    # a column names a row where its slot is negative (-(1 + row)), it is inside its sample's length
    # and the sample holds factors
    named = (slots < 0) & (((col - at_col[1]) < lengths[:, seg]) & (base >= 0))[:, None, :]
    at = torch.where(named, base[:, None, :] + ~slots, n)
    imp = torch.full((n + 1,), float("-inf"), dtype=torch.float32, device=dev)
    imp.scatter_reduce_(0, at.reshape(-1), score.reshape(-1).to(imp), "amax")
    return imp[:n], held
