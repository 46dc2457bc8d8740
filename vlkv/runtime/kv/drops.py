"""Decode-time drops: a step's eviction of a few entries per row, prepared for every layer at once.

A decode step that evicts (H2O every step, A-VL's text, a recent window) drops a few columns of each
(sample, KV head) row in every layer. :func:`prepare_selects` prepares all layers' selections
(:meth:`~vlkv.runtime.kv.edits.Edits.prepare_uniform`) and reads every layer's checks back in one
transfer; the layers' :meth:`~vlkv.runtime.kv.edits.Edits.select` then close each row's gap in place
from the first column it drops (:func:`shift_kept`) instead of rebuilding the tables.

Where every layer drops exactly one column per row and the columns are known (H2O's step), the gaps
of every layer are closed by one C++ call (``vlkv/plugins/evict_rows.py``: a ``memmove`` per row,
CPU caches, ``VLKV_CPU_EVICT=0`` off), elsewhere by a few multi-tensor ops over every table
(:func:`shift_one_each`), before the per-layer selects, which then only set the lengths and keep the
dropped slots (:attr:`UniformSelect.moved`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.kv.entries import gather_columns

# most slots per head a decode-time eviction hands to the cache's next appends instead of the pool
RECYCLE_MAX = 16
# a decode-time select dropping a few columns per row rewrites its tables in place from the first
# column it drops (:func:`shift_kept`); False: it rebuilds them, for tests and before/after runs
IN_PLACE = True


@dataclass
class UniformSelect:
    """A uniform :meth:`Edits.select` prepared on the device (:meth:`Edits.prepare_uniform`).

    Attributes:
        n, k: entries each sample holds and keeps.
        in_place: a decode-time eviction of at most ``RECYCLE_MAX`` entries per row, the tables
            keeping room for the spares: the kept columns from the first one that moves on are
            rewritten in place (:func:`shift_kept`); otherwise the tables are rebuilt.
        distinct: ``()`` bool, ``index`` lists ``k`` distinct columns; None where that is known
            (the selection named the dropped columns, or nothing is dropped).
        sole: ``()`` bool, the dropped slots have no other holder; None where not asked (False).
        dropped: ``(B, H_kv, n - k)`` slots the edit drops, None when none.
        first: ``()`` int64 the first column any row drops (every column before it stays where it
            is), None unless ``in_place``.
        cols: ``(B, H_kv, n - k)`` the ascending columns each row drops, where known.
        checks: ``[distinct, sole]`` read back, None until read.
        first_col: ``first`` read back (with ``checks``), None until read or without it.
        moved: the tables' gaps are already closed (:func:`prepare_selects`' one call for every
            layer): the select only sets the lengths and lets go of ``dropped``.
    """

    n: int
    k: int
    in_place: bool
    distinct: Tensor | None
    sole: Tensor | None
    dropped: Tensor | None
    first: Tensor | None = None
    cols: Tensor | None = None
    checks: list[bool] | None = None
    first_col: int | None = None
    moved: bool = False

    def values(self) -> list[Tensor]:
        """The device values to read back (``distinct``, ``sole``, ``first``, those not None)."""
        return [v for v in (self.distinct, self.sole, self.first) if v is not None]

    def read(self, host: list[int]) -> None:
        """Take the checks (and the first moving column) from :meth:`values` read back."""
        at = iter(host)
        distinct = True if self.distinct is None else bool(next(at))
        sole = False if self.sole is None else bool(next(at))
        self.checks = [distinct, sole]
        self.first_col = None if self.first is None else int(next(at))

    def read_back(self) -> None:
        """:meth:`read` this select's values alone (one transfer)."""
        vals = self.values()
        self.read(torch.stack(vals).tolist() if vals else [])


def prepare_selects(jobs: list[tuple], spare: int, recycle: bool):
    """:meth:`Edits.prepare_uniform` of many layers' selections ``(layer, index, keep_len, kept)`` or
    ``(layer, index, keep_len, kept, dropped)`` with their checks read back in one transfer (one host
    sync for a step's edits of every layer, not one per layer; one ``stack`` of every layer's values).
    ``kept`` None: ``keep_len`` is read (once, for all such jobs); ``dropped``: the columns the
    selection drops, where it knew them. Returns per job its :class:`UniformSelect`, or None where the
    uniform path does not apply. Where every job drops one known column per row of a CPU cache, the
    gaps are closed here for every layer (:func:`_drop_one_each`)."""
    unknown = [i for i, job in enumerate(jobs) if job[3] is None]
    kept = [job[3] for job in jobs]
    if unknown:
        host = torch.cat([jobs[i][2].reshape(-1).to(jobs[0][2].device, torch.long) for i in unknown]).tolist()
        at = 0
        for i in unknown:
            b = jobs[i][2].numel()
            kept[i], at = host[at : at + b], at + b
    fused = _drop_one_each(jobs, kept, spare, recycle)
    if fused is not None:
        return fused
    preps = [
        job[0].prepare_uniform(job[1], k, spare, recycle, job[4] if len(job) > 4 else None)
        for job, k in zip(jobs, kept)
    ]
    live = [p for p in preps if p is not None]
    vals = [v for p in live for v in p.values()]
    host = torch.stack([v.to(vals[0].device) for v in vals]).tolist() if vals else []
    at = 0
    for p in live:
        m = len(p.values())
        p.read(host[at : at + m])
        at += m
    return preps


