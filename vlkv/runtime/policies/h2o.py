"""``h2o`` (Heavy-Hitter Oracle): accumulated attention picks heavy hitters, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.kv import score_ops
from vlkv.runtime.policies.base import check_range, recent_mask
from vlkv.runtime.policies.scorer import ScorePolicy

SCORE = "h2o"


@dataclass
class H2OPolicy(ScorePolicy):
    """Per KV head, keep the entries with the largest attention received so far plus recent ones.

    Score: the attention each entry has received from every row so far (prompt rows, then each
    decode row), summed over the KV head's GQA group; evicts to the budget after prefill and at
    every decode step.

    Attributes:
        heavy_ratio: share of the kept entries chosen by score, in [0, 1]; the rest is the
            most recent window (H2O's default split is half/half).
    """

    heavy_ratio: float = 0.5

    name: ClassVar[str] = "h2o"
    evicts_during_decode: ClassVar[bool] = True
    can_defer_edits: ClassVar[bool] = True
    cohort_decode: ClassVar[str | None] = "any_step"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("heavy_ratio", self.heavy_ratio, 0.0, 1.0, low_open=False)

    def prefill_request(self, ctx, rows):
        return StatsRequest()

    def decode_request(self, cache, ctx):
        return StatsRequest(exact_output=self.budget >= 1)

    def observe(self, cache, stats, ctx):
        scores = [layer.ensure_score(SCORE) for layer in cache.layers]
        score_ops.add_group_sums(scores, [st.colsum for st in stats], ctx.num_kv_heads)

    def score(self, layer, stats, ctx):
        return layer.scores[SCORE]  # (B, H_kv, capacity)

    def protect(self, layer, width, keep):
        recent = keep - torch.round(keep.double() * self.heavy_ratio).long()
        return recent_mask(layer.lengths, width, recent)
