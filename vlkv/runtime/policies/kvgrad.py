"""``kvgrad`` (KVgrad, openreview cg1wTCJjjk): KVzip's replay, each attention weighted by its effect.

The score of entry ``c`` in layer ``l`` is ``max over replay rows p and query heads h`` of
``A[h, p, c] · ||W_O,h v_c|| · ||d Phi / d a_p||``: the attention times the size of what the entry
writes into the residual stream through head ``h`` (input) times how much the objective
``Phi = sum_p ||h_p^L||^2`` on the replay rows' last hidden states moves with the row's attention
output ``a_p`` (gradient), an input × gradient attribution. It needs a backward pass per replay
chunk, so only the PyTorch backend runs it. Selection, budgets and sinks are :mod:`kvzip`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlkv.runtime.policies.kvzip import KVzipPolicy


@dataclass
class KVgradPolicy(KVzipPolicy):
    """Attributes: as :class:`KVzipPolicy`; ``chunk_size`` defaults to 512 (a finer gradient signal
    per chunk, KVgrad's default)."""

    chunk_size: int = 512

    name: ClassVar[str] = "kvgrad"
    gradient: ClassVar[bool] = True