def cut_soles(jobs: list[tuple], recycle: bool) -> list[bool | None]:
    """Per cut ``(layer, starts, counts)`` (a :class:`~vlkv.runtime.policies.base.CutEdit`'s host values),
    whether the slots it drops have no other holder, where :meth:`Edits.cut` would ask the pool (a
    recycled cut of at most ``RECYCLE_MAX`` entries, every sample alike, a dense cache): every layer's
    check read back in one transfer, not one per layer. None where the cut asks nothing (or checks its
    own arguments first: it reads alone then)."""
    at: list[int | None] = []
    checks = []
    for layer, starts, counts in jobs:
        lens = layer.host_lengths()
        alike = len(set(starts)) == len(set(counts)) == len(set(lens)) == 1
        s, c, n = (starts[0], counts[0], lens[0]) if alike and lens else (0, 0, 0)
        if not (recycle and alike and 0 < c <= RECYCLE_MAX and 0 <= s <= n - c):
            at.append(None)
            continue
        if layer.holes is not None or layer.lowrank is not None:  # the cut takes select there
            at.append(None)
            continue
        dropped = layer.slots.narrow(2, s, c)  # (B, H_kv, c), as the cut drops them
        b, h = dropped.shape[:2]
        at.append(len(checks))
        checks.append(layer.pool.owned_once(layer.layer, dropped.transpose(0, 1).reshape(h, b * c)))
    host = torch.stack(checks).tolist() if checks else []
    return [None if i is None else bool(host[i]) for i in at]


def _drop_one_each(jobs: list[tuple], kept: list[list[int]], spare: int, recycle: bool):
    """Every job's :class:`UniformSelect`, its gaps already closed (``moved``), where every job is a
    decode-time drop of exactly one known column per row (``dropped (B, H_kv, 1)``) that
    :meth:`Edits.prepare_uniform` would rewrite in place, on a cache holding ``n`` entries per sample
    and keeping ``n - 1`` (the layers of one cache, or of a cohort's caches: ``n`` may differ between
    jobs): on CPU caches one C++ call per ``n`` moves its jobs' tables (``evict_rows.drop_columns``;
    ``VLKV_CPU_EVICT=0`` off), elsewhere one :func:`shift_one_each` every job's (a fixed number of
    ``torch._foreach_*`` ops over every table); every job's check is read back in one transfer. None
    (nothing done) where any of that does not hold."""
    from vlkv.plugins import evict_rows

    if not (recycle and IN_PLACE) or len(jobs) < 2:
        return None
    widths = []
    for job, k in zip(jobs, kept):
        layer = job[0]
        dropped = job[4] if len(job) > 4 else None
        if layer.holes is not None or layer.lowrank is not None:
            return None
        if dropped is None or dropped.dim() != 3 or dropped.shape[2] != 1:
            return None
        lengths = layer.host_lengths()
        if not lengths:
            return None
        n = lengths[0]
        if min(lengths) != n or max(lengths) != n or min(k) != n - 1 or max(k) != n - 1:
            return None
        if n - 1 + spare > layer.capacity:
            return None
        widths.append(n)
    layers = [job[0] for job in jobs]
    tables = [layer._entry_tables() for layer in layers]
    if len({len(t) for t in tables}) != 1 or len({id(layer) for layer in layers}) != len(layers):
        return None  # layers keeping different running scores, or a layer listed twice
    on_cpu = all(layer.device.type == "cpu" for layer in layers)
    if evict_rows.FUSED_DROP and on_cpu and evict_rows.kernel() is not None:
        # the kernel takes one ``k``: one call per length (one for every job of an equal-length step)
        by_n: dict[int, list[int]] = {}
        for i, n in enumerate(widths):
            by_n.setdefault(n, []).append(i)
        parts: list = [None] * len(jobs)
        for n, members in by_n.items():
            cols = torch.cat([jobs[i][4] for i in members]).view(len(members), *jobs[members[0]][4].shape[:2])
            out = evict_rows.drop_columns([tables[i] for i in members], cols, n - 1)
            if len(by_n) == 1:
                parts = out
            else:
                for i, g in zip(members, out.unbind(0)):
                    parts[i] = g
        gone = parts if len(by_n) == 1 else torch.stack(parts)
    else:  # every job in one set of multi-tensor ops, each job its own ``n - 1``
        cols = torch.cat([job[4] for job in jobs]).view(len(jobs), *jobs[0][4].shape[:2])  # (J, B, H_kv)
        gone = shift_one_each(tables, cols, [n - 1 for n in widths])
    preps = []
    # each layer's views by one ``unbind`` per layout, not a ``t()`` and an index per layer
    per_head = gone.transpose(1, 2).unbind(0)  # (H_kv, B) each: row h in head h
    for layer, heads, slots, n in zip(layers, per_head, gone.unsqueeze(3).unbind(0), widths):
        sole = layer.pool.owned_once(layer.layer, heads)
        preps.append(UniformSelect(n, n - 1, True, None, sole, slots, moved=True))
    host = torch.stack([p.sole for p in preps]).tolist()  # every layer's check in one read
    for p, sole in zip(preps, host):
        p.read([sole])
    return preps


