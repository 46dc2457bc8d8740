"""Compressed records: keep a query-agnostic share of an image's entries when its record is written.

The choice is head-uniform — the same entries in every layer and KV head — so one ``(m,)`` offset
list says where each kept entry sits inside the image, and a hit links ``m`` entries (and moves
``m / n`` of the dense K/V bytes). No query is known when a record is written, so the scorers
look at the stored entries alone:

* ``keynorm`` — keep the entries whose keys have the smallest norm, averaged over layers and heads
  after dividing each (layer, head) by its mean norm (a low-norm key draws attention);
* ``stride`` — keep evenly spaced entries (a position-only baseline);
* ``kvzip`` — keep the entries the model attends to most when asked to repeat the image (KVzip's
  replay, :mod:`vlkv.runtime.replay`, run over the image's own cache when the record is made):
  per layer the max over KV heads, over the layer's mean, averaged over layers. It costs a replay
  pass over the image (template + its rows) per new record.

The dropped entries of a linked image are neither linked nor recomputed (unless a link method
recomputes those rows anyway, e.g. MPIC's first ``k``): the request's cache simply lacks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.segments import SharedSegment

RECORD_SCORERS = ("keynorm", "stride", "kvzip")


def entry_offsets(seg: SharedSegment) -> Tensor:
    """``(m,)`` int64 offsets of a record's entries inside its image (all of them unless compressed)."""
    off = getattr(seg, "offsets", None)
    return torch.arange(seg.length, device=seg.modality.device) if off is None else off


def kept_count(n: int, budget: float) -> int:
    """Entries a record of ``n`` keeps at ``budget`` (at least one)."""
    return min(n, max(1, round(budget * n)))


def choose_entries(
    keys: list[Tensor], budget: float, scorer: str = "keynorm", replay: list[Tensor] | None = None
) -> Tensor:
    """``(m,)`` int64 ascending offsets of the entries to keep.

    Args:
        keys: per layer ``(H_kv, n, D)`` pre-RoPE keys of the span.
        budget: fraction of the ``n`` entries kept, in (0, 1].
        scorer: one of :data:`RECORD_SCORERS`.
        replay: for ``kvzip``, per layer ``(H_kv, n)`` replay attention scores of the entries.
    """
    if scorer not in RECORD_SCORERS:
        raise ValueError(f"unknown record scorer {scorer!r}; known: {', '.join(RECORD_SCORERS)}")
    n = keys[0].shape[1]
    m = kept_count(n, budget)
    if m == n:
        return torch.arange(n)
    if scorer == "stride":
        return torch.linspace(0, n - 1, m).round().long().unique()
    if scorer == "kvzip":
        if replay is None:
            raise ValueError("the kvzip record scorer needs the image's replay scores")
        per_layer = torch.stack([s.float().amax(dim=0) for s in replay])  # (L, n)
        per_layer = per_layer / per_layer.mean(dim=-1, keepdim=True).clamp_min(1e-12)
        return per_layer.mean(dim=0).cpu().topk(m).indices.sort().values
    norms = torch.stack([k.float().norm(dim=-1) for k in keys])  # (L, H_kv, n)
    norms = norms / norms.mean(dim=-1, keepdim=True).clamp_min(1e-12)
    score = -norms.mean(dim=(0, 1)).cpu()  # higher = keep
    return score.topk(m).indices.sort().values


def compress_segment(seg: SharedSegment, budget: float, scorer: str = "keynorm") -> SharedSegment:
    """A new segment holding only ``seg``'s chosen entries (``offsets`` set); ``seg`` is released.

    Returns ``seg`` itself when every entry is kept."""
    pool = seg.pool
    keys = [pool.read(layer, ids[None])[0][0] for layer, ids in enumerate(seg.ids)]
    keep = choose_entries(keys, budget, scorer, getattr(seg, "replay_scores", None))
    if keep.numel() == seg.length:
        return seg
    ks, vs = [], []
    for layer, ids in enumerate(seg.ids):
        k, v = pool.read(layer, ids[None, :, keep.to(ids.device)])
        ks.append(k[0])
        vs.append(v[0])
    out = SharedSegment.from_tensors(pool, ks, vs, seg.modality[keep.to(seg.modality.device)])
    out.offsets = keep
    out.embeds = seg.embeds
    seg.release()
    return out


def factor_segment(seg: SharedSegment, rank: int) -> SharedSegment:
    """A new segment whose K/V are ``seg``'s at rank ``rank`` (``seg`` is released).

    Per layer the ``(m, H_kv·D)`` pre-RoPE keys and values (heads concatenated) go through an exact
    truncated SVD and back, so every hit — from the device tier or from bytes — links the same
    rank-``rank`` entries; :meth:`~vlkv.runtime.store.record.Record.to_bytes` then stores the
    factors (``rank`` attribute set). A rank at or above ``min(m, H_kv·D)`` changes nothing but the
    rounding. Returns ``seg`` for ``rank`` 0.
    """
    from vlkv.runtime.kv.lowrank import truncated_svd

    if rank <= 0:
        return seg
    pool = seg.pool
    ks, vs = [], []
    for layer, ids in enumerate(seg.ids):
        k, v = pool.read(layer, ids[None])
        out = []
        for t in (k[0], v[0]):  # (H_kv, m, D)
            h, m, d = t.shape
            bar, basis = truncated_svd(t.permute(1, 0, 2).reshape(m, h * d).float(), rank, exact=True)
            out.append((bar @ basis).view(m, h, d).permute(1, 0, 2).to(t.dtype))
        ks.append(out[0])
        vs.append(out[1])
    new = SharedSegment.from_tensors(pool, ks, vs, seg.modality)
    new.offsets = getattr(seg, "offsets", None)
    new.embeds = getattr(seg, "embeds", None)
    for name in ("replay_scores",):
        if hasattr(seg, name):
            setattr(new, name, getattr(seg, name))
    new.rank = rank
    seg.release()
    return new
