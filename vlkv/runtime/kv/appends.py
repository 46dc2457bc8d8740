"""Appends: a step's new entries written into fresh pool slots right after each sample's entries.

Only the new entries' K/V are written (one pool write per layer and step) and only their table
columns; nothing already cached moves. A decode step (one new row per sample) takes a shorter path
with a third of the tensor ops: for a batch cache one column of every table, for a scheduler's
one-sample caches one pool write for all of them (:func:`append_one_each`), then one column each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.entries import EntryTable
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.kv.reservation import next_order, reserve_decode_entries
from vlkv.runtime.kv.spares import SpareSlots


class Appends(EntryTable):
    """The append half of :class:`~vlkv.runtime.kv.layer.LayerKV` (its pool binding lives there)."""

    pool: KVPool
    layer: int
    spares: SpareSlots
    run_reserve: int
    # the step log of :func:`~vlkv.runtime.kv.reservation.undone_on_failure` while a step runs over it
    step_log: list | None = None

    def append(
        self,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        modality: Tensor,
        new_len: Tensor,
        order: Tensor | None = None,
        one_each: bool | None = None,
    ) -> Tensor:
        """Write a step's new entries into fresh pool slots right after each sample's valid entries.

        Args:
            k, v: ``(B, H_kv, q, D)`` new keys (post-RoPE) and values; rows ``>= new_len[b]`` are padding.
            positions: ``(B, q, P)`` int64 original positions of the new tokens.
            modality: ``(B, q)`` int8 codes.
            new_len: ``(B,)`` int64 valid new rows per sample.
            order: optional ``(B, q)`` int64 sequence index of each new token (default: the next
                indices after the last one this layer holds).
            one_each: whether every sample appends a row (``new_len`` all nonzero), where the caller
                knows it (a decode step decides it once for every layer: read here, it is a host sync
                per layer); None: read from ``new_len``.

        Returns:
            ``(B,)`` lengths before the write (the table column of each sample's first new row).
        """
        b, h, q, _ = k.shape
        dev = self.device
        new_len = new_len.to(device=dev, dtype=torch.long)
        if q == 1 and (bool(new_len.all()) if one_each is None else one_each):
            return self._append_one(k, v, positions, modality, order)
        past, past_host = self.lengths.clone(), self.host_lengths()
        self._reserve(max(past_host, default=0) + q)
        rows = torch.arange(q, device=dev)
        valid = rows[None, :] < new_len[:, None]  # (B, q)
        bt, it = torch.nonzero(valid, as_tuple=True)  # row-major: sample, then row
        ids = self._alloc_prompt(bt.numel(), past)  # (H_kv, T)
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
        self.set_lengths(past + new_len, [p + n for p, n in zip(past_host, new_len.tolist())])
        return past

    def _mark(self) -> tuple:
        """What a decode reservation replaces, as it is now: the lengths and their host copy (no read
        back), the next sequence indices and the per-entry tables (growing them replaces them). It
        assigns new tensors to all of them and writes in place only at the new column, past every
        length, so :meth:`_restore` of this mark undoes it."""
        return (
            self._lengths, self._host, self.next_order,
            self.slots, self.positions, self.modality, self.order, self.scores, self.holes,
        )  # fmt: skip

    def _restore(self, mark: tuple) -> None:
        """Put back what :meth:`_mark` returned."""
        (
            self._lengths, self._host, self.next_order,
            self.slots, self.positions, self.modality, self.order, self.scores, self.holes,
        ) = mark  # fmt: skip

    def _alloc_prompt(self, n: int, past: Tensor) -> Tensor:
        """``(H_kv, n)`` slots for a step's new entries: with ``run_reserve`` on a fresh one-sample
        cache of a growable pool, the first ``n`` of one run whose rest the spares hold."""
        fresh = self.batch == 1 and self.spares.ids is None and n > 0 and not any(self.host_lengths())
        if self.run_reserve > 0 and self.pool.grow and fresh:
            run = self.pool.alloc_run(self.layer, n + self.run_reserve)
            self.spares.hold_run(run[:, n:], int(run[0, 0]) + n)
            return run[:, :n]
        return self.pool.alloc(self.layer, n)

    def _append_one(
        self, k: Tensor, v: Tensor, positions: Tensor, modality: Tensor, order: Tensor | None = None
    ) -> Tensor:
        """:meth:`append` of one new entry per sample (a decode step), in a third of its tensor ops: the
        host half reserved (:func:`~vlkv.runtime.kv.reservation.reserve_decode_entries`, as the fused
        append does), then one pool write and the new column; a failed write takes the reservation back.

        ``k, v (B, H_kv, 1, D)``, ``positions (B, 1, P)``, ``modality (B, 1)``, ``order`` None or
        ``(B, 1)``; returns ``(B,)`` past lengths.
        """
        b, dev = k.shape[0], self.device
        if b == 1:  # the one-sample path a batch view takes too: no index tensors
            past = self.lengths  # returned: the reservation gives the layer a new lengths tensor
            orders = [None] if order is None else list(order[:, 0].to(device=dev, dtype=torch.long))
            append_one_each([self], k, v, list(positions[:, 0].to(dev)), list(modality[:, 0].to(dev)), orders)
            return past
        given = None if order is None else order.to(device=dev, dtype=torch.long)[:, 0]
        # the column's sequence indices, read before the reservation advances ``next_order``
        col_order = self.next_order[:, None] if given is None else given[:, None]
        res = reserve_decode_entries([self], None if given is None else given + 1)
        try:
            kh, vh = k[:, :, 0].to(dev).transpose(0, 1), v[:, :, 0].to(dev).transpose(0, 1)
            self.pool.write(self.layer, res.ids, kh, vh, count=False)
            at = res.column()
            self.slots[at] = res.ids.t()
            self.positions[at] = positions.to(dev)[:, 0, None, :].to(torch.long)
            self.modality[at] = modality.to(dev).to(torch.int8)
            self.order[at] = col_order
            if self.holes is not None:
                self.holes[at] = False
        except BaseException:
            res.cancel()
            raise
        return res.past

    # A batch cache's decode append in three host-side parts, run by its reservation
    # (:func:`~vlkv.runtime.kv.reservation.reserve_decode_entries`) for the Python append above and the
    # fused one (whose C++ call writes the rows and the column after it)
    def _decode_slots(self) -> tuple[list[int], Tensor, bool]:
        """Tables grown for one more column and the new entries' ``ids (H_kv, B)`` (sample-major, as the
        general path allocates): the recycled columns of decode evictions, else fresh from the pool.
        Returns the host lengths before, the ids and whether they came from the pool."""
        lens = self.host_lengths()
        self._reserve(max(lens) + 1)
        ids = self.spares.take_recycled()
        if ids is not None:
            return lens, ids, False
        return lens, self.pool.alloc(self.layer, self.batch), True

    def _decode_column(self, lens: list[int], past: Tensor) -> tuple:
        """The index of each sample's new column (``past (B,)``, ``lens`` its host copy): a batch moving
        in step writes one column of every table (a slice); a ragged one indexes."""
        if min(lens) == lens[0] == max(lens):
            return slice(None), slice(None), lens[0]
        return torch.arange(self.batch, device=self.device), slice(None), past

    def _decode_advance(
        self,
        at: tuple,
        past: Tensor,
        lens: list[int],
        next_order: Tensor,
        after: Tensor | None = None,
        zero_scores: bool = True,
    ) -> None:
        """After the new column (``at``): its running scores zeroed (``zero_scores`` False: the writer
        zeroes them, the fused C++ append), the next sequence indices, every sample one entry longer
        (``after``: ``past + 1`` where the step computed it for every layer)."""
        self.next_order = next_order
        for s in self.scores.values() if zero_scores else ():
            s[at] = 0
        self.set_lengths(past + 1 if after is None else after, [n + 1 for n in lens])

    def put_one(
        self,
        p: int,
        ids: Tensor | int,
        pos: Tensor | list[int],
        mod: Tensor | int,
        order: Tensor | int | None,
    ) -> None:
        """One new entry of this one-sample cache at column ``p`` (after :meth:`_reserve`, its K/V
        already in the pool): its table column (:meth:`_put_column`), the next sequence index, one
        entry longer. ``order`` None: the next index."""
        col_order = self.next_order if order is None else order
        self.next_order = next_order(self.next_order, None if order is None else order + 1)
        self._put_column(p, ids, pos, mod, col_order)
        self._advance_one(p)

    def _put_column(
        self, p: int, ids: Tensor | int, pos: Tensor | list[int], mod: Tensor | int, order: Tensor | int
    ) -> None:
        """Table writes of one new entry of this one-sample cache at column ``p``: ``ids`` its slots,
        ``(H_kv,)`` or one id for every head (the run's next spare), ``pos`` its ``P`` position
        components (``(P,)`` on the cache's device, or ints), ``mod`` its modality code and ``order``
        its sequence index (each a ``()`` or ``(1,)`` tensor on that device, or an int); no hole.

        Each table's column is written through one ``select`` of the column (the cache's one sample,
        every head: a ``(1, H_kv, ...)`` view) and one fill or copy that broadcasts into it: 2 ops a
        table where ``t[0, :, p] = x`` dispatched 3-5 (two selects, a scalar lifted to a tensor, an
        expand); this runs per request and layer of every decode step."""
        if self.slots.shape[0] != 1:  # a select of column p writes every sample's row (shape only: no op)
            raise ValueError(f"put_one writes a one-sample cache's column, got {self.slots.shape[0]} samples")
        _put(self.slots.select(2, p), ids)
        _put(
            self.positions.select(2, p),
            pos if isinstance(pos, Tensor) else torch.tensor(pos, device=self.device),
        )
        _put(self.modality.select(2, p), mod)
        _put(self.order.select(2, p), order)
        if self.holes is not None:
            self.holes.select(2, p).fill_(False)

    def _advance_one(self, p: int, after: Tensor | None = None, zero_scores: bool = True) -> None:
        """After a one-sample cache's new column ``p``: its running scores zeroed (``zero_scores``
        False: the writer zeroes them, :meth:`zero_score_column`, or its one launch / C++ call does),
        one entry longer (``after``: its ``(1,)`` new length where the step computed it for every
        layer)."""
        if zero_scores:
            self.zero_score_column(p)
        self.set_lengths(self.lengths + 1 if after is None else after, [p + 1])

    def zero_score_column(self, p: int) -> None:
        """A one-sample cache's running scores zeroed at column ``p`` (a new entry's): 2 ops a table."""
        for s in self.scores.values():
            s.select(2, p).zero_()


def _put(column: Tensor, value: Tensor | int) -> None:
    """Write ``value`` (a tensor broadcast to ``column``, or a Python scalar) into a table's column view."""
    if isinstance(value, Tensor):
        column.copy_(value)
    else:
        column.fill_(value)