# a float table moves as the integers of its bits: the masked blend below is exact on integers
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def shift_one_each(tables: list[list[Tensor]], cols: Tensor, k: int | list[int]) -> Tensor:
    """``evict_rows.drop_columns`` in torch, on any device: per job ``i`` (a layer of one cache) each
    row of every table in ``tables[i]`` (the slot table ``(B, H_kv, C)`` int64 first, then
    ``(B, H_kv, C, ...)`` tables) drops column ``cols[i] (B, H_kv)``, columns ``(cols, k]`` moving
    one to the left (column ``k`` keeps its value, past the new length). Returns ``(J, B, H_kv)``
    the dropped slot ids.

    Every table becomes ``dst * (1 - moves) + src * moves``, ``moves`` its columns in ``[cols, k)``:
    three ``torch._foreach_*`` ops per dtype over every job's tables (a few multi-tensor launches on a
    GPU), where a ``where`` and a ``copy_`` per table, layer and request ran before. Integers, exact
    (one term is 0); float tables go as the integers of their bits. ``k`` per job (``k[i]``: a
    scheduler cohort's requests holding different lengths).

    When every table is contiguous (the pool's are), they are blended whole, as flat views: ``dst`` the table's first
    ``N - P`` elements and ``src`` its last (``P`` the elements of one column of a row), so every
    operand is dense. CUDA's multi-tensor kernels take only dense operands: the column views of
    :func:`_column_operands` (the form taken when any table is not contiguous) sent every op of run 7's H200 profile down the
    per-tensor path (h2o / A-VL scheduler steps: 15-18 ms of ``_foreach_*`` under cProfile)."""
    j, b, h = cols.shape
    ks = [k] * j if isinstance(k, int) else list(k)
    col = cols.unsqueeze(3)  # (J, B, H_kv, 1)
    gone = torch.cat([t[0].gather(2, c) for t, c in zip(tables, col.unbind(0))])  # (J·B, H_kv, 1)
    if all(t.is_contiguous() for group in tables for t in group):
        lists = _flat_operands(tables, col, ks)
    else:
        lists = _column_operands(tables, col, ks)
    for dst, src, on, off in lists.values():
        picked = torch._foreach_mul(src, on)  # read before any write: the views overlap
        torch._foreach_mul_(dst, off)
        torch._foreach_add_(dst, picked)
    return gone.view(j, b, h)


def _bits(t: Tensor) -> Tensor:
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _flat_operands(tables: list[list[Tensor]], col: Tensor, ks: list[int]) -> dict:
    """Per dtype ``(dst, src, on, off)`` lists of 1-D dense views (see :func:`shift_one_each`). The
    masks are made once per (dtype, column size ``P``, capacity ``C``) for every job of that capacity
    (a run of consecutive jobs: one request's layers), each job's a contiguous slice of them."""
    from vlkv.runtime.kv.step_tables import to_device

    caps = [group[0].shape[2] for group in tables]
    cmax = max(caps)
    ar = torch.arange(cmax, device=col.device)
    kt = to_device(torch.tensor(ks), col.device).view(-1, 1, 1, 1)  # pinned, no host sync on CUDA
    moves = (ar >= col) & (ar < kt)  # (J, B, H_kv, cmax)
    runs = []  # per job the (first, count) of the run of consecutive jobs of its capacity
    for i, c in enumerate(caps):
        if i and caps[i - 1] == c:
            runs.append(runs[-1])
        else:
            count = 1
            while i + count < len(caps) and caps[i + count] == c:
                count += 1
            runs.append((i, count))
    masks: dict[tuple, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}
    lists: dict[torch.dtype, tuple[list, list, list, list]] = {}
    for i, (group, (first, count)) in enumerate(zip(tables, runs)):
        for t in group:
            t = _bits(t)
            per = math.prod(t.shape[3:])  # elements of one column of one row (1 for a 3-D table)
            key = (t.dtype, per, first)
            n = t.numel() - per
            if key not in masks:  # one job's row of these is (n,): the tables of a key share a shape
                m = moves.narrow(0, first, count)[..., : caps[i]]
                m = m.view(*m.shape, *([1] * (t.dim() - 3))).expand(-1, *t.shape).to(t.dtype)
                m = m.reshape(count, -1)
                masks[key] = (m[:, :n].unbind(0), (1 - m[:, :n]).unbind(0))
            dst, src, on, off = lists.setdefault(t.dtype, ([], [], [], []))
            base = t.storage_offset()
            dst.append(t.as_strided((n,), (1,), base))
            src.append(t.as_strided((n,), (1,), base + per))
            on.append(masks[key][0][i - first])
            off.append(masks[key][1][i - first])
    return lists


