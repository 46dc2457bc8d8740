"""A batch's cache: one :class:`~vlkv.runtime.kv.layer.LayerKV` per decoder layer, plus the
per-sample bookkeeping positions need (next position, prompt length, tokens processed).

Every property and byte count only reads; writes are the explicit ``release`` / ``offload`` /
``reload`` here and the layers' own appends and edits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlkv.runtime.kv.layer import LayerKV, private_pool
from vlkv.runtime.kv.pool import KVPool


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

    def __post_init__(self) -> None:
        if self.next_position.dim() != 2:
            raise ValueError(
                f"KVCache.next_position: needs (B, P), got shape {tuple(self.next_position.shape)}"
            )

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
        pool: KVPool | None = None,
    ) -> KVCache:
        """An empty cache on ``pool`` (a private growable pool when None)."""
        pool = pool or private_pool(num_layers, kv_heads, head_dim, dtype, device)
        dev = pool.spec.device
        return cls(
            layers=[LayerKV(pool, i, batch, pos_dims) for i in range(num_layers)],
            next_position=torch.zeros(batch, pos_dims, dtype=torch.long, device=dev),
            prompt_lengths=torch.zeros(batch, dtype=torch.long, device=dev),
            processed=torch.zeros(batch, dtype=torch.long, device=dev),
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

    def kept_entries(self) -> Tensor:
        """``(L, B)`` int64 entries per layer, sample and KV head (holes excluded, see ``LayerKV``)."""
        return torch.stack([layer.kept_entries() for layer in self.layers])

    def kv_bytes(self) -> int:
        if all(layer.lowrank is None and layer.holes is None for layer in self.layers):
            # one sum over every layer's lengths, not a reduction per layer (a decode step asks per request)
            return int(self.lengths().sum()) * self.layers[0].pool.spec.entry_bytes
        return sum(layer.kv_bytes() for layer in self.layers)

    def spare_bytes(self) -> int:
        """Bytes of held, unused slots over every layer (:meth:`LayerKV.spare_bytes`)."""
        return sum(layer.spare_bytes() for layer in self.layers)

    def used_kv_bytes(self) -> int:
        return sum(layer.used_kv_bytes() for layer in self.layers)

    def meta_bytes(self) -> int:
        return sum(layer.meta_bytes() for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """K/V bytes an uncompressed cache would need now: every processed token of every
        sample in every layer (no padding), the baseline ``used_kv_bytes`` is compared with."""
        per_entry = self.layers[0].pool.spec.entry_bytes
        return int(self.processed.sum()) * per_entry * len(self.layers)

    @property
    def pool(self) -> KVPool:
        return self.layers[0].pool

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def release(self) -> None:
        """Free every pool slot the cache holds."""
        for layer in self.layers:
            layer.release()

    def offload(self, device: torch.device | str = "cpu") -> None:
        """Swap every layer's K/V out to ``device`` and free their pool slots."""
        for layer in self.layers:
            layer.offload(device)

    def reload(self) -> None:
        for layer in self.layers:
            layer.reload()
