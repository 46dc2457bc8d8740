"""Edits of a layer's cache: keep some entries (select, cut), or merge them into anchors.

Eviction frees the evicted slots and rewrites only the tables: the surviving K/V never move, so an
evicting decode step writes O(new tokens) K/V bytes. :meth:`Edits.merge` writes only the anchors whose
value changed. A decode-time eviction (``recycle``) of a few entries keeps their slots for the next
appends (:class:`~vlkv.runtime.kv.spares.SpareSlots`) instead of a pool release now and an
allocation next step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.entries import EntryTable, gather_columns
from vlkv.runtime.kv.lowrank import densify
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.kv.spares import SpareSlots

# most slots per head a decode-time eviction hands to the cache's next appends instead of the pool
RECYCLE_MAX = 16


class Edits(EntryTable):
    """The edit half of :class:`~vlkv.runtime.kv.layer.LayerKV` (its pool binding lives there)."""

    pool: KVPool
    layer: int
    spares: SpareSlots
    lowrank: object | None

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
                t[:, :, head:k] = gather_columns(t, cols)
            self.lengths = keep_len.to(torch.long).clone()
        if dropped is not None:
            # after the tables: a compaction the release starts remaps the new table (and clears
            # the columns past the new length, which still name the dropped slots)
            self._drop(dropped.view(b, h, n - k), recycle)
        return True

    def _kept_prefix(self, index: Tensor, k: int) -> int:
        """``k - k // 4`` when every row of ``index (B, H_kv, ≥k)`` keeps its first ``k - k // 4``
        columns where they are, else 0. One column tells: ascending distinct columns with
        ``index[j] == j`` keep ``0 … j`` in place."""
        j = k - k // 4
        if j == k or not bool((index[:, :, j] == j).all()):
            return 0
        return j if int(index[:, :, j:k].min()) >= j else 0  # an index out of order: rebuild

    def _drop(self, dropped: Tensor, recycle: bool) -> None:
        """Let go of the slots ``dropped (B, H_kv, m)`` this cache no longer lists: a decode-time
        eviction's few (``m <= RECYCLE_MAX``) that no one else references are kept as spares the next
        appends write; larger drops (a prompt's eviction) go back to the pool."""
        b, h, m = dropped.shape
        per_head = dropped.transpose(0, 1).reshape(h, b * m)  # (H_kv, B·m)
        if not recycle or m > RECYCLE_MAX or not self.pool.sole_owner(self.layer, per_head):
            self.pool.release(self.layer, per_head)
            return
        self.spares.keep(dropped)

    def _release(self, drop: Tensor) -> None:
        """Drop this cache's reference to the slots of valid entries where ``drop (B, H_kv, C)`` is True."""
        bt, ht, ct = torch.nonzero(drop & self.held_mask(), as_tuple=True)
        self.pool.release(self.layer, self.slots[bt, ht, ct], heads=ht)

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
        from vlkv.plugins import merge_kv  # the plugins package loads its kernels lazily

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