def _column_operands(tables: list[list[Tensor]], col: Tensor, ks: list[int]) -> dict:
    """Per dtype ``(dst, src, on, off)`` lists of column views ``[0, k)`` and ``[1, k + 1)`` (tables
    that are not contiguous): the masks made once at the widest ``k``, each job's a view of its first
    ``k[i]`` columns."""
    kmax = max(ks)
    moves = torch.arange(kmax, device=col.device) >= col  # (J, B, H_kv, kmax)
    masks: dict[tuple, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}
    lists: dict[torch.dtype, tuple[list, list, list, list]] = {}
    for i, (group, ki) in enumerate(zip(tables, ks)):
        for t in group:
            t = _bits(t)
            key = (t.dim(), t.dtype)
            if key not in masks:
                m = moves.view(*moves.shape, *([1] * (t.dim() - 3)))
                masks[key] = (m.to(t.dtype).unbind(0), (~m).to(t.dtype).unbind(0))
            dst, src, on, off = lists.setdefault(t.dtype, ([], [], [], []))
            dst.append(t.narrow(2, 0, ki))
            src.append(t.narrow(2, 1, ki))
            yes, no = masks[key][0][i], masks[key][1][i]
            on.append(yes if ki == kmax else yes.narrow(2, 0, ki))
            off.append(no if ki == kmax else no.narrow(2, 0, ki))
    return lists


def unlisted(listed: Tensor, m: int) -> Tensor:
    """``(B, H_kv, m)`` ascending columns where ``listed (B, H_kv, n)`` int8 is 0 (with fewer than
    ``m`` in a row, its tail is 0): each goes to its rank among them by a running count, one linear
    pass, where a stable sort of the row moved every column."""
    b, h, n = listed.shape
    free = listed == 0
    dest = torch.where(free, free.cumsum(2) - 1, m).clamp_(max=m)
    cols = torch.arange(n, device=listed.device).expand(b, h, n)
    return torch.zeros(b, h, m + 1, dtype=torch.long, device=listed.device).scatter_(2, dest, cols)[:, :, :m]


def shift_kept(
    tables: list[Tensor], index: Tensor | None, first: int, k: int, cols: Tensor | None = None
) -> None:
    """Rewrite columns ``[first, k)`` of every per-entry table in ``tables`` with the kept columns
    ``index[:, :, first:k]`` in place, where ``first`` is the first column any row drops (the columns
    before it stay). A per-step eviction's victims sit about mid-table (H2O's: just before its recent
    window), so this moves about half of each table, where gathering every kept column rewrote it
    whole. The columns past ``k`` keep stale values (past the length: never read).

    ``cols (B, H_kv, m)``: the columns each row drops, where known. With one per row (H2O's step)
    kept column ``j`` is column ``j`` or ``j + 1``: a ``where`` of the two shifted views, no index
    read (1.5x cheaper than the gather at 4k columns; ``index`` may be None then); otherwise the kept
    columns are gathered."""
    if first >= k:  # every row drops only columns past its ``k`` first: nothing moves
        return
    # ``narrow``: one op per view, where ``t[:, :, a:b]`` dispatches a slice per dimension (this
    # runs per table, layer and step)
    m = k - first
    if cols is not None and cols.shape[2] == 1:
        later = torch.arange(first, k, device=cols.device) >= cols  # (B, H_kv, k - first)
        # per table rank, ``later`` with a unit dim per trailing dim (M-RoPE positions: one more)
        moves_of = {3: later}
        for t in tables:
            moves = moves_of.get(t.dim())
            if moves is None:
                moves = moves_of[t.dim()] = later.view(*later.shape, *([1] * (t.dim() - 3)))
            dst = t.narrow(2, first, m)
            dst.copy_(torch.where(moves, t.narrow(2, first + 1, m), dst))
        return
    kept = index.narrow(2, first, m)
    for t in tables:
        t.narrow(2, first, m).copy_(gather_columns(t, kept))
