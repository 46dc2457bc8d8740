"""Which stored image rows a link step recomputes (the rest of each stored image is linked).

* ``full-reuse``: none;
* ``cacheblend``: the fraction ``r`` of all stored rows whose check-layer K/V deviates most
  (:func:`vlkv.runtime.link.cacheblend.blend_rows`);
* ``mpic``, by :attr:`LinkSpec.pick`:

  - ``first`` (MPIC): each image's first ``k`` tokens;
  - ``ramp``: the same total, ``k`` per image on average, spread linearly over the stored images
    in prompt order (the j-th of N gets about ``2k·j/(N+1)``): a record is computed without the
    pictures before it, so a later picture's entries miss more of the prompt (measured on the
    trained ``smollm2-llava``: the first picture's record is exact, the deviation grows with the
    picture's place; docs/benchmarks/2026-11-27-link11-cpu-x86_64).

Choosing each image's ``k`` rows by CacheBlend's check-layer deviation instead of the first ``k`` was
measured there too and was worse (the first rows are already the ones deviating most): not offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.cacheblend import blend_rows

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
        emb: ``(1, n, hidden)`` the prompt's embeddings (CacheBlend's check pass).
    """
    host = batch.input_ids.device
    empty = torch.zeros(0, dtype=torch.long, device=host)
    if not hits or spec.method not in ("mpic", "cacheblend"):
        return empty
    if spec.method == "cacheblend":
        return blend_rows(engine, batch, emb, hits, spec)
    spans = batch.spans[0].image_spans
    order = sorted(hits)
    sizes = [spans[i][1] - spans[i][0] for i in order]
    counts = ramp_counts(sizes, spec.k) if spec.pick == "ramp" else [min(spec.k, s) for s in sizes]
    out = [torch.arange(spans[i][0], spans[i][0] + c, device=host) for i, c in zip(order, counts)]
    return torch.cat(out) if out else empty
