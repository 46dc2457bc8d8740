"""``vlcache`` (VL-Cache, Tu et al. ICLR 2025): post-vision attention sizes each layer and ranks its
entries, once, right after prefill. See ``methods.md`` §2 and ``docs/policies-modality.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.policies.allocators import (
    ALLOCATORS,
    Allocator,
    SparsityAllocator,
    make_allocator,
    post_vision_mask,
)
from vlkv.runtime.policies.base import check_range, per_kv_head, recent_mask
from vlkv.runtime.policies.scorer import ScorePolicy

HEAD_MODES = ("kv", "layer")


def token_scores(colsum: Tensor, num_kv_heads: int, mode: str = "kv") -> Tensor:
    """Post-vision token scores ``(B, H_kv, S)`` from column sums ``colsum (B, H, S)``.

    ``"kv"``: each KV head ranks by the sum over its GQA group of query heads (the entries of a KV
    head serve exactly those query heads). ``"layer"``: one ranking per layer, the sum over all heads,
    shared by every KV head.
    """
    if mode == "kv":
        return per_kv_head(colsum, num_kv_heads)
    return colsum.sum(1, keepdim=True).expand(-1, num_kv_heads, -1)


@dataclass
class VLCachePolicy(ScorePolicy):
    """VL-Cache.

    Prefill statistics come from the post-vision rows ``P`` (language tokens after the last image;
    the last ``fallback_rows`` rows when an image ends the prompt; every row without images).
    Layer ``l`` keeps ``k_l`` entries, from the allocator (default: sparsity, Algorithm 1 with
    ``threshold = p``): the most recent ``floor(recent_ratio · k_l)`` plus the best-scoring older ones
    by post-vision column sums, visual and text keys in one ranking. Nothing is evicted while
    decoding; new tokens continue the original positions.

    Attributes:
        threshold: relative threshold ``p`` of Eq. 1, in (0, 1).
        recent_ratio: share of each layer's budget kept as the recent window, in [0, 1].
        fallback_rows: post-vision rows when the image is last, >= 1.
        allocator: ``"sparsity"``, ``"pyramid"`` or ``"uniform"`` (ablations).
        floor: smallest per-layer fraction, in (0, 1].
        redistribute: keep the layer mean at ``budget`` after clipping (the paper does not).
        heads: ``"kv"`` (rank per KV head, GQA group sums) or ``"layer"`` (one ranking per layer).
    """

    threshold: float = 0.01
    recent_ratio: float = 0.1
    fallback_rows: int = 50
    allocator: str = "sparsity"
    floor: float = 0.01
    redistribute: bool = True
    heads: str = "kv"

    name: ClassVar[str] = "vlcache"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold (VL-Cache's p) must be in (0, 1), got {self.threshold}")
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0, low_open=False)
        if self.fallback_rows < 1:
            raise ValueError(f"fallback_rows must be >= 1, got {self.fallback_rows}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {tuple(ALLOCATORS)}, got {self.allocator!r}")
        if self.heads not in HEAD_MODES:
            raise ValueError(f"heads must be one of {HEAD_MODES}, got {self.heads!r}")
        self.make_allocator()  # validates floor

    def make_allocator(self) -> Allocator:
        if self.allocator == "sparsity":
            return SparsityAllocator(
                floor=self.floor,
                redistribute=self.redistribute,
                threshold=self.threshold,
                fallback_rows=self.fallback_rows,
            )
        return make_allocator(self.allocator, floor=self.floor, redistribute=self.redistribute)

    def prefill_request(self, ctx, rows):
        return StatsRequest(rows=post_vision_mask(ctx, rows, self.fallback_rows), threshold=self.threshold)

    def layer_fractions(self, cache, stats, ctx):
        return self.make_allocator().fractions(self.budget, ctx.prompt_lengths, len(cache.layers), stats)

    def score(self, layer, stats, ctx):
        return token_scores(stats.colsum, ctx.num_kv_heads, self.heads)

    def protect(self, layer, width, keep):
        return recent_mask(layer.lengths, width, torch.floor(keep.double() * self.recent_ratio).long())
