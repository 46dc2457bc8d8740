"""``local`` (StreamingLLM): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import LayerEdit, Policy, PolicyContext, sink_mask, top_entries, valid_slots


@dataclass
class LocalPolicy(Policy):
    """Keep the first ``sinks`` entries and the most recent ones, ``budget`` of the tokens in all.

    Attributes:
        sinks: leading entries always kept (StreamingLLM's attention sinks), >= 0.
    """

    sinks: int = 4

    name: ClassVar[str] = "local"
    evicts_during_decode: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def _keep(self, cache: KVCache, target) -> list[LayerEdit | None]:
        edits = []
        for layer in cache.layers:
            if bool((layer.lengths <= target).all()):
                edits.append(None)
                continue
            width = layer.max_length
            # recency is the score: later slots rank higher, sinks are forced in
            score = torch.arange(width, dtype=torch.float32)[None, None, :].expand(
                layer.keys.shape[0], layer.keys.shape[1], width
            )
            keep = torch.minimum(target, layer.lengths)
            index, keep_len = top_entries(
                score, valid_slots(layer, width), keep, force=sink_mask(layer.lengths, width, self.sinks)
            )
            edits.append(LayerEdit(index, keep_len))
        return edits

    def after_prefill(self, cache, stats, ctx: PolicyContext):
        return self._keep(cache, self.prompt_keep(ctx.prompt_lengths, min_keep=self.sinks + 1))

    def after_decode(self, cache, stats, ctx: PolicyContext):
        return self._keep(cache, self.decode_target(cache, min_keep=self.sinks + 1))
