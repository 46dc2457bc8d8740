"""The backend side of the seam: run one model step on a :class:`~vlkv.runtime.cache.KVCache`.

A backend (PyTorch today; ONNX Runtime and TensorRT behind the same interface) owns the
model weights and executes a prefill or decode step. It appends the step's new K/V to the
cache, returns logits, and, when asked, attention *statistics* for chosen query rows. It
never decides what to keep: policies do that from the statistics it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache
from vlkv.runtime.models.adapter import FamilyAdapter


@dataclass
class StatsRequest:
    """Which attention statistics a policy needs from the next step.

    Attributes:
        rows: ``(B, q)`` bool, the query rows of this step whose softmax rows are summed
            (None = every valid row).
        threshold: relative threshold ``p``: also count entries below ``p × row max``
            (VL-Cache sparsity); None = no counts.
        layers: restrict to these layer indices (None = every layer).
        extra: further named row sets computed in the same pass (e.g. an allocator's post-vision
            rows next to a scorer's observation window); their results come back in
            :attr:`StepStats.extra` under the same names. Nested ``extra`` is not allowed.
        exact_output: the step's attention output must be the backend's plain attention, bit for bit
            what a step without statistics computes (a policy that evicts nothing at budget 1
            equals the full cache). Otherwise a backend may derive the output from the statistics'
            own probabilities, reading the keys once (equal within rounding).
    """

    rows: Tensor | None = None
    threshold: float | None = None
    layers: frozenset[int] | None = None
    extra: dict[str, StatsRequest] = field(default_factory=dict)
    exact_output: bool = False

    def __post_init__(self) -> None:
        if self.threshold is not None and not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if any(sub.extra for sub in self.extra.values()):
            raise ValueError("extra requests cannot have extra requests of their own")

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


class StepStats(list):
    """Per-layer statistics of a step's main :class:`StatsRequest` (a list, None where not
    requested), plus ``extra[name]``: the per-layer list of each named extra request, and
    ``replay``: after a prefill, the per-layer ``(B, H_kv, S)`` replay scores a query-agnostic
    policy asked for (:mod:`vlkv.runtime.replay`), else None."""

    def __init__(self, layers: list, extra: dict[str, list] | None = None):
        super().__init__(layers)
        self.extra: dict[str, list] = extra or {}
        self.replay: list | None = None


@dataclass
class AttendIndex:
    """The past entries one layer's decode attention reads (A-VL's "core" computation).

    The step's new row always attends to its own new entry as well, so only past slots are listed.
    Used with single-row steps; the backend really computes over the gathered rows (no mask over
    the full cache).

    Attributes:
        indices: ``(B, H_kv, K)`` int64 cache slots, ascending within ``[:lengths[b, h]]``; the tail
            is padding (any value).
        lengths: ``(B, H_kv)`` int64 valid indices per sample and KV head.
    """

    indices: Tensor
    lengths: Tensor

    def __post_init__(self) -> None:
        if self.indices.dim() != 3 or self.lengths.shape != self.indices.shape[:2]:
            raise ValueError(
                f"indices must be (B, H_kv, K) and lengths (B, H_kv), got {tuple(self.indices.shape)} "
                f"and {tuple(self.lengths.shape)}"
            )


@dataclass
class RowFilter:
    """Drop prompt rows' hidden states after one layer (FastV-style; A-VL's prefill filter P).

    Layers after ``after_layer`` run on the kept rows only, with their original positions, so
    their caches never hold the dropped tokens; earlier layers keep every row.

    Attributes:
        after_layer: index of the last layer that sees every row, >= 0.
        choose: ``(stats, layer) -> keep`` where ``stats`` is the step's :class:`StepStats` filled up
            to ``layer`` and ``keep`` is ``(B, q)`` bool over the step's rows. Each sample's last valid
            row is always kept (it produces the logits).
    """

    after_layer: int
    choose: Callable[[StepStats, int], Tensor]

    def __post_init__(self) -> None:
        if self.after_layer < 0:
            raise ValueError(f"after_layer must be >= 0, got {self.after_layer}")


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
        attend: optional per-layer :class:`AttendIndex` (None entries = the whole cache); only for
            single-row steps.
        row_filter: optional :class:`RowFilter` applied inside the layer loop.
        order: optional ``(B, q)`` int64 sequence index of each new row (default: right after the
            tokens the cache has processed).
        selective: a *link* step (MPIC): the new rows are a non-contiguous selection of the prompt
            and attend by sequence order — row ``i`` sees every cached or new entry whose order is
            ``<= order[i]`` — instead of by slot; needs ``order``, no statistics.
        new_len_host: optional ``new_len`` as Python ints, from a caller that built it (the step
            plan): checked here and read by the backend instead of ``new_len``, so neither reads it back.
    """

    input_ids: Tensor
    positions: Tensor
    modality: Tensor
    new_len: Tensor
    inputs_embeds: Tensor | None = None
    all_logits: bool = False
    attend: list[AttendIndex | None] | None = None
    row_filter: RowFilter | None = None
    order: Tensor | None = None
    selective: bool = False
    new_len_host: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        b, q = self.input_ids.shape
        if self.positions.shape[:2] != (b, q):
            raise ValueError(
                f"positions must be (B, q, P) = ({b}, {q}, P), got {tuple(self.positions.shape)}"
            )
        host = self.new_len_host
        if host is not None and len(host) != b:
            raise ValueError(f"new_len_host must hold B = {b} values, got {len(host)}")
        if host is not None and not all(0 <= n <= q for n in host):
            raise ValueError(f"new_len must be in [0, {q}]")
        if host is None and (int(self.new_len.min()) < 0 or int(self.new_len.max()) > q):
            raise ValueError(f"new_len must be in [0, {q}]")
        if self.attend is not None and q != 1:
            raise ValueError(f"attend indices need single-row steps, got q = {q}")
        if self.row_filter is not None and self.all_logits:
            raise ValueError("row_filter drops rows, so it cannot be combined with all_logits")
        if self.order is not None and tuple(self.order.shape) != (b, q):
            raise ValueError(f"order must be (B, q) = ({b}, {q}), got {tuple(self.order.shape)}")
        if self.selective and (self.order is None or self.attend is not None or self.row_filter is not None):
            raise ValueError("a selective step needs order, and takes no attend indices or row filter")


