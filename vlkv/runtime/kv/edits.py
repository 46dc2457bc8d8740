"""Edits of a layer's cache: keep some entries (select, cut), or merge them into anchors.

Eviction frees the evicted slots and rewrites only the tables: at decode the surviving K/V never
move, so an evicting decode step writes O(new tokens) K/V bytes; a prompt-time eviction packs what it
keeps into one run of slots per row (:mod:`~vlkv.runtime.kv.packing`, ``VLKV_PACK=0``: off). :meth:`Edits.merge` writes only the anchors whose
value changed. A decode-time eviction (``recycle``) of a few entries keeps their slots for the next
appends (:class:`~vlkv.runtime.kv.spares.SpareSlots`) instead of a pool release now and an
allocation next step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv import drops
from vlkv.runtime.kv.drops import RECYCLE_MAX, UniformSelect, prepare_selects, shift_kept, unlisted
from vlkv.runtime.kv.entries import EntryTable
from vlkv.runtime.kv.lowrank import densify
from vlkv.runtime.kv.packing import continue_run, held_slots, pack_kept, packable
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.kv.spares import SpareSlots

# the decode-drop names (``kv.drops``) stay importable from here, where they lived; its switch
# ``drops.IN_PLACE`` is read there
__all__ = ["RECYCLE_MAX", "Edits", "UniformSelect", "prepare_selects", "unlisted"]


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
        kept: list[int] | None = None,
        prepared: UniformSelect | None = None,
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
            kept: ``keep_len``'s values when the caller knows them on the host (no read back).
            prepared: :meth:`prepare_uniform` of this edit, its checks read (:func:`prepare_selects`).
        """
        keep_len = keep_len.to(device=self.device, dtype=torch.long)
        if index is not None:  # None only where ``prepared`` never reads it (``edits._index_unread``)
            index = index.to(self.device)
        if (
            holes is None
            and self.holes is None
            and self.lowrank is None
            and self._uniform_select(index, keep_len, spare, recycle, kept, prepared)
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
        before = self.host_lengths()
        keeps = keep_len.tolist()  # one read here, none per later read
        # a prompt's eviction (or any dropping more than a decode step's few) packs what it keeps
        held = None
        if holes is None and self.holes is None and self._packs(before, keeps, recycle):
            held = held_slots(self.slots, before)
            if not packable(self, held):
                held = None
        if held is None:
            self._release(~kept)
        meta = self._take(index, index.shape[2] + spare)
        if holes is not None:
            meta["holes"][:, :, : index.shape[2]] |= holes
            meta["slots"] = meta["slots"].masked_fill(meta["holes"], 0)  # a freed id names nothing
        self._install(meta, keep_len, keeps)
        if held is not None:
            self.pool.release(self.layer, continue_run(self, pack_kept(self, held, keeps)))
        if self.lowrank is not None:
            self.lowrank.prune(self)
            self.charge_factors()

    def prepare_uniform(
        self,
        index: Tensor,
        kept: list[int],
        spare: int = 0,
        recycle: bool = False,
        dropped: Tensor | None = None,
    ) -> UniformSelect | None:
        """What :meth:`select` of ``index (B, H_kv, K)`` keeping ``kept[b]`` entries (host values)
        must know before it edits this cache in place, computed on the device without reading it
        back, so that a caller editing many layers reads every layer's checks in one transfer
        (:func:`prepare_selects`). None when the host values alone rule the uniform path out (see
        :meth:`_uniform_select`). ``dropped``: ``(B, H_kv, n - k)`` the ascending columns ``index``
        leaves out, where the selection knew them (``LayerEdit.dropped``): trusted, not searched
        for (nor ``index`` checked for repeats)."""
        if self.holes is not None or self.lowrank is not None:
            return None
        lengths = self.host_lengths()
        if not lengths or min(lengths) != max(lengths) or min(kept) != max(kept):
            return None
        n, k = lengths[0], kept[0]
        if index is None and n > k and (dropped is None or dropped.shape[2] != n - k):
            return None  # the caller's index not built (``DropOneEdit``): select rebuilds with it
        index = None if index is None else index.to(self.device)
        # a decode step's eviction of a few entries per row (H2O's, A-VL's, recent text) rewrites
        # the tables in place from the first column it drops; anything else rebuilds them at their
        # new width (a prompt's eviction: they shrink), packing what it keeps (``kv.packing``)
        in_place = drops.IN_PLACE and recycle and 0 < n - k <= RECYCLE_MAX and k + spare <= self.capacity
        distinct = sole = cols = None
        if n > k and dropped is not None and dropped.shape[2] == n - k:
            cols = dropped.to(self.device)
        elif n > k:
            listed = torch.zeros(self.batch, self.kv_heads, n, dtype=torch.int8, device=self.device)
            listed.scatter_(2, index[:, :, :k], 1)
            distinct = listed.sum(2).eq(k).all()  # else ``index`` repeats a column
            cols = unlisted(listed, n - k)
        gone = first = None
        if cols is not None:
            gone = self.slots.narrow(2, 0, n).gather(2, cols)  # (B, H_kv, n - k)
            if recycle and n - k <= RECYCLE_MAX:
                sole = self.pool.owned_once(self.layer, gone.transpose(0, 1).reshape(self.kv_heads, -1))
            if in_place:  # the columns before every row's first drop are kept where they are
                first = cols.select(2, 0).min()
        return UniformSelect(n, k, in_place, distinct, sole, gone, first=first, cols=cols)

    def _uniform_select(
        self,
        index: Tensor,
        keep_len: Tensor,
        spare: int,
        recycle: bool,
        kept: list[int] | None,
        prepared: UniformSelect | None,
    ) -> bool:
        """:meth:`select` of a cache whose samples hold the same number of entries and keep the same
        number, every head holding its columns (a decode-time eviction of a batch moving in step, or
        of one request): the dropped slots are the unlisted columns, no masks over the whole table.
        Returns False (nothing changed) when the shape does not fit or ``index`` repeats a column.
        ``prepared``: this edit's :meth:`prepare_uniform`, its checks read back (else read here)."""
        if prepared is None:
            prepared = self.prepare_uniform(
                index, keep_len.tolist() if kept is None else kept, spare, recycle
            )
            if prepared is None:
                return False
        if prepared.checks is None:
            prepared.read_back()  # this layer's one read back
        distinct, sole = prepared.checks
        if not distinct:
            return False
        n, k, b, h = prepared.n, prepared.k, self.batch, self.kv_heads
        keeps = [k] * b
        if prepared.in_place:
            if not prepared.moved:  # else one call closed every layer's gaps (``drops.prepare_selects``)
                self._shift_kept(index, prepared.first_col, k, prepared.cols)
            self.set_lengths(keep_len.to(device=self.device, dtype=torch.long).clone(), keeps)
        else:
            before = self.host_lengths()
            held = held_slots(self.slots, before) if self._packs(before, keeps, recycle) else None
            if held is not None and packable(self, held):
                self._install(self._take(index, index.shape[2] + spare), keep_len, keeps)
                self.pool.release(self.layer, continue_run(self, pack_kept(self, held, keeps)))
                return True
            self._install(self._take(index, index.shape[2] + spare), keep_len, keeps)
        if prepared.dropped is not None:
            # after the tables: a compaction the release starts remaps the new table (and clears
            # the columns past the new length, which still name the dropped slots)
            dropped = prepared.dropped
            if dropped.shape != (b, h, n - k):
                dropped = dropped.view(b, h, n - k)
            self._drop(dropped, recycle, sole)
        return True

    @staticmethod
    def _packs(before: list[int], kept: list[int], recycle: bool) -> bool:
        """Whether an edit from ``before[b]`` to ``kept[b]`` entries packs what it keeps
        (``kv.packing``): a prompt's eviction, or one dropping more than a decode step's few."""
        return not recycle or any(n - k > RECYCLE_MAX for n, k in zip(before, kept))

    def _shift_kept(self, index: Tensor, first: int, k: int, cols: Tensor | None = None) -> None:
        """:func:`~vlkv.runtime.kv.drops.shift_kept` of this cache's per-entry tables."""
        shift_kept(self._entry_tables(), index, first, k, cols)

    def _drop(self, dropped: Tensor, recycle: bool, sole: bool | None = None) -> None:
        """Let go of the slots ``dropped (B, H_kv, m)`` this cache no longer lists: a decode-time
        eviction's few (``m <= RECYCLE_MAX``) that no one else references (``sole``; None: ask the
        pool) are kept as spares the next appends write; larger drops (a prompt's eviction) go back
        to the pool."""
        b, h, m = dropped.shape
        if recycle and m <= RECYCLE_MAX and sole is None:
            sole = self.pool.sole_owner(self.layer, dropped.transpose(0, 1).reshape(h, b * m))
        if not recycle or m > RECYCLE_MAX or not sole:
            self.pool.release(self.layer, dropped.transpose(0, 1).reshape(h, b * m))  # (H_kv, B·m)
            return
        self.spares.keep(dropped)

    def _release(self, drop: Tensor) -> None:
        """Drop this cache's reference to the slots of valid entries where ``drop (B, H_kv, C)`` is True."""
        bt, ht, ct = torch.nonzero(drop & self.held_mask(), as_tuple=True)
        self.pool.release(self.layer, self.slots[bt, ht, ct], heads=ht)

    def cut(
        self,
        start: Tensor,
        count: Tensor,
        recycle: bool = False,
        host: tuple[list[int], list[int]] | None = None,
        sole: bool | None = None,
    ) -> None:
        """Delete entries ``start[b] … start[b] + count[b] − 1`` of sample ``b``; the later ones move
        left by ``count[b]``, in order (a fixed-point eviction, see :class:`~vlkv.runtime.policies.base.CutEdit`).

        Copies only the columns after the cut, one slice per table when the samples cut alike (a
        batch moving in step, or one request), where :meth:`select` gathers every table whole.
        ``start``, ``count``: ``(B,)`` int64, ``0 <= start[b]`` and ``start[b] + count[b] <=
        lengths[b]``; ``recycle``: as in :meth:`select`. A cache with per-head holes or low-rank
        factors takes :meth:`select` (their bookkeeping lives there). ``host``: ``(starts, counts)`` as
        Python ints where the caller read them (else read here); ``sole``: whether the cut slots have no
        other holder, where the caller checked it for every layer at once
        (:func:`~vlkv.runtime.kv.drops.cut_soles`; else asked here when they are recycled).
        """
        starts, counts = (start.tolist(), count.tolist()) if host is None else (list(host[0]), list(host[1]))
        lens = self.host_lengths()
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
        self.set_lengths(self.lengths - count.to(self.lengths), [n - c for n, c in zip(lens, counts)])
        if alike:
            self._drop(dropped[0], recycle, sole)
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
        self._install(self._take(index, kk), keep_len, keep_len.tolist())
