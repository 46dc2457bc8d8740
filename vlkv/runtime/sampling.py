"""Token choice from logits: greedy, or seeded sampling with temperature / top-k / top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Sampler:
    """Greedy when ``do_sample`` is False; otherwise sampling with a private seeded generator.

    Attributes:
        temperature: finite, > 0. top_k: 0 = off, else >= 1. top_p: in (0, 1]. seed: generator seed.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    _gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each check is written to pass only for good values.
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """``logits (B, V)`` → ``(B,)`` int64 tokens."""
        if not self.do_sample:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > self.top_p  # keep the token that crosses top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1).cpu()
        return torch.multinomial(probs, 1, generator=self._gen).squeeze(-1).to(logits.device)
