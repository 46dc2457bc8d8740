"""``local`` (StreamingLLM): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.policies.base import CutEdit, sink_mask
from vlkv.runtime.policies.scorer import ScorePolicy


@dataclass
class LocalPolicy(ScorePolicy):
    """Keep the first ``sinks`` entries and the most recent ones, ``budget`` of the tokens in all.

    Score: recency (entries sit in the table in the order they came); the sinks are protected.

    Attributes:
        sinks: leading entries always kept (StreamingLLM's attention sinks), >= 0.
    """

    sinks: int = 4

    name: ClassVar[str] = "local"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("sinks",)
    evicts_during_decode: ClassVar[bool] = True
    can_defer_edits: ClassVar[bool] = True
    cohort_decode: ClassVar[str | None] = "any_step"  # batched over requests (``policies.cohort``)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def score(self, layer, stats, ctx):
        width = layer.max_length
        return (
            torch.arange(width, device=layer.lengths.device)
            .float()
            .expand(layer.batch, layer.kv_heads, width)
        )

    def protect(self, layer, width, keep):
        return sink_mask(layer.lengths, width, self.sinks)

    def min_keep(self) -> int:
        return self.sinks + 1

    def select(self, cache, inputs, ctx, keep):
        """The top of :meth:`score` with the sinks protected is one run per sample, the oldest after
        the sinks (``[sinks, sinks + over)``): a :class:`CutEdit`, which moves only the entries after
        it instead of ranking and gathering every table (equal to the shared selection, tested)."""
        lengths = cache.lengths()  # (L, B)
        target = torch.stack([k.to(lengths) for k in keep])
        over = lengths - torch.minimum(target, lengths)
        counts = over.tolist()  # the step's one read back: every layer's cut on the host
        if not any(any(row) for row in counts):
            return [None] * len(cache.layers)
        start = torch.full_like(over[0], self.sinks)
        starts = [self.sinks] * start.shape[0]
        return [CutEdit(start, o, (starts, f)) if any(f) else None for o, f in zip(over, counts)]
