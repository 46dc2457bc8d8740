"""Ranking a layer's entries: which ``keep[b]`` of each (sample, KV head) row score best.

The shared selection under every scoring policy (:func:`~vlkv.runtime.policies.base.select_top`,
budgets, allocators): one stable order — higher score first, ties to the lower column, NaN as +inf
— reached by the cheapest form that gives it: a full stable sort, a ``topk`` when a few are kept of
many (:func:`_keep_highest`), or when a few are dropped of many (:func:`_drop_lowest`; one per row
by an ``argmin``, :func:`_drop_one`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv import score_ops


def top_entries(
    scores: Tensor, valid: Tensor, keep: Tensor, force: Tensor | None = None, kept: list[int] | None = None
) -> tuple[Tensor, Tensor]:
    """Pick the ``keep[b]`` best-scoring valid slots per (sample, KV head), returned ascending:
    ``index (B, H_kv, K)`` and ``keep_len (B,)``, see :func:`rank_entries`."""
    index, keep_len, _ = rank_entries(scores, valid, keep, force, kept)
    return index, keep_len


def rank_entries(
    scores: Tensor, valid: Tensor, keep: Tensor, force: Tensor | None = None, kept: list[int] | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Pick the ``keep[b]`` best-scoring valid slots per (sample, KV head), returned ascending.

    Args:
        scores: ``(B, H_kv, S)`` higher = keep; ties go to the lower slot; NaN counts as +inf.
        valid: ``(B, 1 or H_kv, S)`` bool, selectable slots.
        keep: ``(B,)`` int64 number to keep (clamped to the valid count).
        force: optional ``(B, 1 or H_kv, S)`` bool, slots always kept (counted within ``keep``).
        kept: optional host values of ``keep`` clamped to the valid count, when the caller knows
            them (the shapes below are then decided without reading anything back).

    Returns:
        ``index (B, H_kv, K)`` with ``K = max(keep)``, ``keep_len (B,)`` and, where the selection
        found them on the way (each row drops its one lowest), the dropped columns ``(B, H_kv, 1)``
        (else None).
    """
    b, h, s = scores.shape
    valid = valid.expand(b, h, s)
    keep = torch.minimum(keep, valid[:, 0].sum(-1))
    # a NaN score ranks as +inf (kept, like a forced slot): the partial selections below compare
    # with == and <, which NaN fails, and a full sort ranks NaN highest anyway
    ranked = score_ops.rank_keys(scores, valid, None if force is None else force.expand(b, h, s))
    drop = s - keep
    if kept is None:  # the bounds every shape below needs, in one read back
        kmin, kmax = torch.stack([keep.min(), keep.max()]).tolist() if b else (s, 0)
    else:
        kmin, kmax = min(kept, default=s), max(kept, default=0)
    if (s - kmin) * 4 <= s:
        # a decode step evicts a few entries of many: find the few (a partial selection), not a full
        # sort of the many — the same set the stable sort keeps
        bounds = (s - kmin, s - kmax)
        if bounds == (1, 1):
            index, last = _drop_one(ranked)
            return index, keep, last
        return _drop_lowest(ranked, drop, bounds), keep, None
    if kmax > 0 and kmax * 4 <= s:
        # a few kept of many (a core, a small budget's prompt): find the few, not a sort of the many
        return _keep_highest(ranked, keep, kmax), keep, None
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    k = max(kmax, 1)
    top = order[..., :k]
    ranks = torch.arange(k, device=scores.device)[None, None, :]
    top = torch.where(ranks < keep[:, None, None], top, torch.full_like(top, s))  # push padding last
    top = torch.sort(top, dim=-1).values
    return top.masked_fill(top == s, 0), keep, None


def _keep_highest(ranked: Tensor, keep: Tensor, kmax: int) -> Tensor:
    """``ranked (B, H_kv, S)`` float, ``keep (B,)`` (at most ``kmax``, read by the caller) → ascending
    ``(B, H_kv, kmax)`` columns of each row's ``keep[b]`` highest (ties: the lower column first, as
    the stable descending sort of :func:`rank_entries` orders them); padding columns are 0."""
    b, h, s = ranked.shape
    top = torch.topk(ranked, kmax, dim=-1, largest=True, sorted=True).values  # (B, H_kv, kmax)
    cut = top.gather(-1, (keep - 1).clamp(min=0)[:, None, None].expand(b, h, 1))  # keep[b]-th highest
    above, tied = ranked > cut, ranked == cut
    need = keep[:, None, None] - above.sum(-1, keepdim=True)  # ties to keep, from the left
    kept = (above | (tied & (tied.cumsum(-1) <= need))) & (keep > 0)[:, None, None]
    # each kept column goes to its rank among the kept; the rest to a spare column cut off below
    dest = torch.where(kept, kept.cumsum(-1) - 1, kmax)
    cols = torch.arange(s, device=ranked.device).expand(b, h, s)
    out = torch.zeros(b, h, kmax + 1, dtype=torch.long, device=ranked.device)
    return out.scatter_(-1, dest, cols)[..., :kmax]


