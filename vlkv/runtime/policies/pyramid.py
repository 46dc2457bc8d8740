"""``pyramidkv`` (PyramidKV, Cai et al. 2024): SnapKV's scoring with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.policies.allocators import PyramidAllocator
from vlkv.runtime.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV (observation window, pooled votes, recent window) with the ``pyramid`` allocator:
    layer fractions fall linearly from ``(2 - 1/beta)·budget`` at the first layer to
    ``budget/beta`` at the last, clipped to ``[floor, 1]`` with the mean held at ``budget``.

    The window is part of each layer's count (as in ``snapkv`` and in kvpress's ``PyramidKVPress``).

    PyramidKV's reference code (KVCache-Factory) and kvpress fall back to the uniform budget, i.e.
    plain SnapKV, for a sample whose deepest layer would keep fewer than ``window`` entries
    (``budget · n / beta < window``); ``fallback=True`` does the same. With a 1024-token context,
    ``beta = 20`` and ``window = 64`` that is every budget below 1.25: kvpress's ``pyramidkv`` is
    then SnapKV, which is why it beat this pyramid at low budgets (``docs/policies.md``).

    Attributes:
        beta: mean-to-deepest-layer ratio, > 1.
        floor: smallest per-layer fraction, in (0, 1].
        fallback: use the uniform budget when the deepest layer would hold fewer than ``window``
            entries (PyramidKV's and kvpress's rule); False keeps the pyramid at any budget.
    """

    beta: float = 20.0
    floor: float = 0.01
    fallback: bool = False

    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        PyramidAllocator(floor=self.floor, beta=self.beta)  # validates beta and floor

    def layer_fractions(self, cache, stats, ctx):
        allocator = PyramidAllocator(floor=self.floor, beta=self.beta)
        fr = allocator.fractions(self.budget, ctx.prompt_lengths, len(cache.layers))
        if self.fallback:
            deepest = torch.round(fr.min(0).values * ctx.prompt_lengths.double())  # (B,)
            fr[:, deepest < self.window] = float(self.budget)
        return fr
