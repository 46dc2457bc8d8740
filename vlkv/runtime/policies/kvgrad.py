"""``kvgrad`` (KVgrad, openreview cg1wTCJjjk): KVzip's replay, each attention weighted by its effect.

The score of entry ``c`` in layer ``l`` is ``max over replay rows p and query heads h`` of
``A[h, p, c] · ||W_O,h v_c|| · ||d Phi / d a_p||``: the attention times the size of what the entry
writes into the residual stream through head ``h`` (input) times how much the objective
``Phi = sum_p ||h_p^L||^2`` on the replay rows' last hidden states moves with the row's attention
output ``a_p`` (gradient), an input × gradient attribution. It needs a backward pass per replay
chunk, so only the PyTorch backend runs it. Selection, budgets and sinks are :mod:`kvzip`'s.

The default is the fast setting (#30): ``attn_grad="values"`` (the backward holds each layer's
attention probabilities constant) and ``replay_dtype="auto"`` (a bf16 replay on hardware with bf16
units): 1.9× a plain prefill instead of 4.1× on a 2-core x86 CPU with bf16 units, with ΔPPL at or below the exact
gradient's on real text. ``exact=True`` (or ``attn_grad="full"``, ``replay_dtype="model"``) is the
exact KVgrad attribution, the reference the fast path is tested against.
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
