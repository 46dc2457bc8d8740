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
from vlkv.runtime.kv.spares import SpareSlots


class Appends(EntryTable):
    """The append half of :class:`~vlkv.runtime.kv.layer.LayerKV` (its pool binding lives there)."""

    pool: KVPool
    layer: int
    spares: SpareSlots
    run_reserve: int

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
        """:meth:`append` of one new entry per sample (a decode step), in a third of its tensor ops.

        ``k, v (B, H_kv, 1, D)``, ``positions (B, 1, P)``, ``modality (B, 1)``, ``order`` None or
        ``(B, 1)``; returns ``(B,)`` past lengths.
        """
        b, dev = k.shape[0], self.device
        if b == 1:  # the one-sample path a batch view takes too: no index tensors
            past = self.lengths  # returned: ``put_one`` gives the layer a new lengths tensor
            orders = [None] if order is None else list(order[:, 0].to(device=dev, dtype=torch.long))
            append_one_each([self], k, v, list(positions[:, 0].to(dev)), list(modality[:, 0].to(dev)), orders)
            return past
        past = self.lengths.clone()  # returned: later in-place edits of ``lengths`` must not reach it
        lens, ids, _ = self._decode_slots()
        self.pool.write(
            self.layer, ids, k[:, :, 0].to(dev).transpose(0, 1), v[:, :, 0].to(dev).transpose(0, 1)
        )
        at = self._decode_column(lens, past)
        self.slots[at] = ids.t()
        self.positions[at] = positions.to(dev)[:, 0, None, :].to(torch.long)
        self.modality[at] = modality.to(dev).to(torch.int8)
        if order is None:
            self.order[at] = self.next_order[:, None]
            next_order = self.next_order + 1
        else:
            order = order.to(device=dev, dtype=torch.long)[:, 0]
            self.order[at] = order[:, None]
            next_order = torch.maximum(self.next_order, order + 1)
        if self.holes is not None:
            self.holes[at] = False
        self._decode_advance(at, past, lens, next_order)
        return past

    # A batch cache's decode append in three host-side parts, shared by the Python append above and the
    # fused one (:func:`reserve_decode_entries`, whose C++ call writes the rows and the column between)
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

    def _decode_advance(self, at: tuple, past: Tensor, lens: list[int], next_order: Tensor) -> None:
        """After the new column (``at``): its running scores zeroed, the next sequence indices, every
        sample one entry longer."""
        self.next_order = next_order
        for s in self.scores.values():
            s[at] = 0
        self.set_lengths(past + 1, [n + 1 for n in lens])

    def put_one(
        self,
        p: int,
        ids: Tensor | int,
        pos: Tensor | list[int],
        mod: Tensor | int,
        order: Tensor | int | None,
    ) -> None:
        """Table writes of one new entry of this one-sample cache at column ``p`` (after
        :meth:`_reserve`, its K/V already in the pool): ``ids`` its slots, ``(H_kv,)`` or one id for
        every head (the run's next spare), ``pos`` its ``P`` position components (``(P,)`` on the
        cache's device, or ints), ``mod`` its modality code and ``order`` its sequence index (each a
        ``()`` tensor on that device or an int; ``order`` None: the next one).

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
        if order is None:
            self.order.select(2, p).copy_(self.next_order)
            self.next_order = self.next_order + 1
        else:
            _put(self.order.select(2, p), order)
            if isinstance(order, Tensor):
                self.next_order = torch.maximum(self.next_order, order + 1)
            else:
                self.next_order = self.next_order.clamp(min=order + 1)
        if self.holes is not None:
            self.holes.select(2, p).fill_(False)
        self._advance_one(p)

    def _advance_one(self, p: int) -> None:
        """After a one-sample cache's new column ``p``: its running scores zeroed, one entry longer."""
        for s in self.scores.values():
            s.select(2, p).zero_()
        self.set_lengths(self.lengths + 1, [p + 1])


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
    layer): one pool write for all of them, then each row's table column (:meth:`Appends.put_one`).

    ``k, v (B, H_kv, 1, D)`` (row ``b`` for ``rows[b]``); ``positions``, ``modality``, ``orders``: per
    row its ``P`` position components and modality code (as :meth:`Appends.put_one` takes them: device
    tensors need no read back) and sequence index (None: the next one).
    Returns each row's length before the write.
    """
    pool, layer = rows[0].pool, rows[0].layer
    spec = pool.spec
    marks = [r.spares.mark() for r in rows]
    past, spare = _row_spares(rows)
    kh, vh = k[:, :, 0].to(spec.device).transpose(0, 1), v[:, :, 0].to(spec.device).transpose(0, 1)
    if all(isinstance(s, int) for s in spare):  # every row continues its run: one id per row
        pool.write_columns(layer, torch.tensor(spare, device=spec.device), kh, vh)
        cols: list[Tensor | int] = list(spare)
    else:
        try:
            ids = _row_slots(pool, layer, spare)[0]
        except BaseException:  # a fixed pool out of slots: the spares taken stay held, none is lost
            for r, m in zip(rows, marks):
                r.spares.rewind(m)
            raise
        pool.write(layer, ids, kh, vh)
        # a row continuing its run writes its table column from its int id (one scalar fill)
        cols = [s if isinstance(s, int) else ids[:, i] for i, s in enumerate(spare)]
    for r, p, col, pos, mod, order in zip(rows, past, cols, positions, modality, orders):
        r.put_one(p, col, pos, mod, order)
    return past


def _row_spares(rows: list[Appends]) -> tuple[list[int], list[Tensor | int | None]]:
    """Each one-sample row's length (kept on the host: no read back per row and layer) and its next
    run spare (:meth:`SpareSlots.take`), its tables grown for one more column."""
    past = [r.host_lengths()[0] for r in rows]
    for r, p in zip(rows, past):
        r._reserve(p + 1)
    return past, [r.spares.take() for r in rows]


def _row_slots(pool, layer: int, spare: list) -> tuple[Tensor, Tensor]:
    """``(H_kv, B)`` the slots of one new entry per one-sample row: its run spare (an int, the same in
    every head), its held spare ids (``(H_kv,)``), or (None) fresh from the pool, one allocation; and
    the ``(H_kv, m)`` fresh ones (what :meth:`KVPool.unalloc` takes back)."""
    spec = pool.spec
    fresh = pool.alloc(layer, sum(s is None for s in spare))
    left = iter(fresh.unbind(1))
    cols = []
    for s in spare:
        if isinstance(s, int):
            s = torch.full((spec.kv_heads,), s, dtype=torch.long, device=spec.device)
        cols.append(next(left) if s is None else s)
    return torch.stack(cols, 1), fresh


class DecodeReservation:
    """A decode step's append to one layer, reserved on the host (:func:`reserve_decode_entries`) and
    not yet written: ``past (B,)`` int64, each request's new column (its length before), ``ids (H_kv,
    B)`` int64, the new entries' slots (any strides).

    Until the write succeeds the append can be taken back: :meth:`cancel` puts every owner's lengths,
    tables, sequence indices and spares, and the pool's free slots, references and byte count back as
    they were (the fused call's checks run in C++, some after it wrote the rows: a failure there must
    not leave the layer half-appended, its lengths counting entries whose K/V were never written).
    """

    def __init__(self, owners: list[Appends]):
        self.owners = owners
        self.pool, self.layer = owners[0].pool, owners[0].layer
        self._written = self.pool.bytes_written
        # per owner what the reservation replaces and where its spares stand
        self._marks = [(r._mark(), r.spares.mark()) for r in owners]
        self._fresh: Tensor | None = None  # slots taken from the pool's free stacks
        self.past: Tensor | None = None
        self.ids: Tensor | None = None

    def cancel(self) -> None:
        """Take the reservation back (the write failed): the layer as it was before it."""
        for r, (mark, spares) in zip(self.owners, self._marks):
            r._restore(mark)
            r.spares.rewind(spares)
        if self._fresh is not None:
            self.pool.unalloc(self.layer, self._fresh)
        self.pool.bytes_written = self._written


def reserve_decode_entries(
    owners: list[Appends], order_next: Tensor, order_rows: list[Tensor]
) -> DecodeReservation:
    """A decode step's append to one layer (one new entry per request) without its tensor writes: the
    host parts :meth:`Appends._append_one` and :func:`append_one_each` run around writing the new column
    and the K/V rows (the same helpers), which the fused append-and-read does in its C++ call
    (``vlkv/plugins/paged_append.py``).

    ``owners``: one batch cache's layer, or a batch view's one-sample layers (all on one pool layer).
    ``order_next (B,)``: each new entry's sequence index + 1; ``order_rows``: the same as ``()`` tensors
    per request (split once per step). Tables grown to hold the column, slots allocated (a batch cache's
    recycled columns, a one-sample cache's run spares, else fresh from the pool), next sequence indices,
    running scores zeroed at the column, lengths (tensor and host copy) one longer, the pool's written
    bytes counted. Returns the :class:`DecodeReservation` (its ``past`` and ``ids``); the caller
    cancels it where the write fails. A failure here (a fixed pool out of slots) leaves nothing changed.
    """
    if len(owners) != 1 and any(r.batch != 1 for r in owners):
        raise ValueError("reserve_decode_entries takes one batch cache's layer or one-sample layers")
    res = DecodeReservation(owners)
    try:
        _reserve_into(res, order_next, order_rows)
    except BaseException:
        res.cancel()
        raise
    return res


def _reserve_into(res: DecodeReservation, order_next: Tensor, order_rows: list[Tensor]) -> None:
    """:func:`reserve_decode_entries`'s work, recorded in ``res`` as it goes (what to take back)."""
    owners, pool, layer = res.owners, res.pool, res.layer
    spec = pool.spec
    first = owners[0]
    if len(owners) == 1 and first.batch > 1:  # a batch cache: one allocation, one column per table
        lens, ids, fresh = first._decode_slots()
        if fresh:
            res._fresh = ids
        past = first.lengths  # set_lengths below gives the layer a new tensor: this one stays as it is
        at = first._decode_column(lens, past) if first.scores else None
        first._decode_advance(at, past, lens, torch.maximum(first.next_order, order_next))
        pool.count_written(ids.numel())
        res.past, res.ids = past, ids
        return
    host, spare = _row_spares(owners)
    if all(isinstance(s, int) for s in spare):  # every row continues its run: the same slot in every head
        ids = torch.tensor(spare, device=spec.device)[None].expand(spec.kv_heads, len(owners))
    else:
        ids, res._fresh = _row_slots(pool, layer, spare)
    for r, p, nxt in zip(owners, host, order_rows):
        r.next_order = torch.maximum(r.next_order, nxt)
        r._advance_one(p)
    pool.count_written(ids.numel())
    res.past, res.ids = torch.tensor(host, device=spec.device), ids
