"""The cache of one decoder layer for a batch of samples: an entry table bound to a pool layer.

Layout, shared by every backend:

* K/V live in a :class:`~vlkv.runtime.kv.pool.KVPool` (per layer ``(H_kv, S, D)`` slots); a
  :class:`LayerKV` holds, per sample and KV head, a *slot table* ``(B, H_kv, C)`` naming the pool
  slots of its entries (:class:`~vlkv.runtime.kv.entries.EntryTable`);
* layers are independent, so per-layer budgets give really different lengths, and per-sample
  lengths differ within a layer;
* entries are kept in ascending original position; keys of private dense entries are stored
  post-RoPE (a linked record is rotated when it is read, see docs/architecture.md), and each
  entry remembers its original position (3 components for M-RoPE) and its modality.

*Holes* give KV heads different budgets (KVzip's non-uniform head budgets): a column may be a hole
for some heads — the entry was evicted from that head, its pool slot freed, and attention and
statistics skip it — while other heads keep a real entry in the same column. The table keeps one
length per sample, so appends and causality stay per sample; only the freed K/V bytes differ per head.

Writes happen in explicit methods (appends, edits, link, the pool life cycle); every property and
query only reads. A decode step's attention reads the pool through the slot table
(``vlkv.runtime.kv.paged``); :meth:`LayerKV.attention_kv` is the dense read of the other paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.appends import Appends
from vlkv.runtime.kv.edits import Edits
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.kv.spares import SpareSlots


def private_pool(
    num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> KVPool:
    """A growable pool owned by one batch (what ``Engine.generate`` and tests use)."""
    spec = PoolSpec(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    return KVPool(spec, 0, grow=True)


class LayerKV(Appends, Edits):
    """The cache of one decoder layer for a batch of samples, indexing a pool layer.

    Attributes (besides the entry table's ``slots``, ``lengths``, ``positions``, ``modality``,
    ``order``, ``next_order``, ``scores``, ``holes``):
        pool, layer: the :class:`KVPool` and the layer index inside it.
        spares: held, unused slots the coming appends write (:class:`SpareSlots`).
        run_reserve: spare slots a fresh one-sample cache on a growable pool takes after its prompt,
            as one run its decode appends continue.
        linked: holds shared entries (pre-RoPE keys, rotated on read).
        lowrank: None, or the low-rank factors of factored entries (slot = ``-(1 + factor row)``), see
            :mod:`vlkv.runtime.kv.lowrank`.
        ballast: None, or ``(H_kv, n)`` slots of a fixed pool held (never written) for the bytes of the
            low-rank factors, so admission and preemption see them.
        offloaded, offloaded_factors: host K/V (and factors) while swapped out, else None.
    """

    def __init__(self, pool: KVPool, layer: int, batch: int, pos_dims: int, capacity: int = 0):
        super().__init__(batch, pool.spec.kv_heads, pos_dims, capacity, pool.spec.device)
        self.pool, self.layer = pool, layer
        self.spares = SpareSlots()
        self.run_reserve = 0
        self.offloaded: tuple[Tensor, Tensor] | None = None
        self.offloaded_factors = None
        self.linked = False
        self.lowrank = None
        self.ballast: Tensor | None = None
        pool.attach(layer, self)

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
        """A one-layer cache on its own growable pool."""
        return cls(private_pool(1, kv_heads, head_dim, dtype, device), 0, batch, pos_dims, capacity)

    # ------------------------------------------------------------------ reads
    @property
    def spare_ids(self) -> Tensor | None:
        """``(H_kv, m)`` held, unused slots that continue this one-sample cache's run, or None."""
        return self.spares.ids

    @property
    def recycled(self) -> Tensor | None:
        """``(H_kv, B, m)`` held slots recycled from decode evictions (:attr:`SpareSlots.recycled`)."""
        return self.spares.recycled

    @property
    def keys(self) -> Tensor:
        """``(B, H_kv, C, D)`` dense copy of the keys (inspection and tests; backends use attention_kv)."""
        return self.attention_kv(self.capacity)[0]

    @property
    def values(self) -> Tensor:
        """``(B, H_kv, C, D)`` dense copy of the values."""
        return self.attention_kv(self.capacity)[1]

    def attention_kv(
        self, upto: int | None = None, view: bool = False, fill: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Dense K/V a backend attends over: ``(B, H_kv, upto, D)`` gathered from the pool.

        ``view=True`` (a backend reading within one step) allows a view of the pool when the entries are
        one ascending run of slots, or a gather into the pool's scratch buffer (valid until the next
        such read); otherwise the result is always a copy the caller may keep.

        Keys of shared (linked) entries are stored before RoPE and rotated here to the positions
        this cache gives them (``pool.rope``); private entries are stored rotated. Columns past a
        sample's length read arbitrary (finite) pool data: attention masks them. ``fill=False``
        leaves factored (low-rank) columns as arbitrary finite data too: for a backend that attends
        to them in the rank space.
        """
        n = self.max_length if upto is None else upto
        if n == 0 or self.pool.capacity(self.layer) == 0:
            d = self.pool.spec.head_dim
            z = torch.zeros(self.batch, self.kv_heads, n, d, dtype=self.pool.spec.dtype, device=self.device)
            return z, z.clone()
        if view and self.batch == 1 and not self.linked and self.lowrank is None:
            start = self.run_start(n)
            if start is not None:  # one ascending run of slots: a view of the pool, no gather
                keys, values = self.pool.keys[self.layer], self.pool.values[self.layer]
                return keys[None, :, start : start + n], values[None, :, start : start + n]
        ids = self.slots[:, :, :n]
        dense = ids.clamp(min=0) if self.lowrank is not None else ids
        lowrank = self.lowrank if fill else None
        # a backend's read (view) may gather into the pool's scratch buffer, unless this layer still
        # rewrites what it read (rotation of shared keys, low-rank fill)
        k, v = self.pool.read(self.layer, dense, scratch=view and not self.linked and lowrank is None)
        if self.linked:
            pre = self.pool.is_prerope(self.layer, dense) & self.valid_mask()[:, None, :n] & (ids >= 0)
            if bool(pre.any()):
                k = torch.where(pre[..., None], self.pool.rope(k, self.positions[:, :, :n]), k)
        if lowrank is not None:
            k, v = lowrank.fill(self, k, v, ids)
        return k, v

    def run_start(self, n: int) -> int | None:
        """The first slot if sample 0's first ``n`` entries are the same ascending run
        ``start … start + n − 1`` in every head (a fresh request's entries on a growable pool), else
        None. Compares the table (``n`` ids per head): no memo to keep in step with edits."""
        if n <= 0 or n > self.capacity:
            return None
        ids = self.slots[0, :, :n]
        start = int(ids[0, 0])
        if start < 0 or start + n > self.pool.capacity(self.layer):
            return None
        return start if bool((ids == torch.arange(start, start + n, device=ids.device)).all()) else None

    def kv_bytes(self) -> int:
        """K/V bytes of the pool slots this cache holds (no padding: slots are per entry), plus the
        low-rank factors it holds."""
        if self.lowrank is None and self.holes is None:
            return sum(self.host_lengths()) * self.pool.spec.entry_bytes
        dense = int(self.held_mask().sum())
        factors = 0 if self.lowrank is None else self.lowrank.nbytes()
        return dense * self.pool.spec.entry_bytes // self.kv_heads + factors

    def spare_bytes(self) -> int:
        """Bytes of the held, unused slots the coming appends write (:attr:`spares`); not part of
        :meth:`kv_bytes`."""
        return self.spares.count() * self.pool.spec.entry_bytes

    def used_kv_bytes(self) -> int:
        """Bytes of K/V in valid entries (== :meth:`kv_bytes` on a slot pool)."""
        return self.kv_bytes()

    # ------------------------------------------------------------------ writes
    def link(
        self, ids: Tensor, positions: Tensor, modality: Tensor, sample: int = 0, order: Tensor | None = None
    ) -> None:
        """Append shared entries (slots another owner wrote) after ``sample``'s valid entries.

        Args:
            ids: ``(H_kv, n)`` pool slots of the shared entries (their keys pre-RoPE).
            positions: ``(n, P)`` int64 positions they take in this cache (keys are rotated to them on read).
            modality: ``(n,)`` int8 codes.
            order: ``(n,)`` int64 sequence indices (default: the next ones).
        """
        h, n = ids.shape
        if n == 0:
            return
        if self.pool.rope is None:
            raise RuntimeError("linking shared entries needs pool.rope (the model's rotary embedding)")
        dev = self.device
        host = list(self.host_lengths())
        past = host[sample]
        self._reserve(past + n)
        heads = torch.arange(h, device=dev)[:, None].expand(h, n)
        self.pool.retain(self.layer, heads.reshape(-1), ids.reshape(-1))
        cols = slice(past, past + n)
        self.slots[sample, :, cols] = ids
        self.positions[sample, :, cols] = positions.to(dev)[None].expand(h, n, positions.shape[-1])
        self.modality[sample, :, cols] = modality.to(device=dev, dtype=torch.int8)[None]
        if order is None:
            order = self.next_order[sample] + torch.arange(n, device=dev)
        order = order.to(device=dev, dtype=torch.long)
        self.order[sample, :, cols] = order[None]
        self.next_order[sample] = torch.maximum(self.next_order[sample], order.max() + 1)
        for s in self.scores.values():
            s[sample, :, cols] = 0
        if self.holes is not None:
            self.holes[sample, :, cols] = False
        host[sample] += n
        self.set_lengths(self.lengths + (torch.arange(self.batch, device=dev) == sample) * n, host)
        self.linked = True

    def take_spare(self) -> Tensor | int | None:
        """The next spare slot of this one-sample cache's run (:meth:`SpareSlots.take`)."""
        return self.spares.take()

    def release_spare(self) -> None:
        """Give the unused spare slots (the run's, recycled ones) back to the pool."""
        self.spares.release(self.pool, self.layer)

    def charge_factors(self) -> None:
        """Hold ``ceil(factor bytes / entry bytes)`` slots of a fixed pool for this layer's low-rank
        factors (:attr:`ballast`): growing factors take more (``PoolFull`` when none are free, as a
        dense append would), shrinking or dropped ones give them back."""
        if self.pool.grow and self.ballast is None:
            return
        nbytes = 0 if self.lowrank is None else self.lowrank.nbytes()
        need = 0 if self.pool.grow else -(-nbytes // self.pool.spec.entry_bytes)
        have = 0 if self.ballast is None else self.ballast.shape[1]
        if need > have:
            more = self.pool.alloc(self.layer, need - have)
            self.ballast = more if self.ballast is None else torch.cat([self.ballast, more], 1)
        elif need < have:
            self.pool.release(self.layer, self.ballast[:, need:])
            self.ballast = self.ballast[:, :need] if need else None

    # ------------------------------------------------------------------ pool life cycle
    def remap(self, remap: Tensor, layer: int | None = None) -> None:
        """Follow a pool compaction: ``remap (H_kv, S_old)`` maps old slot ids to new ones."""
        if self.offloaded is not None:  # holds no slots while swapped out
            return
        heads = torch.arange(self.kv_heads, device=self.device)[None, :, None]
        valid = self.valid_mask()[:, None, :]
        dense = self.held_mask()  # factored entries name factor rows, holes name nothing
        # spare columns may name ids past the new capacity: only valid entries are followed
        moved = remap[heads, torch.where(dense, self.slots, 0)]
        keep = valid & (self.slots < 0)  # factor rows stay; holes and spare columns point at slot 0
        self.slots = torch.where(dense, moved, torch.where(keep, self.slots, 0))
        self.spares.remap(remap)
        if self.ballast is not None:
            self.ballast = remap.gather(1, self.ballast)

    def release(self) -> None:
        """Free every slot this cache holds (finished or cancelled request); the cache is empty after."""
        self.release_spare()
        self._release(torch.ones(self.slots.shape, dtype=torch.bool, device=self.device))
        self.set_lengths(torch.zeros_like(self.lengths), [0] * self.batch)
        self.slots.zero_()
        self.lowrank = None
        self.charge_factors()
        self.holes = None

    def offload(self, device: torch.device | str = "cpu") -> None:
        """Swap out: copy the valid K/V to ``device`` (host memory) and free the pool slots."""
        n = self.max_length
        # factored columns stay factors (swapped with them): a reload rebuilds nothing, so the
        # request resumes with exactly the cache it had
        k, v = self.attention_kv(n, fill=self.lowrank is None)
        self.offloaded = (k.to(device), v.to(device))
        self.offloaded_factors = None if self.lowrank is None else self.lowrank.to(device)
        self.lowrank = None
        self.charge_factors()
        self.release_spare()
        lengths, host = self.lengths.clone(), list(self.host_lengths())
        self._release(torch.ones(self.slots.shape, dtype=torch.bool, device=self.device))
        self.set_lengths(lengths, host)  # the metadata stays; the entries come back in :meth:`reload`

    def reload(self) -> None:
        """Swap in: write the offloaded K/V into fresh pool slots (same table order)."""
        if self.offloaded is None:
            return
        k, v = (t.to(self.device) for t in self.offloaded)
        valid = self.valid_mask()[:, : k.shape[2]]
        factors, self.offloaded_factors = self.offloaded_factors, None
        if factors is not None:  # factored columns (joint-head rows) keep their factor ids
            valid = valid & (self.slots[:, :, : k.shape[2]] >= 0).all(1)
        bt, it = torch.nonzero(valid, as_tuple=True)
        ids = self.pool.alloc(self.layer, bt.numel())
        self.pool.write(self.layer, ids, k.permute(1, 0, 2, 3)[:, bt, it], v.permute(1, 0, 2, 3)[:, bt, it])
        heads = torch.arange(self.kv_heads, device=self.device)
        self.slots[bt[None, :], heads[:, None], it[None, :]] = ids
        self.offloaded = None
        if factors is not None:
            self.lowrank = factors.to(self.device)
            self.charge_factors()
        if self.holes is not None:  # every column got a slot per head: holes give theirs back
            hb, hh, hc = torch.nonzero(self.holes & self.valid_mask()[:, None, :], as_tuple=True)
            self.pool.release(self.layer, self.slots[hb, hh, hc], heads=hh)
            self.slots[hb, hh, hc] = 0
