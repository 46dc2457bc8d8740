"""Budgets decided by the scores themselves: one ranking over heads (and layers) says how many
entries each KV head (``adaptive``, KVzip's non-uniform head budgets, AdaKV's idea) or each layer
(``scope="model"``) keeps. Any :class:`~vlkv.runtime.policies.scorer.ScorePolicy` gets them by
returning ``"adaptive"`` / ``"model"`` from ``head_budgets()`` / ``layer_scope()``.

Every function takes, per layer, the scores ``(B, H_kv, W_l)`` (``W_l`` = that layer's longest
sample) and the protected entries ``(B, 1 or H_kv, W_l)`` bool (or None), which rank first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache, LayerKV
from vlkv.runtime.policies.base import LayerEdit, valid_slots
from vlkv.runtime.policies.ranking import top_entries


def ranked(layer: LayerKV, score: Tensor, forced: Tensor | None) -> Tensor:
    """``(B, H_kv, W)`` float32: ``score`` with invalid slots -inf and protected ones +inf."""
    width = score.shape[2]
    valid = valid_slots(layer, width).expand_as(score)
    out = score.float().masked_fill(~valid, float("-inf"))
    return out if forced is None else out.masked_fill(forced.expand_as(score) & valid, float("inf"))


def head_counts(cache: KVCache, ranks: list[Tensor], keep: Tensor, scope: str) -> Tensor:
    """``(L, B, H_kv)`` int64 entries each (layer, sample, head) keeps: its picks in one ranking
    of ``H_kv · k_b`` entries per layer (over every layer with ``scope="model"``, each layer
    alone with ``scope="layer"``), at least one per head. ``ranks``: per layer, :func:`ranked`."""
    n_layers, (b, heads, _) = len(ranks), ranks[0].shape
    counts = torch.zeros(n_layers, b, heads, dtype=torch.long, device=keep.device)
    groups = [list(range(n_layers))] if scope == "model" else [[i] for i in range(n_layers)]
    for s in range(b):
        for group in groups:
            parts = [ranks[i][s, :, : int(cache.layers[i].lengths[s])] for i in group]
            flat = torch.cat([p.reshape(-1) for p in parts])
            owner = torch.cat(
                [
                    (j * heads + torch.arange(heads, device=p.device))[:, None].expand_as(p).reshape(-1)
                    for j, p in enumerate(parts)
                ]
            )
            total = min(int(keep[s]) * heads * len(group), flat.numel())
            picked = owner[torch.sort(flat, descending=True, stable=True).indices[:total]]
            got = torch.bincount(picked, minlength=heads * len(group)).view(len(group), heads)
            counts[group, s] = got.to(counts.device)
    lengths = torch.stack([layer.lengths for layer in cache.layers]).to(counts.device)  # (L, B)
    return torch.minimum(counts.clamp(min=1), lengths[:, :, None])


def adaptive_edits(
    cache: KVCache, scores: list[Tensor], forced: list[Tensor | None], keep: Tensor, scope: str
) -> list[LayerEdit]:
    """Per-head budgets: each layer keeps, per head, its top ``width`` entries (``width`` = the
    fullest head's count, from :func:`head_counts`) and marks the ones past the head's own count as
    holes. ``keep (B,)``: entries per KV head a sample keeps on average."""
    ranks = [ranked(layer, score, f) for layer, score, f in zip(cache.layers, scores, forced)]
    counts = head_counts(cache, ranks, keep, scope)
    edits = []
    for layer, score, f, rank_in, count in zip(cache.layers, scores, forced, ranks, counts):
        width = score.shape[2]
        index, keep_len = top_entries(score, valid_slots(layer, width), count.amax(1), force=f)
        order = torch.sort(rank_in, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            2, order, torch.arange(width, device=order.device).expand_as(order)
        )
        holes = rank.gather(2, index) >= count.to(rank.device)[:, :, None]
        edits.append(LayerEdit(index, keep_len, holes=holes))
    return edits


def model_layer_keep(
    cache: KVCache, scores: list[Tensor], forced: list[Tensor | None], keep: Tensor, min_keep: int
) -> list[Tensor]:
    """Per layer ``(B,)`` entries per KV head: each layer's share of one model-wide ranking.

    Sample ``b`` keeps ``L · k_b`` entries per head in all; a layer's count is its number of
    (head, entry) picks in the top ``L · H_kv · k_b`` of all layers, divided by ``H_kv``, rounded,
    then the rounding error is settled on the layers closest to the next integer; each layer keeps at
    least ``min(min_keep, k_b)``.
    """
    n_layers, b = len(scores), keep.shape[0]
    ranks = [ranked(layer, score, f) for layer, score, f in zip(cache.layers, scores, forced)]
    out = torch.zeros(n_layers, b, dtype=torch.long, device=keep.device)
    heads = scores[0].shape[1]
    for s in range(b):
        flat, owner = [], []
        for i, (layer, rank) in enumerate(zip(cache.layers, ranks)):
            part = rank[s, :, : int(layer.lengths[s])]
            flat.append(part.reshape(-1))
            owner.append(torch.full((part.numel(),), i, dtype=torch.long, device=part.device))
        flat_t, owner_t = torch.cat(flat), torch.cat(owner)
        total = min(int(keep[s]) * n_layers * heads, flat_t.numel())
        picked = owner_t[torch.sort(flat_t, descending=True, stable=True).indices[:total]]
        share = torch.bincount(picked, minlength=n_layers).double() / heads
        lengths = torch.tensor([int(layer.lengths[s]) for layer in cache.layers], device=share.device)
        out[:, s] = round_shares(share, int(keep[s]) * n_layers, min(min_keep, int(keep[s])), lengths)
    return list(out)


def round_shares(share: Tensor, total: int, low: int, high: Tensor) -> Tensor:
    """Integer per-layer counts summing to ``total``, each in ``[low, high[l]]``, closest to ``share (L,)``
    (largest remainders first)."""
    count = torch.minimum(share.floor().long().clamp(min=low), high)
    for _ in range(abs(total - int(count.sum()))):
        diff = total - int(count.sum())
        gap = share - count
        if diff > 0:
            count[int(torch.argmax(gap.masked_fill(count >= high, float("-inf"))))] += 1
        elif diff < 0:
            count[int(torch.argmin(gap.masked_fill(count <= low, float("inf"))))] -= 1
    return count