def append_one_each(
    rows: list[Appends],
    k: Tensor,
    v: Tensor,
    positions: list[Tensor | list[int]],
    modality: list[Tensor | int],
    orders: list[Tensor | int | None],
) -> list[int]:
    """One new entry for each one-sample layer of ``rows`` (a decode step; every row on the same pool
    layer): the host half reserved (:func:`~vlkv.runtime.kv.reservation.reserve_decode_entries`), then
    one pool write for all of them and each row's table column (:meth:`Appends._put_column`); a failed
    write takes the reservation back (a fixed pool out of slots: nothing changed, no spare lost).

    ``k, v (B, H_kv, 1, D)`` (row ``b`` for ``rows[b]``); ``positions``, ``modality``, ``orders``: per
    row its ``P`` position components and modality code (as :meth:`Appends._put_column` takes them:
    device tensors need no read back) and sequence index (None: the next one).
    Returns each row's length before the write.
    """
    pool, layer = rows[0].pool, rows[0].layer
    # each column's sequence index, read before the reservation advances ``next_order``
    col_orders = [r.next_order if o is None else o for r, o in zip(rows, orders)]
    res = reserve_decode_entries(rows, None, [None if o is None else o + 1 for o in orders])
    try:
        dev = pool.spec.device
        kh, vh = k[:, :, 0].to(dev).transpose(0, 1), v[:, :, 0].to(dev).transpose(0, 1)
        if res.run is not None:  # every row continues its run: one id per row
            pool.write_columns(layer, res.run, kh, vh, count=False)
            cols: list[Tensor | int] = list(res.spare)
        else:
            pool.write(layer, res.ids, kh, vh, count=False)
            # a row continuing its run writes its table column from its int id (one scalar fill)
            cols = [s if isinstance(s, int) else res.ids[:, i] for i, s in enumerate(res.spare)]
        for r, p, col, pos, mod, order in zip(rows, res.host, cols, positions, modality, col_orders):
            r._put_column(p, col, pos, mod, order)
    except BaseException:
        res.cancel()
        raise
    return res.host
