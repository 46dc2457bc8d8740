"""``knorm`` (Devoto et al., EMNLP 2024; kvpress's ``KnormPress``): keys with a small L2 norm draw
the most attention, so keep them. A score with no statistics: the prefill asks for none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlkv.runtime.policies.base import sink_mask
from vlkv.runtime.policies.scorer import ScorePolicy

HEADS = ("own", "adaptive")


@dataclass
class KnormPolicy(ScorePolicy):
    """Per KV head, keep the prompt entries whose keys have the smallest norm, once after prefill.

    RoPE rotates pairs of key dimensions, so a stored (post-RoPE) key has its pre-RoPE norm: linked
    entries rotated on read score the same.

    Attributes:
        sinks: first entries always kept, >= 0 (0: kvpress's ``KnormPress`` protects none).
        heads: ``"own"`` (every KV head keeps ``budget`` of the entries) or ``"adaptive"`` (one
            ranking over a layer's heads decides each head's count, AdaKV-style; see ``budgets.py``).
    """

    sinks: int = 0
    heads: str = "own"

    name: ClassVar[str] = "knorm"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("sinks",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")

    def score(self, layer, stats, ctx):
        keys = layer.attention_kv(layer.max_length)[0]  # (B, H_kv, W, D)
        return -keys.float().norm(dim=-1)

    def protect(self, layer, width, keep):
        return sink_mask(layer.lengths, width, self.sinks) if self.sinks else None

    def min_keep(self) -> int:
        return self.sinks + 1

    def head_budgets(self) -> str:
        return self.heads
