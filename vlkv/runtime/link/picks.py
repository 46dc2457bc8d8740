"""Which stored image rows a link step recomputes (the rest of each stored image is linked).

* ``full-reuse``: none;
* ``cacheblend``: the fraction ``r`` of all stored rows whose check-layer K/V deviates most
  (:func:`vlkv.runtime.link.cacheblend.blend_rows`);
* ``mpic``, by :attr:`LinkSpec.pick`:

  - ``first`` (MPIC): each image's first ``k`` tokens;
  - ``ramp``: the same total, ``k`` per image on average, spread linearly over the stored images
    in prompt order (the j-th of N gets about ``2k·j/(N+1)``): a record is computed without the
    pictures before it, so a later picture's entries miss more of the prompt;
  - ``deviation``: each image's ``k`` stored rows whose check-layer K (or V) deviates most from a
    fresh computation in this prompt (CacheBlend's check, one extra pass over the first layers,
    spent per image instead of over all images at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.cacheblend import blend_rows, check_deviation
from vlkv.runtime.link.compress import entry_offsets

if TYPE_CHECKING:
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.prompt import PromptBatch


def ramp_counts(sizes: list[int], k: int) -> list[int]:
    """Recomputed tokens per image, growing with the image's place: ``sum(min(k, s))`` in all.

    Image ``j`` (0-based, of N) gets ``floor(B·(j+1)/(N(N+1)/2))`` of the budget ``B``, at most its
    size; what is left (rounding, full images) goes one token at a time to the latest images with
    room. ``k >= max(sizes)`` recomputes every image whole.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = len(sizes)
    budget = sum(min(k, s) for s in sizes)
    total = n * (n + 1) // 2
    counts = [min(s, budget * (j + 1) // total) for j, s in enumerate(sizes)] if n else []
    left = budget - sum(counts)
    while left > 0:  # the room left is >= left: every count is at most its size
        for j in reversed(range(n)):
            if left and counts[j] < sizes[j]:
                counts[j] += 1
                left -= 1
    return counts


def recompute_rows(
    engine, batch: PromptBatch, emb: Tensor, hits: dict[int, SharedSegment], spec: LinkSpec
) -> Tensor:
    """The prompt rows of stored images ``hits`` (image index → record) that ``spec`` recomputes,
    ``(c,)`` int64 ascending.

    Args:
        emb: ``(1, n, hidden)`` the prompt's embeddings (CacheBlend's and ``deviation``'s check pass).
    """
    host = batch.input_ids.device
    empty = torch.zeros(0, dtype=torch.long, device=host)
    if not hits or spec.method not in ("mpic", "cacheblend"):
        return empty
    if spec.method == "cacheblend":
        return blend_rows(engine, batch, emb, hits, spec)
    spans = batch.spans[0].image_spans
    order = sorted(hits)
    if spec.pick == "deviation":
        counts = [min(spec.k, entry_offsets(hits[i]).numel()) for i in order]
        if sum(counts) == 0:
            return empty
        if all(c == entry_offsets(hits[i]).numel() for i, c in zip(order, counts)):  # every stored row
            return torch.cat([spans[i][0] + entry_offsets(hits[i]).to(host) for i in order]).sort().values
        rows, dev = check_deviation(engine, batch, emb, {i: hits[i] for i in order}, spec.deviation)
        out, at = [], 0
        for i, c in zip(order, counts):
            m = entry_offsets(hits[i]).numel()
            out.append(rows[at : at + m][dev[at : at + m].topk(c).indices.to(host)])
            at += m
        return torch.cat(out).sort().values
    sizes = [spans[i][1] - spans[i][0] for i in order]
    counts = ramp_counts(sizes, spec.k) if spec.pick == "ramp" else [min(spec.k, s) for s in sizes]
    out = [torch.arange(spans[i][0], spans[i][0] + c, device=host) for i, c in zip(order, counts)]
    return torch.cat(out) if out else empty
