"""``local`` (StreamingLLM): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import LayerEdit, Policy, PolicyContext, evict_to, sink_mask


@dataclass
class LocalPolicy(Policy):
    """Keep the first ``sinks`` entries and the most recent ones, ``budget`` of the tokens in all.

    Attributes:
        sinks: leading entries always kept (StreamingLLM's attention sinks), >= 0.
    """

    sinks: int = 4

    name: ClassVar[str] = "local"
    evicts_during_decode: ClassVar[bool] = True
    can_defer_edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def _keep(self, cache: KVCache, target) -> list[LayerEdit | None]:
        def recency(layer, width):  # later slots rank higher
            b, h = layer.batch, layer.kv_heads
            return torch.arange(width, dtype=torch.float32, device=layer.device)[None, None, :].expand(
                b, h, width
            )

        return evict_to(
            cache, target, recency, lambda layer, width, keep: sink_mask(layer.lengths, width, self.sinks)
        )

    def after_prefill(self, cache, stats, ctx: PolicyContext):
        return self._keep(cache, self.prompt_keep(ctx.prompt_lengths, min_keep=self.sinks + 1))

    def decode_edits(self, cache, ctx: PolicyContext):
        return self._keep(cache, self.decode_target(cache, min_keep=self.sinks + 1))
