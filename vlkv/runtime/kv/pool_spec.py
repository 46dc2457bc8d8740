"""The shape of a KV pool's slots (:class:`PoolSpec`) and the error a full fixed pool raises.

A value of its own, kept apart from :class:`~vlkv.runtime.kv.pool.KVPool`'s slot bookkeeping (the pool
module re-exports both names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolFull(RuntimeError):
    """A fixed-size pool has fewer free slots in a layer than a write needs."""


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """The shape of every layer's slots.

    Attributes:
        num_layers: decoder layers. kv_heads: KV heads per layer. head_dim: D.
        dtype: K/V storage dtype. device: where the K/V tensors (and slot tables) live.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def for_backend(cls, backend) -> PoolSpec:
        """The layout of a backend's model (layers, KV heads, head size, dtype, device)."""
        return cls(
            num_layers=backend.num_layers,
            kv_heads=backend.num_kv_heads,
            head_dim=backend.head_dim,
            dtype=backend.dtype,
            device=backend.device,
        )

    @property
    def entry_bytes(self) -> int:
        """K + V bytes of one token in one layer (all KV heads)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def slots_for_bytes(self, nbytes: int) -> int:
        """Slots per layer a pool of ``nbytes`` K/V bytes holds."""
        return nbytes // (self.entry_bytes * self.num_layers)
