"""The KV pool: per layer, one K and one V tensor of slots that requests write into and free.

A *slot* holds one token's key (or value) for one KV head of one layer. Slots are per KV head
because policies keep different tokens per head (SnapKV, H2O): head ``h`` of a layer owns slot
ids ``[0, S)`` of ``keys[l][h]``. Every request holds the same number of entries in each KV head
of a layer, so one free-stack top per layer serves all heads (vectorised, no Python loop over
heads): allocating ``n`` entries pops ``n`` ids from every head's stack, freeing pushes them back.

The basic operation is :meth:`KVPool.write` — "put these K/V rows at these slots"; an append is
the case where the slots were just allocated. Eviction frees slots and never moves survivors, so
a decode step with eviction writes only its new tokens (``bytes_written`` counts it).

Capacity: a *fixed* pool (``grow=False``, the scheduler's, sized in bytes) raises
:class:`PoolFull` when a layer runs out of slots; a *growable* pool (one private pool per
``Engine.generate`` batch) grows a layer in chunks. Growable pools compact: when more than
``COMPACT_FREE_FRACTION`` of a layer's slots are free (and the layer holds more than
``COMPACT_MIN_SLOTS``), the live entries move into the lowest slots, every owner's slot table is
remapped, and the tensors shrink — so the bytes a pool holds follow what its requests keep. A
fixed pool never compacts: any free slot serves any write, so holes cost locality, not capacity.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

# growable pools: compact a layer when more than this fraction of its slots is free ...
COMPACT_FREE_FRACTION = 0.5
# ... and it holds more than this many slots (small pools are not worth the copy)
COMPACT_MIN_SLOTS = 256
# growable pools grow a layer by at least this many slots (amortises decode appends)
GROW_SLOTS = 32


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

    @property
    def entry_bytes(self) -> int:
        """K + V bytes of one token in one layer (all KV heads)."""
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def slots_for_bytes(self, nbytes: int) -> int:
        """Slots per layer a pool of ``nbytes`` K/V bytes holds."""
        return nbytes // (self.entry_bytes * self.num_layers)


class KVPool:
    """K/V slots for every layer, a free stack per layer, and byte counters.

    Attributes:
        keys, values: per layer ``(H_kv, S_l, D)`` tensors.
        bytes_written: K/V bytes written by :meth:`write` since creation (new entries, merged anchors,
            swapped-in entries); growth and compaction copies are counted in ``bytes_moved``.
    """

    def __init__(self, spec: PoolSpec, slots: int = 0, grow: bool = True):
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        self.spec, self.grow = spec, grow
        h, d = spec.kv_heads, spec.head_dim
        z = dict(dtype=spec.dtype, device=spec.device)
        self.keys = [torch.zeros(h, slots, d, **z) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(h, slots, d, **z) for _ in range(spec.num_layers)]
        self._free = [self._stack(0, slots) for _ in range(spec.num_layers)]
        self._nfree = [slots] * spec.num_layers
        self._heads = torch.arange(h, device=spec.device)
        self._owners: list[dict[int, weakref.ref]] = [{} for _ in range(spec.num_layers)]
        self.bytes_written = 0
        self.bytes_moved = 0
        self.compactions = 0

    @classmethod
    def with_bytes(cls, spec: PoolSpec, nbytes: int) -> KVPool:
        """A fixed pool holding ``nbytes`` of K/V in all (split evenly over layers)."""
        slots = spec.slots_for_bytes(nbytes)
        if slots < 1:
            raise ValueError(
                f"pool of {nbytes} bytes holds no token: one token needs {spec.entry_bytes * spec.num_layers} bytes"
            )
        return cls(spec, slots, grow=False)

    def _stack(self, lo: int, hi: int) -> Tensor:
        # descending, so popping from the top hands out the lowest ids first
        ids = torch.arange(hi - 1, lo - 1, -1, device=self.spec.device)
        return ids[None].expand(self.spec.kv_heads, -1).contiguous()

    # ------------------------------------------------------------------ accounting
    def capacity(self, layer: int) -> int:
        return self.keys[layer].shape[1]

    def free_slots(self, layer: int) -> int:
        return self._nfree[layer]

    def used_slots(self, layer: int) -> int:
        return self.capacity(layer) - self._nfree[layer]

    def min_free(self) -> int:
        """Free slots of the fullest layer (what a step writing every layer can count on)."""
        return min(self._nfree)

    def held_bytes(self) -> int:
        """Bytes the K/V tensors hold (free slots included)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def used_bytes(self) -> int:
        """K/V bytes of allocated slots."""
        per = self.spec.entry_bytes
        return sum(self.used_slots(i) * per for i in range(self.spec.num_layers))

    def meta_bytes(self) -> int:
        """Bytes of the free stacks (the pool's own bookkeeping)."""
        return sum(f.numel() * f.element_size() for f in self._free)

    # ------------------------------------------------------------------ slots
    def attach(self, layer: int, owner) -> None:
        """Register ``owner`` (has ``slots (B, H_kv, C)`` and ``remap(table)``) for compaction."""
        key = id(owner)
        self._owners[layer][key] = weakref.ref(owner, lambda _, d=self._owners[layer], k=key: d.pop(k, None))

    def alloc(self, layer: int, n: int) -> Tensor:
        """``(H_kv, n)`` int64 fresh slot ids (ascending per head when the stack is fresh)."""
        if n <= 0:
            return torch.zeros(self.spec.kv_heads, 0, dtype=torch.long, device=self.spec.device)
        if self._nfree[layer] < n:
            if not self.grow:
                raise PoolFull(
                    f"layer {layer} has {self._nfree[layer]} free slots of {self.capacity(layer)}, needs {n}"
                )
            self._grow(layer, n - self._nfree[layer])
        top = self._nfree[layer]
        ids = self._free[layer][:, top - n : top].flip(1)
        self._nfree[layer] = top - n
        return ids

    def release(self, layer: int, ids: Tensor) -> None:
        """Return ``ids (H_kv, m)`` to the free stack (each head frees the same count)."""
        m = ids.shape[1]
        if m == 0:
            return
        top = self._nfree[layer]
        if top + m > self.capacity(layer):
            raise RuntimeError(f"layer {layer}: releasing {m} slots overflows the free stack (double free?)")
        self._free[layer][:, top : top + m] = ids.flip(1)
        self._nfree[layer] = top + m
        self._maybe_compact(layer)

    def write(self, layer: int, ids: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k, v (H_kv, n, D)`` at slots ``ids (H_kv, n)`` (the same count in every head)."""
        heads = self._heads[:, None].expand_as(ids)
        self.write_entries(layer, heads.reshape(-1), ids.reshape(-1), k.flatten(0, 1), v.flatten(0, 1))

    def write_entries(self, layer: int, heads: Tensor, ids: Tensor, k: Tensor, v: Tensor) -> None:
        """Store single-head rows: ``k, v (N, D)`` at ``(heads (N,), ids (N,))``."""
        n = ids.numel()
        if n == 0:
            return
        self.keys[layer][heads, ids] = k.to(self.spec.dtype)
        self.values[layer][heads, ids] = v.to(self.spec.dtype)
        # bytes of one head's K + V row
        self.bytes_written += n * self.spec.entry_bytes // self.spec.kv_heads

    def read(self, layer: int, ids: Tensor) -> tuple[Tensor, Tensor]:
        """K/V at ``ids (B, H_kv, n)`` → two ``(B, H_kv, n, D)`` tensors (a gather, not a view)."""
        h = self._heads[None, :, None]
        return self.keys[layer][h, ids], self.values[layer][h, ids]

    # ------------------------------------------------------------------ growth / compaction
    def _grow(self, layer: int, extra: int) -> None:
        cap = self.capacity(layer)
        new_cap = cap + max(extra, GROW_SLOTS if cap else extra, math.ceil(cap * 0.25))
        self._resize(layer, new_cap)

    def _resize(self, layer: int, new_cap: int) -> None:
        """Reallocate a layer to ``new_cap`` slots; every id in use must be < ``new_cap``."""
        cap, d = self.capacity(layer), self.spec.head_dim
        keep = min(cap, new_cap)
        for store in (self.keys, self.values):
            t = store[layer].new_zeros(self.spec.kv_heads, new_cap, d)
            t[:, :keep] = store[layer][:, :keep]
            store[layer] = t
        self.bytes_moved += keep * self.spec.entry_bytes
        used = cap - self._nfree[layer]
        old_free = self._free[layer][:, : self._nfree[layer]]
        if new_cap >= cap:  # new ids go to the bottom of the stack: old holes are reused first
            free = torch.cat([self._stack(cap, new_cap), old_free], dim=1)
        else:  # shrinking after compaction: the free ids are exactly [used, new_cap)
            free = self._stack(used, new_cap)
        # the stack buffer spans the whole capacity: every slot may be free at once
        buf = torch.zeros(self.spec.kv_heads, new_cap, dtype=torch.long, device=self.spec.device)
        buf[:, : free.shape[1]] = free
        self._free[layer] = buf
        self._nfree[layer] = new_cap - used

    def _maybe_compact(self, layer: int) -> None:
        cap = self.capacity(layer)
        if not self.grow or cap <= COMPACT_MIN_SLOTS or self._nfree[layer] <= COMPACT_FREE_FRACTION * cap:
            return
        self.compact(layer)

    def compact(self, layer: int) -> None:
        """Move live entries into the lowest slots, remap owners' tables, shrink the tensors."""
        cap, used = self.capacity(layer), self.used_slots(layer)
        h = self.spec.kv_heads
        live = torch.ones(h, cap, dtype=torch.bool, device=self.spec.device)
        live.scatter_(1, self._free[layer][:, : self._nfree[layer]], False)
        remap = torch.arange(cap, device=self.spec.device)[None].repeat(h, 1)
        moved = 0
        for j in range(h):  # heads hold different ids; compaction is rare, so a loop is fine
            movers = torch.nonzero(live[j, used:]).flatten() + used
            holes = torch.nonzero(~live[j, :used]).flatten()  # as many as movers
            remap[j, movers] = holes
            for store in (self.keys, self.values):
                store[layer][j, holes] = store[layer][j, movers]
            moved += movers.numel()
        self.bytes_moved += moved * self.spec.entry_bytes // h
        for ref in list(self._owners[layer].values()):
            owner = ref()
            if owner is not None:
                owner.remap(remap)
        self._resize(layer, max(used + GROW_SLOTS, 1))
        self.compactions += 1
