"""A decode step's append to one layer, reserved on the host before its K/V and table column are written.

Every decode append (one new entry per request) runs the same host half here — tables grown for one
more column, slots chosen (a batch cache's recycled columns, a one-sample cache's run spares, else
fresh from the pool), next sequence indices, lengths one longer, the pool's written bytes counted —
and then writes: the Python append (``kv/appends.py``: one pool write, the new column by tensor ops)
or the fused C++ append-and-read (``runtime/fused_append.py``). Until the write succeeds the append
can be taken back (:meth:`DecodeReservation.cancel`), and a whole step's appends can be taken back
together (:func:`undone_on_failure`): a layer that fails after lower layers appended leaves every
layer and the pool as they were before the step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

# ``owners`` / ``layers`` below are :class:`~vlkv.runtime.kv.appends.Appends` (layers of a cache); not
# imported: the appends import this module

__all__ = [
    "DecodeReservation",
    "StepAdvance",
    "advance_all",
    "next_order",
    "reserve_decode_entries",
    "undone_on_failure",
]


class DecodeReservation:
    """A decode step's append to one layer, reserved on the host (:func:`reserve_decode_entries`) and
    not yet written.

    Attributes:
        host: each request's length before (its new column), Python ints.
        spare: one-sample owners: each row's slot as :meth:`SpareSlots.take` gave it (an int, the
            run's next id in every head; ``(H_kv,)`` held ids; None: fresh from the pool); else None.
        run: ``(B,)`` int64 when every row continues its run (``ids`` is it in every head), else None;
            built on first use (a writer taking the ids from its step's tensors builds none: no
            host-to-device copy per layer).
        past: ``(B,)`` int64 lengths before (a batch cache's own old lengths tensor).
        ids: ``(H_kv, B)`` int64, the new entries' slots (any strides).

    Until the write succeeds the append can be taken back: :meth:`cancel` puts every owner's lengths,
    tables, sequence indices and spares, and the pool's free slots, references and byte count back as
    they were (the fused call's checks run in C++, some after it wrote the rows: a failure there must
    not leave the layer half-appended, its lengths counting entries whose K/V were never written).
    After the write too, while nothing else changed the layer: a later layer of the same step failed
    (:func:`undone_on_failure`); the written rows then lie in free slots, never read.
    """

    def __init__(self, owners: list):
        self.owners = owners
        self.pool, self.layer = owners[0].pool, owners[0].layer
        self._written = self.pool.bytes_written
        # per owner what the reservation replaces and where its spares stand
        self._marks = [(r._mark(), r.spares.mark()) for r in owners]
        self._fresh: Tensor | None = None  # slots taken from the pool's free stacks
        self.host: list[int] = []
        self.spare: list | None = None
        self.runs = False  # every row continues its run (``spare`` all ints): ``run`` is them
        self._run: Tensor | None = None
        self._past: Tensor | None = None
        self._ids: Tensor | None = None
        self._at: tuple | None = None
        self._after: Tensor | None = None
        self._cancelled = False

    @property
    def past(self) -> Tensor:
        if self._past is None:  # one-sample owners: built on first use (the Python append needs none)
            self._past = torch.tensor(self.host, device=self.pool.spec.device)
        return self._past

    @property
    def run(self) -> Tensor | None:
        if self._run is None and self.runs:
            self._run = torch.tensor(self.spare, device=self.pool.spec.device)
        return self._run

    @property
    def after(self) -> Tensor:
        """``(B,)`` int64 lengths after the append (``past + 1``)."""
        if self._after is None:
            self._after = self.past + 1
        return self._after

    @property
    def ids(self) -> Tensor:
        if self._ids is None:  # every row continues its run: the same slot in every head
            self._ids = self.run.expand(self.pool.spec.kv_heads, self.run.shape[0])
        return self._ids

    def column(self) -> tuple:
        """A batch cache's index of each sample's new column (``Appends._decode_column``)."""
        if self._at is None:
            self._at = self.owners[0]._decode_column(self.host, self.past)
        return self._at

    def cancel(self) -> None:
        """Take the reservation back (the write failed): the layer as it was before it. Once: the
        writer that failed cancels it, and so does the step's undo (:func:`undone_on_failure`)."""
        if self._cancelled:
            return
        self._cancelled = True
        for r, (mark, spares) in zip(self.owners, self._marks):
            r._restore(mark)
            r.spares.rewind(spares)
        if self._fresh is not None:
            self.pool.unalloc(self.layer, self._fresh)
        self.pool.bytes_written = self._written


def next_order(current: Tensor, after: Tensor | int | None) -> Tensor:
    """A layer's next sequence index once it holds an entry whose index + 1 is ``after`` (a tensor
    broadcast to ``current (B,)``, an int, or None: the next one, ``current + 1``)."""
    if after is None:
        return current + 1
    if isinstance(after, Tensor):
        return torch.maximum(current, after)
    return current.clamp(min=after)


@dataclass
class StepAdvance:
    """One layer's lengths and next sequence indices after its decode append, computed with every other
    layer's in a few ops for the whole step (:func:`advance_all`), where each layer's append computed
    its own (per layer an op for its lengths and one for its next indices, per request on one-sample
    caches).

    host: the owners' host lengths it was computed from (flat, per owner its samples). orders_from:
    per owner the ``next_order`` tensor it was computed from. past, after: ``(B,)`` int64 lengths
    before and after. lengths, orders: per owner its new lengths and next sequence indices (views of
    the step's tensors, one element each: no two owners share one).
    """

    host: list[int]
    orders_from: list[Tensor]
    past: Tensor
    after: Tensor
    lengths: list[Tensor]
    orders: list[Tensor]

    def holds_for(self, owners: list, host: list[int]) -> bool:
        """Whether the owners are as they were when it was computed (nothing appended in between)."""
        return host == self.host and all(r.next_order is o for r, o in zip(owners, self.orders_from))


def advance_all(layers: list[list], order_next: Tensor) -> list[StepAdvance]:
    """Per layer (its owners: a batch cache's layer, or a batch view's one-sample layers, every layer
    with as many samples) the :class:`StepAdvance` of a decode step whose new entries take sequence
    indices ``order_next - 1`` (``(B,)`` int64): one tensor of every layer's lengths before and after,
    one of every layer's next indices (``max(next_order, order_next)``), split into per-owner views."""
    dev = order_next.device
    owners = [o for per in layers for o in per]
    hosts = [[n for o in per for n in o.host_lengths()] for per in layers]
    n_layers, b = len(layers), len(hosts[0])
    past = torch.tensor(hosts, device=dev)  # (L, B)
    after = past + 1
    orders = torch.maximum(torch.cat([o.next_order for o in owners]).view(n_layers, b), order_next)
    one_each = all(len(per) == b for per in layers)  # one-sample owners: a (1,) view each
    if one_each:
        lens, nxt = after.view(-1).split(1), orders.view(-1).split(1)
    else:
        lens, nxt = after.unbind(0), orders.unbind(0)
    out, at = [], 0
    for per, host, p, a in zip(layers, hosts, past.unbind(0), after.unbind(0)):
        m = len(per)
        froms = [o.next_order for o in per]
        out.append(StepAdvance(host, froms, p, a, list(lens[at : at + m]), list(nxt[at : at + m])))
        at += m
    return out


def reserve_decode_entries(
    owners: list,
    order_next: Tensor | None = None,
    order_rows: list | None = None,
    ahead: StepAdvance | None = None,
    zero_scores: bool = True,
) -> DecodeReservation:
    """A decode step's append to one layer (one new entry per request) without its tensor writes.

    ``owners``: one batch cache's layer, or a batch view's one-sample layers (all on one pool layer).
    ``order_next``: a batch cache's ``(B,)`` new sequence indices + 1 (None: each sample's next
    index); ``order_rows``: one-sample owners' the same per row (``()`` tensors or ints; None, or a
    None entry: the row's next index). Tables grown to hold the column, slots allocated, next sequence
    indices, running scores zeroed at the column, lengths (tensor and host copy) one longer, the
    pool's written bytes counted (``ahead``: the lengths and next indices this step computed for every
    layer, used where they still hold; ``zero_scores`` False: the running scores are left for the
    writer to zero at the column, its one launch or C++ call, each request's tables only). Returns the :class:`DecodeReservation`; the caller writes the K/V
    rows and the column and cancels it where that fails. A failure here (a fixed pool out of slots)
    leaves nothing changed. Recorded in the owners' step log where :func:`undone_on_failure` set one.
    """
    if len(owners) != 1 and any(r.batch != 1 for r in owners):
        raise ValueError("reserve_decode_entries takes one batch cache's layer or one-sample layers")
    res = DecodeReservation(owners)
    try:
        _reserve_into(res, order_next, order_rows, ahead, zero_scores)
    except BaseException:
        res.cancel()
        raise
    log = owners[0].step_log
    if log is not None:
        log.append(res)
    return res


def _reserve_into(
    res: DecodeReservation,
    order_next: Tensor | None,
    order_rows: list | None,
    ahead: StepAdvance | None,
    zero_scores: bool = True,
) -> None:
    """:func:`reserve_decode_entries`'s work, recorded in ``res`` as it goes (what to take back)."""
    owners, pool, layer = res.owners, res.pool, res.layer
    first = owners[0]
    if len(owners) == 1 and first.batch > 1:  # a batch cache: one allocation, one column per table
        if ahead is not None and not ahead.holds_for(owners, first.host_lengths()):
            ahead = None
        lens, ids, fresh = first._decode_slots()
        if fresh:
            res._fresh = ids
        res.host, res._ids = lens, ids
        res._past = first.lengths  # set_lengths below gives the layer a new tensor: this one stays
        at = res.column() if first.scores and zero_scores else None
        if ahead is None:
            nxt = next_order(first.next_order, order_next)
            first._decode_advance(at, res._past, lens, nxt, zero_scores=zero_scores)
        else:
            res._after = ahead.after
            first._decode_advance(at, res._past, lens, ahead.orders[0], ahead.lengths[0], zero_scores)
        pool.count_written(ids.numel())
        return
    res.host, res.spare = _row_spares(owners)
    if all(isinstance(s, int) for s in res.spare):  # every row continues its run
        res.runs = True
        n = len(res.spare)
    else:
        res._ids = _row_slots(res, pool, layer)
        n = res._ids.numel()
    if ahead is not None and ahead.holds_for(owners, res.host):
        res._past, res._after = ahead.past, ahead.after
        for r, p, lens, nxt in zip(owners, res.host, ahead.lengths, ahead.orders):
            r.next_order = nxt
            r._advance_one(p, lens, zero_scores)
    else:
        for i, (r, p) in enumerate(zip(owners, res.host)):
            r.next_order = next_order(r.next_order, None if order_rows is None else order_rows[i])
            r._advance_one(p, zero_scores=zero_scores)
    pool.count_written(n * pool.spec.kv_heads if res.runs else n)


def _row_spares(rows: list) -> tuple[list[int], list[Tensor | int | None]]:
    """Each one-sample row's length (kept on the host: no read back per row and layer) and its next
    run spare (:meth:`SpareSlots.take`), its tables grown for one more column."""
    past = [r.host_lengths()[0] for r in rows]
    for r, p in zip(rows, past):
        r._reserve(p + 1)
    return past, [r.spares.take() for r in rows]


def _row_slots(res: DecodeReservation, pool, layer: int) -> Tensor:
    """``(H_kv, B)`` the slots of one new entry per one-sample row: its run spare (an int, the same in
    every head), its held spare ids (``(H_kv,)``), or (None) fresh from the pool, one allocation,
    recorded in ``res`` at once (the ``(H_kv, m)`` ids :meth:`KVPool.unalloc` takes back on a cancel,
    even if building the columns then fails)."""
    spec, spare = pool.spec, res.spare
    fresh = pool.alloc(layer, sum(s is None for s in spare))
    res._fresh = fresh
    if fresh.shape[1] == len(spare):  # every row fresh (a fixed pool's usual step): the ids as they are,
        return fresh  # not split and stacked again (two ops a layer and step)
    left = iter(fresh.unbind(1))
    cols = []
    for s in spare:
        if isinstance(s, int):
            s = torch.full((spec.kv_heads,), s, dtype=torch.long, device=spec.device)
        cols.append(next(left) if s is None else s)
    return torch.stack(cols, 1)


@contextmanager
def undone_on_failure(layers: list):
    """Run a decode step over ``layers`` (a batch cache's) so that if it raises, every layer's append
    it reserved is taken back, last first: lengths, tables, sequence indices, spares, and the pool's
    free slots, references and byte count as before the step (a layer that fails after lower ones
    appended would otherwise leave them one entry longer than the layers above). Yields the log."""
    log: list[DecodeReservation] = []
    for la in layers:
        la.step_log = log
    try:
        yield log
    except BaseException:
        for res in reversed(log):
            res.cancel()
        raise
    finally:
        for la in layers:
            la.step_log = None
