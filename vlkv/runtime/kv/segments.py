"""Shared segments: one pool copy of a span's K/V (e.g. an image) that several requests read.

A segment's keys are stored before RoPE, so a request can link it at any position: the reading
cache rotates them to the positions it gives the entries (:meth:`LayerKV.attention_kv`). Private
dense entries stay post-RoPE. Slots are reference-counted: the segment holds one reference, every
request that links it holds one more, and the slots go back to the pool when the last one drops.
Low-rank segments (AttentionPack) are the next kind planned behind the same read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.kv.cache import KVCache
from vlkv.runtime.kv.pool import KVPool


@dataclass
class SharedSegment:
    """Per layer, ``(H_kv, n)`` pool slots holding one span's pre-RoPE keys and values.

    Attributes:
        pool: the pool holding the slots.
        ids: per layer, ``(H_kv, n)`` int64 slot ids.
        modality: ``(n,)`` int8 codes of the entries.
    """

    pool: KVPool
    ids: list[Tensor]
    modality: Tensor
    # ``(n, hidden)`` the span's input embeddings, when kept (lets a linker recompute some of its
    # rows without running the vision tower again)
    embeds: Tensor | None = None

    def __post_init__(self) -> None:
        for layer in range(len(self.ids)):  # compaction moves slots: follow them
            self.pool.attach(layer, self)

    def remap(self, remap: Tensor, layer: int) -> None:
        """Follow a pool compaction of ``layer``: ``remap (H_kv, S_old)`` maps old slot ids to new ones."""
        ids = self.ids[layer]
        if ids.numel():
            self.ids[layer] = remap.gather(1, ids)

    @property
    def length(self) -> int:
        return self.ids[0].shape[1]

    @classmethod
    def from_tensors(
        cls, pool: KVPool, keys: list[Tensor], values: list[Tensor], modality: Tensor
    ) -> SharedSegment:
        """Store per-layer pre-RoPE ``keys``/``values`` ``(H_kv, n, D)`` in fresh slots.

        All or nothing: a layer that cannot allocate (:class:`PoolFull`) frees the earlier layers'
        slots before the error leaves, so a failed record leaves the pool as it was."""
        ids: list[Tensor] = []
        try:
            for layer, (k, v) in enumerate(zip(keys, values)):
                slot = pool.alloc(layer, k.shape[1])
                ids.append(slot)
                pool.write(layer, slot, k, v, prerope=True)
        except BaseException:
            for layer, slot in enumerate(ids):
                pool.release(layer, slot)
            raise
        return cls(pool, ids, modality.to(torch.int8))

    @classmethod
    def from_cache(cls, cache: KVCache, start: int, stop: int, sample: int = 0) -> SharedSegment:
        """Copy a request's entries at table columns ``[start, stop)`` of every layer, un-rotated.

        The entries must be the same tokens in every KV head (no per-head eviction inside the span).
        """
        rope = cache.pool.rope
        if rope is None:
            raise RuntimeError("storing a segment needs pool.rope (the model's rotary embedding)")
        keys, values = [], []
        for layer in cache.layers:
            if int(layer.lengths[sample]) < stop:
                raise ValueError(
                    f"layer {layer.layer} holds {int(layer.lengths[sample])} entries, span ends at {stop}"
                )
            k, v = layer.attention_kv(stop)
            k, v = k[sample : sample + 1, :, start:stop], v[sample : sample + 1, :, start:stop]
            pos = layer.positions[sample : sample + 1, :, start:stop]
            keys.append(rope(k, pos, inverse=True)[0])
            values.append(v[0])
        modality = cache.layers[0].modality[sample, 0, start:stop]
        return cls.from_tensors(cache.pool, keys, values, modality)

    def link(
        self,
        cache: KVCache,
        positions: Tensor,
        sample: int = 0,
        start: int = 0,
        order: Tensor | None = None,
    ) -> None:
        """Append entries ``[start, n)`` of the segment to every layer of ``cache``.

        Args:
            positions: ``(n - start, P)`` int64 positions they take there (keys are rotated to them).
            order: optional ``(n - start,)`` int64 sequence indices in the reading request.
        """
        if cache.pool is not self.pool:
            raise ValueError("a segment links only into caches on its own pool")
        if not 0 <= start <= self.length:
            raise ValueError(f"start must be in [0, {self.length}], got {start}")
        if positions.shape[0] != self.length - start:
            raise ValueError(f"positions must give {self.length - start} rows, got {positions.shape[0]}")
        for layer, ids in zip(cache.layers, self.ids):
            layer.link(ids[:, start:], positions, self.modality[start:], sample, order)

    def release(self) -> None:
        """Drop the segment's own reference (linked requests keep theirs)."""
        for layer, ids in enumerate(self.ids):
            self.pool.release(layer, ids)
        self.ids = [i[:, :0] for i in self.ids]
