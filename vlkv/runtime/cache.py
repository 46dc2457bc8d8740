"""Per-request, per-layer KV-cache state with real (not masked) memory accounting.

Layout, shared by every backend:

* each layer owns its own tensors, so layers can hold different numbers of entries;
* inside a layer, sample ``b`` holds ``lengths[b]`` valid entries, left-aligned in slots
  ``[0, lengths[b])``; slots past that are spare capacity (garbage, never attended);
* every KV head of a sample holds the same number of entries, but may hold *different*
  tokens (per-head selection), so positions/modality are stored per head;
* entries are kept in ascending original position, keys are stored post-RoPE, and each
  entry remembers its original position (3 components for M-RoPE) and its modality.

A compressed cache is a *smaller tensor*: :meth:`LayerKV.select` and :meth:`LayerKV.merge`
allocate exactly ``max(lengths)`` slots, so ``kv_bytes`` measures what is really held.
Future storage kinds (low-rank segments, entries linked from a store) extend
:class:`LayerKV` behind :meth:`LayerKV.attention_kv`, which is all a backend reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch
from torch import Tensor


class Modality(IntEnum):
    """What produced a cache entry."""

    TEXT = 0  # prompt text before the first image (system / instruction prefix)
    IMAGE = 1  # image tokens (incl. LLaVA-1.6 newline tokens)
    POST_TEXT = 2  # prompt text after the first image
    GENERATED = 3  # tokens produced by decoding


# Spare slots added when a layer grows during decode; amortises reallocation while keeping
# the unused tail small relative to real prompts.
GROW_SLOTS = 32


@dataclass
class LayerKV:
    """The cache of one decoder layer for a batch.

    Attributes:
        keys: ``(B, H_kv, C, D)`` post-RoPE keys; ``C`` is the capacity.
        values: ``(B, H_kv, C, D)``.
        lengths: ``(B,)`` int64, valid entries per sample.
        positions: ``(B, H_kv, C, P)`` int64 original positions, ``P`` = 1 (1-D RoPE) or 3 (M-RoPE).
        modality: ``(B, H_kv, C)`` int8 :class:`Modality` codes.
        scores: name → ``(B, H_kv, C)`` float32 running statistics a policy keeps per entry
            (e.g. H2O's accumulated attention); they move with their entry on every edit.
    """

    keys: Tensor
    values: Tensor
    lengths: Tensor
    positions: Tensor
    modality: Tensor
    scores: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        head_dim: int,
        pos_dims: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 0,
    ) -> LayerKV:
        return cls(
            keys=torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device),
            values=torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
            positions=torch.zeros(batch, kv_heads, capacity, pos_dims, dtype=torch.long, device=device),
            modality=torch.zeros(batch, kv_heads, capacity, dtype=torch.int8, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def attention_kv(self, upto: int | None = None) -> tuple[Tensor, Tensor]:
        """Dense K/V a backend attends over: ``(B, H_kv, upto, D)`` views (no copy)."""
        n = self.max_length if upto is None else upto
        return self.keys[:, :, :n], self.values[:, :, :n]

    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors (allocated capacity, padding included)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def used_kv_bytes(self) -> int:
        """Bytes of K/V in valid entries only."""
        per_entry = 2 * self.keys.shape[1] * self.keys.shape[3] * self.keys.element_size()
        return int(self.lengths.sum()) * per_entry

    def meta_bytes(self) -> int:
        tensors = [self.positions, self.modality, self.lengths, *self.scores.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ writes
    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        # the prompt is allocated exactly; decode growth is amortised
        new_cap = needed if self.capacity == 0 else max(needed, self.capacity + GROW_SLOTS)
        extra = new_cap - self.capacity

        def grow(t: Tensor) -> Tensor:
            pad = t.new_zeros(*t.shape[:2], extra, *t.shape[3:])
            return torch.cat([t, pad], dim=2)

        self.keys, self.values = grow(self.keys), grow(self.values)
        self.positions, self.modality = grow(self.positions), grow(self.modality)
        self.scores = {name: grow(s) for name, s in self.scores.items()}

    def append(self, k: Tensor, v: Tensor, positions: Tensor, modality: Tensor, new_len: Tensor) -> Tensor:
        """Write a step's new entries right after each sample's valid entries.

        Args:
            k, v: ``(B, H_kv, q, D)`` new keys (post-RoPE) and values; rows ``>= new_len[b]`` are padding.
            positions: ``(B, q, P)`` int64 original positions of the new tokens.
            modality: ``(B, q)`` int8 codes.
            new_len: ``(B,)`` int64 valid new rows per sample.

        Returns:
            ``(B,)`` lengths before the write (the slot of each sample's first new row).
        """
        b, h, q, _ = k.shape
        past = self.lengths.clone()
        self._reserve(int((past + q).max()))
        slots = past[:, None] + torch.arange(q, device=k.device)[None, :]  # (B, q)
        idx = slots[:, None, :, None].expand(b, h, q, 1)
        self.keys.scatter_(2, idx.expand(-1, -1, -1, k.shape[-1]), k.to(self.keys.dtype))
        self.values.scatter_(2, idx.expand(-1, -1, -1, v.shape[-1]), v.to(self.values.dtype))
        pos = positions[:, None].expand(b, h, q, positions.shape[-1])
        self.positions.scatter_(2, idx.expand(-1, -1, -1, pos.shape[-1]), pos.to(torch.long))
        self.modality.scatter_(2, idx[..., 0], modality[:, None].expand(b, h, q).to(torch.int8))
        for s in self.scores.values():
            s.scatter_(2, idx[..., 0], torch.zeros(b, h, q, dtype=s.dtype, device=s.device))
        self.lengths = past + new_len.to(past)
        return past

    def ensure_score(self, name: str) -> Tensor:
        """A ``(B, H_kv, C)`` float32 running statistic, created as zeros on first use."""
        if name not in self.scores:
            self.scores[name] = torch.zeros(self.keys.shape[:3], dtype=torch.float32, device=self.keys.device)
        return self.scores[name]

    # ------------------------------------------------------------------ edits
    def _take(self, index: Tensor, slots: int) -> dict[str, Tensor]:
        """Gather per-head entries; ``index`` is ``(B, H_kv, K)``, padded with any valid slot."""

        def g(t: Tensor) -> Tensor:
            idx = index
            if t.dim() == 4:
                idx = index[..., None].expand(-1, -1, -1, t.shape[-1])
            out = t.gather(2, idx)
            if out.shape[2] < slots:  # keep spare capacity for appends
                out = torch.cat([out, out.new_zeros(*out.shape[:2], slots - out.shape[2], *out.shape[3:])], 2)
            return out

        return {
            "positions": g(self.positions),
            "modality": g(self.modality),
            **{f"score:{n}": g(s) for n, s in self.scores.items()},
        }

    def select(self, index: Tensor, keep_len: Tensor, spare: int = 0) -> None:
        """Keep only the indexed entries, in the given order, and reallocate to fit.

        Args:
            index: ``(B, H_kv, K)`` int64 slots to keep, ascending within ``[:keep_len[b]]``;
                entries past ``keep_len[b]`` are padding (any in-range slot).
            keep_len: ``(B,)`` int64 entries kept per sample.
            spare: extra slots to allocate for the coming appends.
        """
        k = index.shape[2]
        slots = k + spare
        meta = self._take(index, slots)
        idx = index[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        keys, values = self.keys.gather(2, idx), self.values.gather(2, idx)
        if spare:
            keys = torch.cat([keys, keys.new_zeros(*keys.shape[:2], spare, keys.shape[-1])], 2)
            values = torch.cat([values, values.new_zeros(*values.shape[:2], spare, values.shape[-1])], 2)
        self._install(keys, values, keep_len, meta)

    def merge(self, index: Tensor, keep_len: Tensor, assign: Tensor, counts: Tensor) -> None:
        """Keep the indexed anchors and replace each by the mean of the entries assigned to it.

        Args:
            index: ``(B, H_kv, K)`` anchor slots (their metadata is kept), as in :meth:`select`.
            keep_len: ``(B,)`` anchors per sample.
            assign: ``(B, H_kv, C)`` int64 target anchor in ``[0, K)`` for every slot, or -1 to drop.
            counts: ``(B, H_kv, K)`` int64 sources per anchor (>= 1 for real anchors).
        """
        from vlkv.plugins import merge_kv

        meta = self._take(index, index.shape[2])
        n = assign.shape[2]
        keys, values = merge_kv(self.keys[:, :, :n], self.values[:, :, :n], assign, counts)
        self._install(keys, values, keep_len, meta)

    def _install(self, keys: Tensor, values: Tensor, lengths: Tensor, meta: dict[str, Tensor]) -> None:
        self.keys, self.values = keys.contiguous(), values.contiguous()
        self.lengths = lengths.to(torch.long).clone()
        self.positions, self.modality = meta["positions"], meta["modality"]
        self.scores = {n[len("score:") :]: t for n, t in meta.items() if n.startswith("score:")}

    def valid_mask(self) -> Tensor:
        """``(B, C)`` bool, True at valid slots."""
        return torch.arange(self.capacity, device=self.lengths.device)[None, :] < self.lengths[:, None]


@dataclass
class KVCache:
    """All layers of a batch's cache plus the per-sample bookkeeping positions need.

    Attributes:
        layers: one :class:`LayerKV` per decoder layer.
        next_position: ``(B, P)`` int64, original position the next generated token gets.
        prompt_lengths: ``(B,)`` int64 prompt tokens per sample (after image-token expansion).
        processed: ``(B,)`` int64 tokens run through the model so far (prompt + generated).
        policy_state: per-request state a policy keeps between steps (not K/V).
    """

    layers: list[LayerKV]
    next_position: Tensor
    prompt_lengths: Tensor
    processed: Tensor
    policy_state: dict = field(default_factory=dict)  # per-request policy state (e.g. Elastic's P)

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        pos_dims: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        return cls(
            layers=[
                LayerKV.empty(batch, kv_heads, head_dim, pos_dims, dtype, device) for _ in range(num_layers)
            ],
            next_position=torch.zeros(batch, pos_dims, dtype=torch.long, device=device),
            prompt_lengths=torch.zeros(batch, dtype=torch.long, device=device),
            processed=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    @property
    def pos_dims(self) -> int:
        return self.next_position.shape[1]

    def lengths(self) -> Tensor:
        """``(L, B)`` int64 valid entries per layer and sample."""
        return torch.stack([layer.lengths for layer in self.layers])

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def used_kv_bytes(self) -> int:
        return sum(layer.used_kv_bytes() for layer in self.layers)

    def meta_bytes(self) -> int:
        return sum(layer.meta_bytes() for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """K/V bytes an uncompressed cache would need now: every processed token of every
        sample in every layer (no padding), the baseline ``used_kv_bytes`` is compared with."""
        layer = self.layers[0]
        per_entry = 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()
        return int(self.processed.sum()) * per_entry * len(self.layers)
