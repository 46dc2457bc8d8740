"""A growable pool's growth and compaction: the mixin :class:`~vlkv.runtime.kv.pool.KVPool` takes its
``_grow`` / ``_resize`` / ``ensure_headroom`` / ``compact`` from (when they run: ``kv/pool.py``'s docstring).

A layer grows in chunks (at least ``GROW_SLOTS`` slots or a quarter of its capacity); compaction moves the
live entries into the lowest slots, remaps every owner's slot table and shrinks the tensors. Both
re-allocate through the pool's ``_kv_zeros`` (huge pages on a CPU pool).
"""

from __future__ import annotations

import math

import torch

# growable pools grow a layer by at least this many slots (amortises decode appends)
GROW_SLOTS = 32


class PoolGrowth:
    """Growth and compaction over the pool's ``keys`` / ``values`` / ``_refs`` / ``_prerope`` per layer,
    its free stacks ``_free`` / ``_nfree`` / ``_nfree_host``, ``headroom`` and owners (``_owners``)."""

    def _grow(self, layer: int, extra: int) -> None:
        cap = self.capacity(layer)
        new_cap = cap + max(extra, GROW_SLOTS if cap else extra, math.ceil(cap * 0.25))
        self._resize(layer, new_cap, cap)

    def _resize(self, layer: int, new_cap: int, low_free: int | list[int]) -> None:
        """Reallocate a layer to ``new_cap`` slots; every id in use must be < ``new_cap``.

        Growing (``low_free`` = old capacity): the new ids go to the bottom of each stack, so old
        holes are reused first. Shrinking after compaction (``low_free`` = per-head used counts): each
        head's free ids are exactly ``[used_h, new_cap)``.
        """
        cap, h = self.capacity(layer), self.spec.kv_heads
        keep = min(cap, new_cap)
        for store in (self.keys, self.values, self._refs, self._prerope):
            old = store[layer]
            kv = store is self.keys or store is self.values
            t = self._kv_zeros(new_cap) if kv else old.new_zeros(h, new_cap, *old.shape[2:])
            t[:, :keep] = old[:, :keep]
            store[layer] = t
        self.bytes_moved += keep * self.spec.entry_bytes
        dev = self.spec.device
        if new_cap >= cap:
            nfree = self._nfree[layer]
            buf = torch.zeros(h, new_cap, dtype=torch.long, device=dev)
            fresh = new_cap - cap
            buf[:, :fresh] = torch.arange(new_cap - 1, cap - 1, -1, device=dev)
            # old free entries sit above the fresh ones, in their order
            old = self._free[layer]
            col = torch.arange(cap, device=dev)[None, :]
            src = col < nfree[:, None]
            rows = self._heads[:, None].expand(h, cap)[src]
            buf[rows, fresh + col.expand(h, cap)[src]] = old[src]
            self._free[layer] = buf
            self._nfree[layer] = nfree + fresh
        else:
            # head j's stack holds ids new_cap - 1 down to used[j] (its top the lowest): one masked
            # ramp for every head, where a loop read each head's count back (a sync a head and layer)
            used_host = [int(u) for u in low_free]
            used = torch.tensor(used_host, dtype=torch.long, device=dev)
            ramp = torch.arange(new_cap - 1, -1, -1, device=dev).expand(h, new_cap)
            col = torch.arange(new_cap, device=dev)
            self._free[layer] = torch.where(col < (new_cap - used)[:, None], ramp, 0)
            self._nfree[layer] = new_cap - used
            self._nfree_host[layer] = [new_cap - u for u in used_host]
            return
        self._nfree_host[layer] = self._nfree[layer].tolist()

    def ensure_headroom(self, slots: int) -> None:
        """A growable pool keeps ``slots`` free slots per layer for the appends its owner expects (a
        batch's remaining decode steps): it grows once now instead of every few steps, and compaction
        keeps that room. Fixed pools ignore it."""
        if not self.grow:
            return
        self.headroom = max(0, int(slots))
        for layer in range(self.spec.num_layers):
            free = self.free_slots(layer)
            if free < self.headroom:
                self._resize(layer, self.capacity(layer) + self.headroom - free, self.capacity(layer))

    def compact(self, layer: int) -> None:
        """Move live entries into the lowest slots, remap owners' tables, shrink the tensors."""
        cap, h = self.capacity(layer), self.spec.kv_heads
        used = [cap - f for f in self._nfree_host[layer]]
        live = self._refs[layer] > 0
        remap = torch.arange(cap, device=self.spec.device)[None].repeat(h, 1)
        moved = 0
        for j in range(h):  # heads hold different ids; compaction is rare, so a loop is fine
            movers = torch.nonzero(live[j, used[j] :]).flatten() + used[j]
            holes = torch.nonzero(~live[j, : used[j]]).flatten()  # as many as movers
            remap[j, movers] = holes
            for store in (self.keys, self.values, self._refs, self._prerope):
                store[layer][j, holes] = store[layer][j, movers]
            self._refs[layer][j, movers] = 0  # vacated: free from now on
            self._prerope[layer][j, movers] = False
            moved += movers.numel()
        self.bytes_moved += moved * self.spec.entry_bytes // h
        for ref in list(self._owners[layer].values()):
            owner = ref()
            if owner is not None:
                owner.remap(remap, layer)
        self._resize(layer, max(max(used) + max(GROW_SLOTS, self.headroom), 1), used)
        self.compactions += 1
