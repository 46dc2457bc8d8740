"""The backend side of the seam: run one model step on a :class:`~vlkv.runtime.cache.KVCache`.

A backend (PyTorch today; ONNX Runtime and TensorRT behind the same interface) owns the
model weights and executes a prefill or decode step. It appends the step's new K/V to the
cache, returns logits, and, when asked, attention *statistics* for chosen query rows. It
never decides what to keep: policies do that from the statistics it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache


@dataclass
class StatsRequest:
    """Which attention statistics a policy needs from the next step.

    Attributes:
        rows: ``(B, q)`` bool, the query rows of this step whose softmax rows are summed
            (None = every valid row).
        threshold: relative threshold ``p``: also count entries below ``p × row max``
            (VL-Cache sparsity); None = no counts.
        layers: restrict to these layer indices (None = every layer).
    """

    rows: Tensor | None = None
    threshold: float | None = None
    layers: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.threshold is not None and not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


@dataclass
class StepInputs:
    """One step's new tokens for every sample, right-padded.

    Attributes:
        input_ids: ``(B, q)`` int64 token ids (ignored where ``inputs_embeds`` is given).
        positions: ``(B, q, P)`` int64 RoPE positions of the new tokens.
        modality: ``(B, q)`` int8 :class:`~vlkv.runtime.cache.Modality` codes.
        new_len: ``(B,)`` int64 valid rows per sample (rows past it are padding).
        inputs_embeds: optional ``(B, q, hidden)`` embeddings (prefill with image features spliced in).
        all_logits: return logits for every row (teacher forcing) instead of the last valid one.
    """

    input_ids: Tensor
    positions: Tensor
    modality: Tensor
    new_len: Tensor
    inputs_embeds: Tensor | None = None
    all_logits: bool = False

    def __post_init__(self) -> None:
        b, q = self.input_ids.shape
        if self.positions.shape[:2] != (b, q):
            raise ValueError(
                f"positions must be (B, q, P) = ({b}, {q}, P), got {tuple(self.positions.shape)}"
            )
        if int(self.new_len.min()) < 0 or int(self.new_len.max()) > q:
            raise ValueError(f"new_len must be in [0, {q}]")


@dataclass
class StepOutput:
    """What a step returns.

    Attributes:
        logits: ``(B, V)`` float32 logits of each sample's last valid row, or ``(B, q, V)`` with ``all_logits``.
        stats: per layer, :class:`vlkv.plugins.AttnStats` (``colsum (B, H, S)`` over the slots the
            layer held after the step's append) or None where not requested.
    """

    logits: Tensor
    stats: list


class Backend(Protocol):
    """What the engine needs from a backend."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pos_dims: int
    dtype: torch.dtype
    device: torch.device

    def embed(self, batch) -> Tensor:
        """``(B, T, hidden)`` prompt embeddings with image features spliced in."""

    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        """Run the model on ``inputs``, append their K/V to ``cache``, return logits and stats."""
