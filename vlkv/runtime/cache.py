"""Per-request, per-layer KV-cache state over a shared slot pool.

Layout, shared by every backend:

* K/V live in a :class:`~vlkv.runtime.kv.KVPool` (per layer ``(H_kv, S, D)`` slots); a
  :class:`LayerKV` holds, per sample and KV head, a *slot table* ``(B, H_kv, C)`` naming the pool
  slots of its entries, left-aligned in ``[0, lengths[b])``; table columns past that are spare;
* layers are independent, so per-layer budgets give really different lengths, and per-sample
  lengths differ within a layer;
* every KV head of a sample holds the same number of entries, but may hold *different* tokens
  (per-head selection), so positions/modality are stored per head;
* entries are kept in ascending original position; keys of private dense entries are stored
  post-RoPE (a linked record is rotated when it is written, see docs/architecture.md), and each
  entry remembers its original position (3 components for M-RoPE) and its modality.

*Holes* give KV heads different budgets (KVzip's non-uniform head budgets): a column may be a hole
for some heads — the entry was evicted from that head, its pool slot freed, and attention and
statistics skip it — while other heads keep a real entry in the same column. The table keeps one
length per sample, so appends and causality stay per sample; only the freed K/V bytes differ per head.

Eviction (:meth:`LayerKV.select`) frees the evicted slots and rewrites only the slot table: the
surviving K/V never move, so an evicting decode step writes O(new tokens) K/V bytes.
:meth:`LayerKV.merge` writes only the anchors whose value changed. ``kv_bytes`` counts the pool
slots a cache holds; the pool reports what it holds in all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch
from torch import Tensor

from vlkv.runtime.kv.pool import GROW_SLOTS, KVPool, PoolSpec

# most slots per head a decode-time eviction hands to the cache's next appends instead of the pool
RECYCLE_MAX = 16


class Modality(IntEnum):
    """What produced a cache entry."""

    TEXT = 0  # prompt text before the first image (system / instruction prefix)
    IMAGE = 1  # image tokens (incl. LLaVA-1.6 newline tokens)
    POST_TEXT = 2  # prompt text after the first image
    GENERATED = 3  # tokens produced by decoding


def private_pool(
    num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> KVPool:
    """A growable pool owned by one batch (what ``Engine.generate`` and tests use)."""
    spec = PoolSpec(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    return KVPool(spec, 0, grow=True)


def _table(name: str) -> property:
    """A per-entry table attribute of :class:`LayerKV`: reading or replacing it first writes the
    pending decode entries (:meth:`LayerKV.put_one` defers them while they continue a run)."""
    attr = "_" + name

    def get(self: LayerKV) -> Tensor:
        if self._tail:
            self._flush()
        return getattr(self, attr)

    def put(self: LayerKV, value: Tensor) -> None:
        if self._tail:
            self._flush()
        setattr(self, attr, value)

    return property(get, put)


class LayerKV:
    """The cache of one decoder layer for a batch of samples, indexing a pool layer.

    Attributes:
        pool, layer: the :class:`KVPool` and the layer index inside it.
        slots: ``(B, H_kv, C)`` int64 pool slot of each entry (``C`` = table capacity).
        lengths: ``(B,)`` int64, valid entries per sample.
        positions: ``(B, H_kv, C, P)`` int64 original positions, ``P`` = 1 (1-D RoPE) or 3 (M-RoPE).
        modality: ``(B, H_kv, C)`` int8 :class:`Modality` codes.
        order: ``(B, H_kv, C)`` int64 index of each entry's token in its request's sequence (prompt
            then generated tokens); causality by position in a selective (link) step reads it.
        next_order: ``(B,)`` int64 order the next appended token gets unless a step names it.
        scores: name → ``(B, H_kv, C)`` float32 running statistics a policy keeps per entry
            (e.g. H2O's accumulated attention); they move with their entry on every edit.
        holes: None, or ``(B, H_kv, C)`` bool: True where a valid column holds no entry for that head
            (evicted with a per-head budget: no pool slot, never attended).
    """

    slots = _table("slots")
    positions = _table("positions")
    modality = _table("modality")
    order = _table("order")
    next_order = _table("next_order")

    def __init__(self, pool: KVPool, layer: int, batch: int, pos_dims: int, capacity: int = 0):
        h, dev = pool.spec.kv_heads, pool.spec.device
        self.pool, self.layer = pool, layer
        # decode entries not yet in the tables: ``(positions [P ints], modality, order | None)``
        # each, the run's next columns (see :meth:`put_one`; written by :meth:`_flush`)
        self._tail: list[tuple[list[int], int, int | None]] = []
        self.slots = torch.zeros(batch, h, capacity, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, h, capacity, pos_dims, dtype=torch.long, device=dev)
        self.modality = torch.zeros(batch, h, capacity, dtype=torch.int8, device=dev)
        self.order = torch.zeros(batch, h, capacity, dtype=torch.long, device=dev)
        self.next_order = torch.zeros(batch, dtype=torch.long, device=dev)
        self.scores: dict[str, Tensor] = {}
        self.holes: Tensor | None = None
        self.offloaded: tuple[Tensor, Tensor] | None = None  # host K/V while swapped out
        self.offloaded_factors = None  # host low-rank factors (LowRank) while swapped out
        self.linked = False  # holds shared entries (pre-RoPE keys, rotated on read)
        # low-rank factored entries (slot = -(1 + factor row)), see vlkv/runtime/kv/lowrank.py
        self.lowrank = None
        # a one-sample cache on a growable pool may take its prompt and ``run_reserve`` more slots as
        # one run: its decode appends then continue the run (``spare_ids (H_kv, m)``, held, unused),
        # and a batch of such requests reads the pool as a strided view instead of a gather
        self.run_reserve = 0
        self._spare: Tensor | None = None  # ``spare_ids`` is ``_spare[:, _spare_off:]``
        self._spare_off = 0
        # the id ``spare_ids`` start at while they continue the prompt's run (a Python int, so an
        # append knows it extends the run without a tensor compare), None when unknown
        self._spare_next: int | None = None
        # a batch cache's slots recycled from decode evictions (see :attr:`recycled`)
        self._recycled: Tensor | None = None
        self._recycled_off = 0
        # memo of :meth:`_run_start`: (slots tensor, its version counter, entries n, first slot).
        # Every table write is in place (the version moves) or a new tensor, so a matching memo
        # still describes the table; a decode step reads it instead of comparing n ids per head
        self._run: tuple[Tensor, int, int, int] | None = None
        # a fixed pool's byte budget covers low-rank factors too: the layer holds as many slots as
        # its factors' bytes fill (``ballast (H_kv, n)``, never written), so admission and
        # preemption see them; a growable pool has no budget to charge
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

    # ------------------------------------------------------------------ shape / accounting
    # shapes and device read the private table: a flush never changes them
    @property
    def batch(self) -> int:
        return self._slots.shape[0]

    @property
    def kv_heads(self) -> int:
        return self._slots.shape[1]

    @property
    def capacity(self) -> int:
        return self._slots.shape[2]

    @property
    def device(self) -> torch.device:
        return self._slots.device

    @property
    def spare_ids(self) -> Tensor | None:
        """``(H_kv, m)`` held, unused slots that continue this one-sample cache's run, or None."""
        return None if self._spare is None else self._spare[:, self._spare_off :]

    @spare_ids.setter
    def spare_ids(self, ids: Tensor | None) -> None:
        self._spare, self._spare_off = ids, 0

    @property
    def max_length(self) -> int:
        n = self.lengths.numel()
        return int(self.lengths.item()) if n == 1 else int(self.lengths.max()) if n else 0

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
            start = self._run_start(n)
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

    def _run_start(self, n: int) -> int | None:
        """The first slot if sample 0's first ``n`` entries are the same ascending run
        ``start … start + n − 1`` in every head (a fresh request's entries on a private pool), else None."""
        if n <= 0:
            return None
        memo = self._run
        if self._memo_holds() and n <= memo[2] + len(self._tail):
            start = memo[3]  # a prefix of a run is a run; pending entries continue it
        else:
            ids = self.slots[0, :, :n]
            start = int(ids[0, 0])
            if not bool((ids == torch.arange(start, start + n, device=ids.device)).all()):
                return None
            self._run = (self.slots, self.slots._version, n, start)
        return start if start + n <= self.pool.capacity(self.layer) else None

    def _memo_holds(self) -> bool:
        """The run memo still describes the table (written tables only; pending entries continue it)."""
        memo = self._run
        return memo is not None and memo[0] is self._slots and memo[1] == self._slots._version

    def _run_ends_at(self, p: int) -> int | None:
        """The memoised run's first slot when it covers exactly the first ``p`` entries, else None."""
        if self._memo_holds() and self._run[2] + len(self._tail) == p:
            return self._run[3]
        return None

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
        past = int(self.lengths[sample])
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
        self.lengths[sample] += n
        self.linked = True

    @property
    def keys(self) -> Tensor:
        """``(B, H_kv, C, D)`` dense copy of the keys (inspection and tests; backends use attention_kv)."""
        return self.attention_kv(self.capacity)[0]

    @property
    def values(self) -> Tensor:
        """``(B, H_kv, C, D)`` dense copy of the values."""
        return self.attention_kv(self.capacity)[1]

    def kv_bytes(self) -> int:
        """K/V bytes of the pool slots this cache holds (no padding: slots are per entry), plus the
        low-rank factors it holds."""
        if self.lowrank is None and self.holes is None:
            return int(self.lengths.sum()) * self.pool.spec.entry_bytes
        dense = int(self.held_mask().sum())
        factors = 0 if self.lowrank is None else self.lowrank.nbytes()
        return dense * self.pool.spec.entry_bytes // self.kv_heads + factors

    def held_mask(self, width: int | None = None) -> Tensor:
        """``(B, H_kv, width)`` bool: valid columns whose head holds a pool slot (not a hole, not a
        low-rank factor row)."""
        width = self.capacity if width is None else width
        held = self.valid_mask()[:, None, :width] & (self.slots[:, :, :width] >= 0)
        if self.holes is not None:
            held = held & ~self.holes[:, :, :width]
        return held

    def kept_entries(self) -> Tensor:
        """``(B,)`` int64 entries the layer keeps per KV head: ``lengths``, less holes (mean over
        heads, rounded) when heads keep different numbers."""
        if self.holes is None:
            return self.lengths.clone()
        held = self.valid_mask()[:, None, :] & ~self.holes
        return held.sum(2).double().mean(1).round().long()

    def open_mask(self, width: int) -> Tensor | None:
        """``(B, H_kv, width)`` bool, False at holes (columns a head must not attend); None when the
        cache has no holes (every valid column is attended by every head)."""
        if self.holes is None:
            return None
        holes = self.holes[:, :, :width]
        if holes.shape[2] < width:
            holes = torch.cat([holes, holes.new_zeros(*holes.shape[:2], width - holes.shape[2])], dim=2)
        return ~holes

    def spare_bytes(self) -> int:
        """Bytes of the held, unused slots the coming appends write (:attr:`spare_ids`: a prompt run's
        reserve, slots recycled from decode evictions); not part of :meth:`kv_bytes`."""
        spare, left = self.spare_ids, self.recycled
        n = (0 if spare is None else spare.shape[1]) + (0 if left is None else left[0].numel())
        return n * self.pool.spec.entry_bytes

    def used_kv_bytes(self) -> int:
        """Bytes of K/V in valid entries (== :meth:`kv_bytes` on a slot pool)."""
        return self.kv_bytes()

    def meta_bytes(self) -> int:
        tensors = [self.slots, self.positions, self.modality, self.order, self.lengths, *self.scores.values()]
        if self.holes is not None:
            tensors.append(self.holes)
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

        self.order = grow(self.order)
        self.slots, self.positions, self.modality = (
            grow(self.slots),
            grow(self.positions),
            grow(self.modality),
        )
        self.scores = {name: grow(s) for name, s in self.scores.items()}
        if self.holes is not None:
            self.holes = grow(self.holes)

    def append(
        self,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        modality: Tensor,
        new_len: Tensor,
        order: Tensor | None = None,
    ) -> Tensor:
        """Write a step's new entries into fresh pool slots right after each sample's valid entries.

        Args:
            k, v: ``(B, H_kv, q, D)`` new keys (post-RoPE) and values; rows ``>= new_len[b]`` are padding.
            positions: ``(B, q, P)`` int64 original positions of the new tokens.
            modality: ``(B, q)`` int8 codes.
            new_len: ``(B,)`` int64 valid new rows per sample.
            order: optional ``(B, q)`` int64 sequence index of each new token (default: the next
                indices after the last one this layer holds).

        Returns:
            ``(B,)`` lengths before the write (the table column of each sample's first new row).
        """
        b, h, q, _ = k.shape
        dev = self.device
        new_len = new_len.to(device=dev, dtype=torch.long)
        if q == 1 and bool(new_len.all()):
            return self._append_one(k, v, positions, modality, order)
        past = self.lengths.clone()
        self._reserve(int((past + q).max()) if q else self.capacity)
        rows = torch.arange(q, device=dev)
        valid = rows[None, :] < new_len[:, None]  # (B, q)
        bt, it = torch.nonzero(valid, as_tuple=True)  # row-major: sample, then row
        fresh_run = self._spare is None
        ids = self._alloc_prompt(bt.numel(), past)  # (H_kv, T)
        fresh_run = fresh_run and self._spare is not None  # this append took the run its decode continues
        heads = torch.arange(h, device=dev)
        kk, vv = k.to(dev).permute(1, 0, 2, 3)[:, bt, it], v.to(dev).permute(1, 0, 2, 3)[:, bt, it]
        self.pool.write(self.layer, ids, kk, vv)
        self.slots[bt[None, :], heads[:, None], (past[bt] + it)[None, :]] = ids
        cols = past[:, None] + rows[None, :]  # (B, q)
        idx = cols[:, None, :, None].expand(b, h, q, 1)
        pos = positions.to(dev)[:, None].expand(b, h, q, positions.shape[-1])
        self.positions.scatter_(2, idx.expand(-1, -1, -1, pos.shape[-1]), pos.to(torch.long))
        self.modality.scatter_(2, idx[..., 0], modality.to(dev)[:, None].expand(b, h, q).to(torch.int8))
        if order is None:
            order = self.next_order[:, None] + rows[None, :]
        order = order.to(device=dev, dtype=torch.long)
        self.order.scatter_(2, idx[..., 0], order[:, None].expand(b, h, q))
        top = torch.where(valid, order, -1).amax(1, keepdim=False) if q else self.next_order - 1
        self.next_order = torch.maximum(self.next_order, top + 1)
        for s in self.scores.values():
            s.scatter_(2, idx[..., 0], torch.zeros(b, h, q, dtype=s.dtype, device=dev))
        if self.holes is not None:  # new entries are held by every head
            self.holes.scatter_(2, idx[..., 0], torch.zeros(b, h, q, dtype=torch.bool, device=dev))
        self.lengths = past + new_len
        if fresh_run:  # the table's entries are the run: decode appends may queue (put_one)
            self._run = (self.slots, self.slots._version, bt.numel(), self._spare_next - bt.numel())
        return past

    def _alloc_prompt(self, n: int, past: Tensor) -> Tensor:
        """``(H_kv, n)`` slots for a step's new entries: with ``run_reserve`` on a fresh one-sample
        cache of a growable pool, the first ``n`` of one run whose rest is kept as ``spare_ids``."""
        fresh = self.batch == 1 and self.spare_ids is None and n > 0 and not bool(past.any())
        if self.run_reserve > 0 and self.pool.grow and fresh:
            run = self.pool.alloc_run(self.layer, n + self.run_reserve)
            self.spare_ids = run[:, n:]
            self._spare_next = int(run[0, 0]) + n
            return run[:, :n]
        return self.pool.alloc(self.layer, n)

    def take_spare(self) -> Tensor | int | None:
        """The next spare slot of this one-sample cache's run: its id (an int, the same in every head)
        while the spares continue the prompt's run, else ``(H_kv,)`` ids; None when none is left."""
        if self._spare is None or self._spare_off >= self._spare.shape[1]:
            return None
        self._spare_off += 1
        if self._spare_next is not None:
            self._spare_next += 1
            return self._spare_next - 1
        return self._spare[:, self._spare_off - 1]

    def _uniform_select(self, index: Tensor, keep_len: Tensor, spare: int, recycle: bool) -> bool:
        """:meth:`select` of a cache whose samples hold the same number of entries and keep the same
        number, every head holding its columns (a decode-time eviction of a batch moving in step, or
        of one request): the dropped slots are the unlisted columns, no masks over the whole table.
        Returns False (nothing changed) when the shape does not fit or ``index`` repeats a column."""
        lengths, keeps = self.lengths.tolist(), keep_len.tolist()
        if not lengths or min(lengths) != max(lengths) or min(keeps) != max(keeps):
            return False
        b, h = self.batch, self.kv_heads
        n, k = lengths[0], keeps[0]
        # a decode step's eviction of a few entries near the end (recent text, A-VL's H2O) rewrites
        # the last quarter of the tables in place; anything else rebuilds them at their new width
        # (a prompt's eviction: they shrink). Writing most of a table back into strided slices
        # costs more than gathering fresh tables, so the quarter bounds the in-place work
        small = recycle and n - k <= RECYCLE_MAX and k + spare <= self.capacity
        head = self._kept_prefix(index, k) if small else 0
        dropped = None
        if n > k:
            kept = torch.zeros(b, h, n - head, dtype=torch.bool, device=self.device)
            moved = index[:, :, head:k] - head
            dropped = self.slots[:, :, head:n][~kept.scatter_(2, moved, True)]  # sample, head, column
            if dropped.numel() != b * h * (n - k):
                return False
        if head == 0:
            self._install(self._take(index, index.shape[2] + spare), keep_len)
        else:
            cols = index[:, :, head:k]
            for t in self._entry_tables():
                t[:, :, head:k] = _gather_columns(t, cols)
            self.lengths = keep_len.to(torch.long).clone()
        if dropped is not None:
            # after the tables: a compaction the release starts remaps the new table (and clears
            # the columns past the new length, which still name the dropped slots)
            self._drop(dropped.view(b, h, n - k), recycle)
        return True

    def _entry_tables(self) -> list[Tensor]:
        """The per-entry tables an in-place edit moves together (holes and factors excluded: caches
        holding them are edited by rebuilding, see :meth:`select`)."""
        return [self.slots, self.positions, self.modality, self.order, *self.scores.values()]

    def _kept_prefix(self, index: Tensor, k: int) -> int:
        """``k - k // 4`` when every row of ``index (B, H_kv, ≥k)`` keeps its first ``k - k // 4``
        columns where they are, else 0. One column tells: ascending distinct columns with
        ``index[j] == j`` keep ``0 … j`` in place."""
        j = k - k // 4
        if j == k or not bool((index[:, :, j] == j).all()):
            return 0
        return j if int(index[:, :, j:k].min()) >= j else 0  # an index out of order: rebuild

    def _drop(self, dropped: Tensor, recycle: bool) -> None:
        """Let go of the slots ``dropped (B, H_kv, m)`` this cache no longer lists.

        A decode-time eviction (``recycle``) drops a few per step and the next step appends as many:
        when ``m <= RECYCLE_MAX`` and no one else references them, they become the slots the next
        appends write (a one-sample cache's :attr:`spare_ids`, a batch's recycled columns) instead of
        a pool release now and an allocation next step — one reference check in place of the pool's
        free-stack bookkeeping, twice. Larger drops (a prompt's eviction) go back to the pool."""
        b, h, m = dropped.shape
        per_head = dropped.transpose(0, 1).reshape(h, b * m)  # (H_kv, B·m)
        if not recycle or m > RECYCLE_MAX or not self.pool.sole_owner(self.layer, per_head):
            self.pool.release(self.layer, per_head)
            return
        if b == 1:
            held = self.spare_ids
            # recycled first, so the held slots stay at most the run's spares + one step's drop
            self.spare_ids = (
                per_head if held is None or held.shape[1] == 0 else torch.cat([per_head, held], 1)
            )
            self._spare_next = None  # the spares no longer continue one run
            return
        new = dropped.permute(1, 0, 2)  # (H_kv, B, m)
        left = self.recycled
        self._recycled = new if left is None else torch.cat([new, left], 2)
        self._recycled_off = 0

    @property
    def recycled(self) -> Tensor | None:
        """``(H_kv, B, m)`` held, unused slots a batch cache's next ``m`` decode appends write (one
        per sample and head each), recycled from decode-time evictions; None when none are held."""
        r = self._recycled
        return None if r is None or self._recycled_off >= r.shape[2] else r[:, :, self._recycled_off :]

    def _take_recycled(self) -> Tensor | None:
        """``(H_kv, B)`` the next recycled slots of a batch cache, or None."""
        r = self.recycled
        if r is None:
            return None
        self._recycled_off += 1
        return r[:, :, 0]

    def release_spare(self) -> None:
        """Give the unused spare slots (the run's, recycled ones) back to the pool."""
        if self.spare_ids is not None and self.spare_ids.numel():
            self.pool.release(self.layer, self.spare_ids)
        self.spare_ids = None
        self._spare_next = None
        left = self.recycled
        if left is not None:
            self.pool.release(self.layer, left.reshape(left.shape[0], -1))
        self._recycled, self._recycled_off = None, 0

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

    def _append_one(
        self, k: Tensor, v: Tensor, positions: Tensor, modality: Tensor, order: Tensor | None = None
    ) -> Tensor:
        """:meth:`append` of one new entry per sample (a decode step), in a third of its tensor ops.

        ``k, v (B, H_kv, 1, D)``, ``positions (B, 1, P)``, ``modality (B, 1)``, ``order`` None or
        ``(B, 1)``; returns ``(B,)`` past lengths.
        """
        b, dev = k.shape[0], self.device
        if b == 1:  # the one-sample path a batch view takes too: no index tensors
            past = self.lengths  # returned: ``put_one`` gives the layer a new lengths tensor
            orders = [None] if order is None else order[:, 0].tolist()
            append_one_each([self], k, v, positions[:, 0].tolist(), modality[:, 0].tolist(), orders)
            return past
        past = self.lengths.clone()  # returned: later in-place edits of ``lengths`` must not reach it
        lens = past.tolist()
        self._reserve(max(lens) + 1)
        ids = self._take_recycled()
        if ids is None:
            ids = self.pool.alloc(self.layer, b)  # (H_kv, B): sample-major, as the general path allocates
        self.pool.write(
            self.layer, ids, k[:, :, 0].to(dev).transpose(0, 1), v[:, :, 0].to(dev).transpose(0, 1)
        )
        # a batch moving in step writes one column of every table (a slice); a ragged one indexes
        at = (slice(None), slice(None), lens[0]) if min(lens) == lens[0] == max(lens) else None
        if at is None:
            bi = torch.arange(b, device=dev)
            at = (bi, slice(None), past)
        self.slots[at] = ids.t()
        self.positions[at] = positions.to(dev)[:, 0, None, :].to(torch.long)
        self.modality[at] = modality.to(dev).to(torch.int8)
        if order is None:
            self.order[at] = self.next_order[:, None]
            self.next_order = self.next_order + 1
        else:
            order = order.to(device=dev, dtype=torch.long)[:, 0]
            self.order[at] = order[:, None]
            self.next_order = torch.maximum(self.next_order, order + 1)
        for s in self.scores.values():
            s[at] = 0
        if self.holes is not None:
            self.holes[at] = False
        self.lengths = past + 1
        return past

    def put_one(
        self,
        p: int,
        ids: Tensor | None,
        pos: list[int],
        mod: int,
        order: int | None,
        run_id: int | None = None,
    ) -> None:
        """Table writes of one new entry of this one-sample cache at column ``p`` (after
        :meth:`_reserve`, its K/V already in the pool): ``ids (H_kv,)`` its slots (None: ``run_id`` in
        every head), ``pos`` its ``P`` position components, ``mod`` its modality code, ``order`` its
        sequence index (None: the next one). ``run_id``: the slot id the entry has in every head when
        it is the run's next spare. Plain Python values: a queued entry keeps no view of the step's
        tensors (a caller may advance them in place).

        An entry that continues the memoised run of a cache without per-entry scores or holes is only
        queued (``_tail``): its slot follows from the run, and its metadata is written with the
        others' by :meth:`_flush` when a table is next read, so a decode step of the full cache writes
        no tables (each write is a kernel call per request and layer).
        """
        start = None if run_id is None else self._run_ends_at(p)
        if start is not None and run_id == start + p and not self.scores and self.holes is None:
            self._tail.append((pos, mod, order))
            self.lengths = self.lengths + 1
            return
        self.slots[0, :, p] = run_id if ids is None else ids
        self.positions[0, :, p] = torch.tensor(pos, device=self.device)
        self.modality[0, :, p] = mod
        if order is None:
            self.order[0, :, p] = self.next_order
            self.next_order = self.next_order + 1
        else:
            self.order[0, :, p] = order
            self.next_order = self.next_order.clamp(min=order + 1)
        for s in self.scores.values():
            s[0, :, p] = 0
        if self.holes is not None:
            self.holes[0, :, p] = False
        self.lengths = self.lengths + 1
        if start is not None and run_id == start + p:
            self._run = (self.slots, self.slots._version, p + 1, start)

    def _flush(self) -> None:
        """Write the queued decode entries (:meth:`put_one`) into the tables: the run's next columns."""
        tail, self._tail = self._tail, []
        memo = self._run
        if memo is None or memo[0] is not self._slots:
            raise RuntimeError(f"layer {self.layer}: queued decode entries lost their run (table replaced)")
        n, k, start, dev = memo[2], len(tail), memo[3], self._slots.device
        cols = slice(n, n + k)
        self._slots[0, :, cols] = torch.arange(start + n, start + n + k, device=dev)
        self._positions[0, :, cols] = torch.tensor([t[0] for t in tail], device=dev)
        self._modality[0, :, cols] = torch.tensor([t[1] for t in tail], dtype=torch.int8, device=dev)
        nxt, orders = int(self._next_order[0]), []
        for _, _, o in tail:
            orders.append(nxt if o is None else o)
            nxt = nxt + 1 if o is None else max(nxt, o + 1)
        self._order[0, :, cols] = torch.tensor(orders, device=dev)
        self._next_order = torch.tensor([nxt], device=dev)
        self._run = (self._slots, self._slots._version, n + k, start)

    def ensure_score(self, name: str) -> Tensor:
        """A ``(B, H_kv, C)`` float32 running statistic, created as zeros on first use."""
        if name not in self.scores:
            self.scores[name] = torch.zeros(self.slots.shape, dtype=torch.float32, device=self.device)
        return self.scores[name]

    # ------------------------------------------------------------------ edits
    def _listed(self, index: Tensor, keep_len: Tensor) -> Tensor:
        """``(B, H_kv, K)`` bool: positions of ``index`` inside ``[:keep_len[b]]``."""
        ranks = torch.arange(index.shape[2], device=self.device)[None, None, :]
        return (ranks < keep_len.to(self.device)[:, None, None]).expand(index.shape)

    def _kept_mask(self, index: Tensor, keep_len: Tensor) -> Tensor:
        """``(B, H_kv, C)`` bool: table columns listed in ``index[..., :keep_len[b]]``."""
        ok = (
            torch.arange(index.shape[2], device=self.device)[None, None, :]
            < keep_len.to(self.device)[:, None, None]
        )
        kept = torch.zeros(self.slots.shape, dtype=torch.int8, device=self.device)
        return kept.scatter_reduce_(2, index, ok.to(torch.int8).expand_as(index), "amax").bool()

    def _release(self, drop: Tensor) -> None:
        """Drop this cache's reference to the slots of valid entries where ``drop (B, H_kv, C)`` is True."""
        bt, ht, ct = torch.nonzero(drop & self.held_mask(), as_tuple=True)
        self.pool.release(self.layer, self.slots[bt, ht, ct], heads=ht)

    def _take(self, index: Tensor, slots: int) -> dict[str, Tensor]:
        """Gather per-entry tables; ``index`` is ``(B, H_kv, K)``, padded with any valid column.

        The ``slots - K`` columns past ``index`` (room for appends) are gathered from column 0 like
        padding: past a sample's length a column's content is never read as an entry."""
        if index.shape[2] < slots and self.capacity:
            index = torch.cat([index, index.new_zeros(*index.shape[:2], slots - index.shape[2])], 2)

        def g(t: Tensor) -> Tensor:
            out = _gather_columns(t, index)
            if out.shape[2] < slots:  # an empty table: zero columns for appends
                out = torch.cat([out, out.new_zeros(*out.shape[:2], slots - out.shape[2], *out.shape[3:])], 2)
            return out

        return {
            "slots": g(self.slots),
            "positions": g(self.positions),
            "modality": g(self.modality),
            "order": g(self.order),
            **({} if self.holes is None else {"holes": g(self.holes)}),
            **{f"score:{n}": g(s) for n, s in self.scores.items()},
        }

    def select(
        self,
        index: Tensor,
        keep_len: Tensor,
        spare: int = 0,
        holes: Tensor | None = None,
        recycle: bool = False,
    ) -> None:
        """Keep only the indexed entries, in the given order; free the others' pool slots.

        Args:
            index: ``(B, H_kv, K)`` int64 table columns to keep, ascending within ``[:keep_len[b]]``;
                entries past ``keep_len[b]`` are padding (any in-range column).
            keep_len: ``(B,)`` int64 entries kept per sample.
            spare: extra table columns to keep for the coming appends.
            holes: optional ``(B, H_kv, K)`` bool: listed columns that become holes for that head
                (the column stays, the head's entry is freed and no longer attended).
            recycle: a decode-time eviction: up to ``RECYCLE_MAX`` dropped slots per sample and head
                that only this cache references become the slots its coming appends write (see
                :meth:`_drop`) instead of going back to the pool.
        """
        index, keep_len = index.to(self.device), keep_len.to(device=self.device, dtype=torch.long)
        if (
            holes is None
            and self.holes is None
            and self.lowrank is None
            and self._uniform_select(index, keep_len, spare, recycle)
        ):
            return
        kept = self._kept_mask(index, keep_len)
        if holes is not None:
            holes = holes.to(self.device) & self._listed(index, keep_len)
            if bool(holes.any()):
                punched = torch.zeros(self.slots.shape, dtype=torch.bool, device=self.device)
                kept = kept & ~punched.scatter_(2, index, holes)
                if self.holes is None:
                    self.holes = torch.zeros(self.slots.shape, dtype=torch.bool, device=self.device)
            else:
                holes = None
        self._release(~kept)
        meta = self._take(index, index.shape[2] + spare)
        if holes is not None:
            meta["holes"][:, :, : index.shape[2]] |= holes
            meta["slots"] = meta["slots"].masked_fill(meta["holes"], 0)  # a freed id names nothing
        self._install(meta, keep_len)
        if self.lowrank is not None:
            self.lowrank.prune(self)
            self.charge_factors()

    def cut(self, start: Tensor, count: Tensor, recycle: bool = False) -> None:
        """Delete entries ``start[b] … start[b] + count[b] − 1`` of sample ``b``; the later ones move
        left by ``count[b]``, in order (a fixed-point eviction, see :class:`~vlkv.runtime.policies.base.CutEdit`).

        Copies only the columns after the cut, one slice per table when the samples cut alike (a
        batch moving in step, or one request), where :meth:`select` gathers every table whole.
        ``start``, ``count``: ``(B,)`` int64, ``0 <= start[b]`` and ``start[b] + count[b] <=
        lengths[b]``; ``recycle``: as in :meth:`select`. A cache with per-head holes or low-rank
        factors takes :meth:`select` (their bookkeeping lives there).
        """
        starts, counts, lens = start.tolist(), count.tolist(), self.lengths.tolist()
        for b, (s, c, n) in enumerate(zip(starts, counts, lens)):
            if c < 0 or (c and not 0 <= s <= n - c):
                raise ValueError(
                    f"layer {self.layer}: cut of {c} entries at column {s} of sample {b}, which holds {n}"
                )
        if not any(counts):
            return
        if self.holes is not None or self.lowrank is not None:
            width = max(n - c for n, c in zip(lens, counts))
            j = torch.arange(max(width, 1), device=self.device)[None, :]
            s, c = start.to(self.device)[:, None], count.to(self.device)[:, None]
            index = (j + (j >= s).long() * c).clamp(max=max(max(lens) - 1, 0))
            index = index[:, None].expand(-1, self.kv_heads, -1)
            self.select(index, self.lengths - count.to(self.lengths), recycle=recycle)
            return
        tables = self._entry_tables()
        alike = len(set(starts)) == len(set(counts)) == len(set(lens)) == 1
        rows = [slice(None)] if alike else [slice(b, b + 1) for b, c in enumerate(counts) if c]
        dropped = []
        for row in rows:
            b = row.start or 0
            s, c, n = starts[b], counts[b], lens[b]
            dropped.append(self.slots[row, :, s : s + c].clone())
            if s + c < n:
                for t in tables:  # overlapping ranges: the source is copied first
                    t[row, :, s : n - c] = t[row, :, s + c : n].clone()
        self.lengths = self.lengths - count.to(self.lengths)
        if alike:
            self._drop(dropped[0], recycle)
        else:  # samples cut differently: no per-sample recycled columns of one width
            self.pool.release(self.layer, torch.cat([d[0] for d in dropped], 1))

    def merge(self, index: Tensor, keep_len: Tensor, assign: Tensor, counts: Tensor) -> None:
        """Keep the indexed anchors and replace each by the mean of the entries assigned to it.

        Only anchors whose value changes are written to the pool; the other entries' slots are freed.

        Args:
            index: ``(B, H_kv, K)`` anchor columns (their metadata is kept), as in :meth:`select`.
            keep_len: ``(B,)`` anchors per sample.
            assign: ``(B, H_kv, S)`` int64 target anchor in ``[0, K)`` for every column, or -1 to drop.
            counts: ``(B, H_kv, K)`` int64 sources per anchor (>= 1 for real anchors).
        """
        from vlkv.plugins import merge_kv
        from vlkv.runtime.kv.lowrank import densify

        if self.holes is not None and bool(self.holes.any()):
            raise ValueError("merging needs every head to hold its entries; this cache has per-head holes")
        densify(self)  # merged anchors are rewritten in place: they need pool slots
        dev = self.device
        index, keep_len = index.to(dev), keep_len.to(device=dev, dtype=torch.long)
        assign, counts = assign.to(dev), counts.to(dev)
        n, kk = assign.shape[2], index.shape[2]
        keys, values = self.attention_kv(n)
        mk, mv = merge_kv(keys, values, assign, counts)  # (B, H_kv, K, D)
        anchor_slots = self.slots.gather(2, index)
        ranks = torch.arange(kk, device=dev)[None, None, :]
        own = assign.gather(2, index.clamp(max=n - 1))
        changed = (ranks < keep_len[:, None, None]) & ((counts != 1) | (own != ranks))
        bt, ht, jt = torch.nonzero(changed, as_tuple=True)
        self.pool.write_entries(self.layer, ht, anchor_slots[bt, ht, jt], mk[bt, ht, jt], mv[bt, ht, jt])
        self._release(~self._kept_mask(index, keep_len))
        self._install(self._take(index, kk), keep_len)

    def _install(self, meta: dict[str, Tensor], lengths: Tensor) -> None:
        self.slots = meta["slots"].contiguous()
        self.lengths = lengths.to(torch.long).clone()
        self.positions, self.modality, self.order = meta["positions"], meta["modality"], meta["order"]
        self.holes = meta.get("holes")
        self.scores = {n[len("score:") :]: t for n, t in meta.items() if n.startswith("score:")}

    def valid_mask(self, width: int | None = None) -> Tensor:
        """``(B, width)`` bool (default: the table's capacity), True at valid table columns."""
        n = self.capacity if width is None else width
        return torch.arange(n, device=self.device)[None, :] < self.lengths[:, None]

    def table(self, width: int) -> Tensor:
        """``(B, H_kv, width)`` slot ids of the first ``width`` columns (0 past the table's capacity)."""
        t = self.slots[:, :, :width]
        if t.shape[2] < width:
            t = torch.cat([t, t.new_zeros(*t.shape[:2], width - t.shape[2])], dim=2)
        return t

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
        if self.spare_ids is not None:
            self.spare_ids = remap.gather(1, self.spare_ids)
            self._spare_next = None  # a compaction need not keep the run
        left = self.recycled
        if left is not None:
            self._recycled, self._recycled_off = (
                remap.gather(1, left.reshape(left.shape[0], -1)).view(left.shape),
                0,
            )
        if self.ballast is not None:
            self.ballast = remap.gather(1, self.ballast)

    def release(self) -> None:
        """Free every slot this cache holds (finished or cancelled request); the cache is empty after."""
        self.release_spare()
        self._release(torch.ones(self.slots.shape, dtype=torch.bool, device=self.device))
        self.lengths = torch.zeros_like(self.lengths)
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
        lengths = self.lengths.clone()
        self._release(torch.ones(self.slots.shape, dtype=torch.bool, device=self.device))
        self.lengths = lengths  # the metadata stays; the entries come back in :meth:`reload`

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


def _gather_columns(t: Tensor, index: Tensor) -> Tensor:
    """Columns ``index (B, H_kv, K)`` of a per-entry table ``t (B, H_kv, C)`` or ``(B, H_kv, C, P)``."""
    return t.gather(2, index if t.dim() == 3 else index[..., None].expand(-1, -1, -1, t.shape[-1]))


def append_one_each(
    rows: list[LayerKV],
    k: Tensor,
    v: Tensor,
    positions: list[list[int]],
    modality: list[int],
    orders: list[int | None],
) -> list[int]:
    """One new entry for each one-sample layer of ``rows`` (a decode step; every row on the same pool
    layer): one pool write for all of them, then each row's table entry (queued while it continues
    the row's run, see :meth:`LayerKV.put_one`).

    ``k, v (B, H_kv, 1, D)`` (row ``b`` for ``rows[b]``); ``positions``, ``modality``, ``orders``: per
    row its ``P`` position components, modality code and sequence index (None: the next one).
    Returns each row's length before the write.
    """
    pool, layer = rows[0].pool, rows[0].layer
    spec = pool.spec
    past = [int(r.lengths.item()) for r in rows]
    for r, p in zip(rows, past):
        r._reserve(p + 1)
    spare = [r.take_spare() for r in rows]
    run_ids = [s if isinstance(s, int) else None for s in spare]
    kh, vh = k[:, :, 0].to(spec.device).transpose(0, 1), v[:, :, 0].to(spec.device).transpose(0, 1)
    ids = None  # (H_kv, B) when some row does not continue its run
    if all(s is not None for s in run_ids):
        pool.write_columns(layer, torch.tensor(run_ids, device=spec.device), kh, vh)
    else:
        fresh = iter(pool.alloc(layer, sum(s is None for s in spare)).unbind(1))
        cols = []
        for s in spare:
            if isinstance(s, int):
                s = torch.full((spec.kv_heads,), s, dtype=torch.long, device=spec.device)
            cols.append(next(fresh) if s is None else s)
        ids = torch.stack(cols, 1)
        pool.write(layer, ids, kh, vh)
    for i, r in enumerate(rows):
        col = None if run_ids[i] is not None else ids[:, i]
        r.put_one(past[i], col, positions[i], modality[i], orders[i], run_ids[i])
    return past


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
