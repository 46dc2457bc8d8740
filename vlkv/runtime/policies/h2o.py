"""``h2o`` (Heavy-Hitter Oracle): accumulated attention picks heavy hitters, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import (
    LayerEdit,
    Policy,
    PolicyContext,
    check_range,
    evict_to,
    per_kv_head,
    recent_mask,
)

SCORE = "h2o"


@dataclass
class H2OPolicy(Policy):
    """Per KV head, keep the entries with the largest attention received so far plus recent ones.

    Attributes:
        heavy_ratio: share of the kept entries chosen by score, in [0, 1]; the rest is the
            most recent window (H2O's default split is half/half).
    """

    heavy_ratio: float = 0.5

    name: ClassVar[str] = "h2o"
    evicts_during_decode: ClassVar[bool] = True
    can_defer_edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("heavy_ratio", self.heavy_ratio, 0.0, 1.0, low_open=False)

    def prefill_request(self, ctx, rows):
        return StatsRequest()

    def decode_request(self, cache, ctx):
        return StatsRequest(exact_output=self.budget >= 1)

    def _accumulate(self, cache: KVCache, stats: list, ctx: PolicyContext) -> None:
        for layer, st in zip(cache.layers, stats):
            score = layer.ensure_score(SCORE)
            s = st.colsum.shape[-1]
            score[:, :, :s] += per_kv_head(st.colsum, ctx.num_kv_heads)

    def _evict(self, cache: KVCache, target: torch.Tensor) -> list[LayerEdit | None]:
        def recent(layer, width, keep):
            return recent_mask(
                layer.lengths, width, keep - torch.round(keep.double() * self.heavy_ratio).long()
            )

        return evict_to(cache, target, lambda layer, width: layer.scores[SCORE][:, :, :width], recent)

    def after_prefill(self, cache, stats, ctx):
        self._accumulate(cache, stats, ctx)
        return self._evict(cache, self.prompt_keep(ctx.prompt_lengths))

    def observe(self, cache, stats, ctx):
        self._accumulate(cache, stats, ctx)

    def decode_edits(self, cache, ctx):
        return self._evict(cache, self.decode_target(cache))
