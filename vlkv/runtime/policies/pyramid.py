"""``pyramidkv`` (PyramidKV, Cai et al. 2024): SnapKV's scoring with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlkv.runtime.policies.allocators import STATE_FRACTIONS, PyramidAllocator, per_layer
from vlkv.runtime.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV (observation window, pooled votes, recent window) with the ``pyramid`` allocator:
    layer fractions fall linearly from ``(2 - 1/beta)·budget`` at the first layer to
    ``budget/beta`` at the last, clipped to ``[floor, 1]`` with the mean held at ``budget``.

    PyramidKV's reference code applies the decay to the budget *minus* the window; here it applies
    to the whole per-layer budget, so the window is part of each layer's count (as in ``snapkv``).

    Attributes:
        beta: mean-to-deepest-layer ratio, > 1.
        floor: smallest per-layer fraction, in (0, 1].
    """

    beta: float = 20.0
    floor: float = 0.01

    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        PyramidAllocator(floor=self.floor, beta=self.beta)  # validates beta and floor

    def after_prefill(self, cache, stats, ctx):
        allocator = PyramidAllocator(floor=self.floor, beta=self.beta)
        fr = allocator.fractions(self.budget, ctx.prompt_lengths, len(cache.layers))
        cache.policy_state[STATE_FRACTIONS] = fr
        return per_layer(SnapKVPolicy.after_prefill, self, fr, cache, stats, ctx)