def _drop_one(ranked: Tensor) -> tuple[Tensor, Tensor]:
    """``ranked (B, H_kv, S)`` → ascending ``(B, H_kv, S - 1)`` columns kept when every row drops its
    lowest (among equals the highest column: the first minimum of the reversed row), and the dropped
    column ``(B, H_kv, 1)``; four passes, not a selection."""
    s = ranked.shape[-1]
    last = (s - 1) - ranked.flip(-1).argmin(-1, keepdim=True)  # (B, H_kv, 1)
    return kept_but(last, s), last


def kept_but(last: Tensor, s: int) -> Tensor:
    """``(B, H_kv, s - 1)`` ascending columns of ``[0, s)`` without each row's ``last (B, H_kv, 1)``."""
    kept = torch.arange(s - 1, device=last.device)
    # a ``where``, not ``kept + (kept >= last)``: that int64 + bool broadcast takes torch's casting
    # path, ~20x slower (54 vs 2.8 ms at (120, 5, 4099) on the 2-core EPYC VM; the same values)
    return torch.where(kept >= last, kept + 1, kept).expand(*last.shape[:2], s - 1)


def drop_one_each(
    scores: list[Tensor],
    valid: Tensor,
    force: Tensor | None,
    kept: list[int],
    rows: list[int] | None = None,
    per_row: bool = False,
) -> Tensor | None:
    """The column each row of every ``scores[g] (B, H_kv, S)`` drops when every row drops its one
    lowest (``kept[b] == S - 1`` for every sample: the case :func:`rank_entries` takes by
    :func:`_drop_one`), read from the score tables where they lie (``kv.score_ops.lowest_columns``):
    ``(G·B, H_kv, 1)``, the same columns as :func:`rank_entries` of the stacked scores. None where
    rows drop other counts (the caller ranks the stacked scores).

    ``per_row``: the edits are split per sample before they are applied (a scheduler cohort's rows,
    ``policies.cohort``), ``rows[b]`` the entries sample ``b`` holds (host; ``valid`` their prefixes),
    which may differ: each row drops one of its own (``kept[b] == rows[b] - 1``), its lowest valid
    column, the one :func:`rank_entries` drops (its columns past ``rows[b]`` rank lowest there and go
    first), or keeps all it holds (``kept[b] == rows[b]``: its column is not meaningful, the caller
    gives it no edit)."""
    s = scores[0].shape[-1]
    if rows is None or not per_row:  # a batch cache's rows, applied together: each drops one of ``S``
        if s < 4 or any(k != s - 1 for k in kept):
            return None
        return score_ops.lowest_columns(scores, valid, force)
    drops = [n - k for n, k in zip(rows, kept)]
    if min(rows) < 4 or max(drops) != 1 or min(drops) < 0:
        return None
    if min(rows) == max(rows) == s:
        return score_ops.lowest_columns(scores, valid, force)
    return score_ops.lowest_columns(scores, valid, force, ragged=True)


def _drop_lowest(ranked: Tensor, drop: Tensor, bounds: tuple[int, int] | None = None) -> Tensor:
    """``ranked (B, H_kv, S)`` float, ``drop (B,)`` → ascending ``(B, H_kv, max(S - drop))`` columns
    kept when each row drops its ``drop[b]`` lowest (ties: the higher column goes first, as the
    stable descending sort of :func:`top_entries` orders them); padding columns are 0. ``bounds``:
    ``(max, min)`` of ``drop`` when the caller knows them (else read back)."""
    b, h, s = ranked.shape
    dmax, dmin = torch.stack([drop.max(), drop.min()]).tolist() if bounds is None else bounds
    width = max(s - dmin, 1)
    cols = torch.arange(s, device=ranked.device).expand(b, h, s)
    if dmax == 0:
        return cols[..., :width].clone()
    if dmax == 1 and dmin == 1:  # every row drops one (a per-step eviction)
        return _drop_one(ranked)[0]
    lowest = torch.topk(ranked, dmax, dim=-1, largest=False, sorted=True).values  # (B, H_kv, dmax)
    cut = lowest.gather(-1, (drop - 1).clamp(min=0)[:, None, None].expand(b, h, 1))  # drop[b]-th lowest
    below, tied = ranked < cut, ranked == cut
    need = drop[:, None, None] - below.sum(-1, keepdim=True)  # ties to drop, from the right
    from_right = tied.flip(-1).cumsum(-1).flip(-1)
    kept = ~(below | (tied & (from_right <= need))) | (drop == 0)[:, None, None]
    # each kept column goes to its rank among the kept; the rest to a spare column cut off below
    dest = torch.where(kept, kept.cumsum(-1) - 1, width)
    out = torch.zeros(b, h, width + 1, dtype=torch.long, device=ranked.device)
    return out.scatter_(-1, dest, cols)[..., :width]