@dataclass
class StepOutput:
    """What a step returns.

    Attributes:
        logits: ``(B, V)`` float32 logits of each sample's last valid row, or ``(B, q, V)`` with ``all_logits``.
        stats: :class:`StepStats`; per layer, :class:`vlkv.plugins.AttnStats` (``colsum (B, H, S)``
            over the slots the layer held after the step's append; with an :class:`AttendIndex`, over
            the attended slots only, zeros elsewhere) or None where not requested.
        attended: optional ``(L, B)`` float64 K/V entries each layer's last valid row attended,
            averaged over KV heads (the "used" cache of A-VL's Table 3).
        peak_kv_bytes: K/V bytes the cache held right after the step's append, before any policy
            edit (set by the engine; a prefill's peak is the whole prompt).
    """

    logits: Tensor
    stats: list
    attended: Tensor | None = None
    peak_kv_bytes: int | None = None


class Backend(Protocol):
    """What the engine needs from a backend."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pos_dims: int
    dtype: torch.dtype
    device: torch.device
    # family knowledge (positions, image-token layout) the engine uses to encode prompts; backends
    # that run no PyTorch decoder still expose it, since prompt encoding is backend-independent
    adapter: FamilyAdapter
    # runs selective (link) steps: attention masked by sequence order over non-contiguous rows
    supports_link: bool

    def embed(self, batch) -> Tensor:
        """``(B, T, hidden)`` prompt embeddings with image features spliced in."""

    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        """Run the model on ``inputs``, append their K/V to ``cache``, return logits and stats."""
