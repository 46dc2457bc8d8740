"""``local`` (StreamingLLM): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import CutEdit, Policy, PolicyContext


@dataclass
class LocalPolicy(Policy):
    """Keep the first ``sinks`` entries and the most recent ones, ``budget`` of the tokens in all.

    Attributes:
        sinks: leading entries always kept (StreamingLLM's attention sinks), >= 0.
    """

    sinks: int = 4

    name: ClassVar[str] = "local"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("sinks",)
    evicts_during_decode: ClassVar[bool] = True
    can_defer_edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def _keep(self, cache: KVCache, target: Tensor) -> list[CutEdit | None]:
        """Per layer, hold at most ``target (B,)`` entries: the ``sinks`` first and the most recent.

        Entries sit in the table in the order they came, so what goes is one run per sample, the
        oldest after the sinks (``[sinks, sinks + over)``): a :class:`CutEdit`, which moves only the
        entries after it instead of ranking and gathering every table."""
        lengths = cache.lengths()  # (L, B)
        over = lengths - torch.minimum(target.to(lengths)[None, :], lengths)
        if not bool(over.any()):
            return [None] * len(cache.layers)
        start = torch.full_like(over[0], self.sinks)
        return [CutEdit(start, o) if any(f) else None for o, f in zip(over, over.tolist())]

    def after_prefill(self, cache, stats, ctx: PolicyContext):
        return self._keep(cache, self.prompt_keep(ctx.prompt_lengths, min_keep=self.sinks + 1))

    def decode_edits(self, cache, ctx: PolicyContext):
        return self._keep(cache, self.decode_target(cache, min_keep=self.sinks + 1))
