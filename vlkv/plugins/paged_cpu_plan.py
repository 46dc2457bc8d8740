"""What the CPU paged read does for one slot table, decided once and reused by every layer that reads it.

``paged_cpu`` splits a batch into requests read in place (long shared runs of slots, viewed where they
lie) and requests gathered together (one padded copy). Deciding that costs host syncs and small tensor
ops per request (runs found by ``nonzero``, the short runs' columns, the gathered rows' flat indices,
masks); in a decode step every layer of a cache usually holds the same table, so the decision is a
:class:`PagedCpuPlan` built once and handed to each layer's call (``plan=``), which only runs the
matmuls. A plan is valid for a call whose table, lengths, pool capacity and query count it
:meth:`~PagedCpuPlan.matches` (compared by value: two cheap ``torch.equal`` calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def shared_runs(row: Tensor) -> list[tuple[int, int, int]] | None:
    """``[(first column, end column, first slot), …]`` when every head's ``row (H_kv, n)`` holds the
    same slots, as ascending runs; None otherwise (the caller gathers)."""
    first = row[0]
    if row.shape[0] > 1 and not bool((row == first).all()):
        return None
    if bool((first < 0).any()):
        return None
    breaks = (first[1:] - first[:-1] != 1).nonzero().flatten().add_(1).tolist()
    bounds = [0, *breaks, first.numel()]
    starts = first[bounds[:-1]].tolist() if len(bounds) > 2 else [int(first[0])]
    return [(c0, c1, s) for c0, c1, s in zip(bounds[:-1], bounds[1:], starts, strict=True)]


@dataclass(frozen=True)
class InplaceRead:
    """One request read in place.

    index: its row in the batch. n: its columns (every head holds all of them). views: ``(at, end,
    first slot)`` segment positions of the runs viewed in the pool. rest: None, or ``(H_kv·m,)`` int64
    flat rows (slot + head · S) of the short runs' ``m`` columns (segment positions ``[n - m, n)``, after
    the views). vis: None (one decode row sees every column), or ``(H_kv, G·Q, n)`` bool causal mask in
    segment order.
    """

    index: int
    n: int
    views: tuple[tuple[int, int, int], ...]
    rest: Tensor | None
    vis: Tensor | None


@dataclass(frozen=True)
class InplaceGroup:
    """The requests read in place, attended as one batch: their scores fill one ``(R, H_kv, width,
    G·Q)`` buffer (a few matmuls per request, each reading a pool view), then one softmax and one
    output buffer for all of them, so the per-request cost is the matmuls alone.

    reads: each request's :class:`InplaceRead`. index: None (the batch's requests, in order) or
    ``(R,)`` int64 rows. width: the longest ``n``. rest: None, or every request's short-run rows
    concatenated (one gather per K and V for the batch); rest_at: each read's first row in it.
    vis: None (every row sees all ``width`` columns) or ``(R, H_kv, G·Q, width)`` bool. empty: None
    or ``(R, H_kv, G·Q, 1)`` bool, rows that see nothing (their output is zeros). tail: 0, or ``m`` when
    every request holds ``width`` columns and ``m`` short-run ones (lockstep decode appends): the rest
    is then one ``(R, H_kv, m)`` block at columns ``[width - m, width)``, attended by one matmul each
    for scores and output instead of one per request.
    """

    reads: tuple[InplaceRead, ...]
    index: Tensor | None
    width: int
    rest: Tensor | None
    rest_at: tuple[int, ...]
    vis: Tensor | None
    empty: Tensor | None
    tail: int = 0


def _group(reads: list[InplaceRead], batch: int, kv_heads: int, rows: int, device) -> InplaceGroup:
    """The :class:`InplaceGroup` of ``reads`` (requests of a ``batch``, ``rows`` = G·Q query rows)."""
    width = max(r.n for r in reads)
    rests = [r.rest for r in reads if r.rest is not None]
    at, rest_at = 0, []
    for r in reads:
        rest_at.append(at)
        at += 0 if r.rest is None else r.rest.numel()
    vis = None
    if any(r.vis is not None or r.n < width for r in reads):
        vis = torch.zeros(len(reads), kv_heads, rows, width, dtype=torch.bool, device=device)
        for i, r in enumerate(reads):
            vis[i, :, :, : r.n] = True if r.vis is None else r.vis
    empty = None
    if vis is not None:
        empty = ~vis.any(-1, keepdim=True)
        empty = empty if bool(empty.any()) else None
    every = len(reads) == batch and all(r.index == i for i, r in enumerate(reads))
    index = None if every else torch.tensor([r.index for r in reads], device=device)
    rest = torch.cat(rests) if rests else None
    tails = {0 if r.rest is None else r.rest.numel() // kv_heads for r in reads}
    tail = tails.pop() if len(tails) == 1 and all(r.n == width for r in reads) else 0
    return InplaceGroup(tuple(reads), index, width, rest, tuple(rest_at), vis, empty, tail)


@dataclass(frozen=True)
class GatheredRead:
    """Requests gathered into one padded ``(R, H_kv, n, D)`` copy and attended in one call.

    index: None (every request of the batch) or ``(R,)`` int64 rows. n: padded columns. flat:
    ``(R·H_kv·n,)`` int64 rows (slot + head · S; slot 0 where not held). held: None (every column held)
    or ``(R, H_kv, n)`` bool. vis: None (no mask) or ``(R, H_kv, G·Q or 1, n)`` bool. empty: None or
    ``(R, H_kv, G·Q or 1, 1)`` bool, rows that see nothing (their output is zeros).
    """

    index: Tensor | None
    n: int
    flat: Tensor
    held: Tensor | None
    vis: Tensor | None
    empty: Tensor | None


@dataclass(frozen=True)
class PagedCpuPlan:
    """How ``paged_cpu.paged_attention_cpu`` reads one table: built by :func:`plan_paged_cpu`.

    table: (B, H_kv, C), lengths: (B, H_kv) as planned (kept to match later calls). cap: the pool's
    slots per head (S). num_q, group: query rows and GQA group. inplace: requests read in place.
    gathered: the requests gathered together, or None. rows: None, or ``(R,)`` int64 the requests the
    fused kernel reads through their own table rows (per-head slots, holes, ragged head lengths: each
    head's live entries read in place, nothing gathered); planned only with ``fused`` (the call's
    fused kernel reads it).
    """

    table: Tensor
    lengths: Tensor
    cap: int
    num_q: int
    group: int
    inplace: InplaceGroup | None
    gathered: GatheredRead | None
    rows: Tensor | None = None
    fused: bool = False

    def matches(
        self, table: Tensor, lengths: Tensor, cap: int, num_q: int, group: int, fused: bool = False
    ) -> bool:
        """This plan reads a call with these arguments exactly as a fresh plan would."""
        return (
            cap == self.cap
            and fused == self.fused
            and num_q == self.num_q
            and group == self.group
            and table.shape == self.table.shape
            and lengths.shape == self.lengths.shape
            and table.device == self.table.device
            and torch.equal(table, self.table)
            and torch.equal(lengths, self.lengths)
        )


def _causal(n: int, num_q: int, group: int, lengths: Tensor) -> Tensor | None:
    """``(H_kv, G·Q, n)`` bool of the columns each query row sees (every head ``n`` long, no holes),
    or None for one decode row (it sees all ``n``)."""
    if num_q == 1:
        return None
    cols = torch.arange(n, device=lengths.device)
    limit = lengths[:, None] - num_q + 1 + torch.arange(num_q, device=lengths.device)  # (H_kv, Q)
    return (cols < limit[..., None]).repeat(1, group, 1)


def _inplace(
    b: int, row: Tensor, lengths: Tensor, cap: int, num_q: int, group: int, run_min: int
) -> InplaceRead | None:
    """The in-place read of request ``b`` (``row (H_kv, n)`` its table), or None when its slots are
    not shared runs, or no run is long enough (the caller gathers it)."""
    n = row.shape[1]
    runs = shared_runs(row)
    long = [] if runs is None else runs if len(runs) == 1 else [r for r in runs if r[1] - r[0] >= run_min]
    if not long:
        return None
    vis = _causal(n, num_q, group, lengths)
    views, at = [], 0
    for c0, c1, s in long:
        views.append((at, at + c1 - c0, s))
        at += c1 - c0
    if len(long) == len(runs):  # every run a view: segment order is table order
        return InplaceRead(b, n, tuple(views), None, vis)
    short = torch.ones(n, dtype=torch.bool, device=row.device)
    for c0, c1, _ in long:
        short[c0:c1] = False
    rest = short.nonzero().flatten()  # the short runs' columns, in table order
    heads_off = torch.arange(row.shape[0], device=row.device)[:, None] * cap
    flat = (row[:, rest] + heads_off).reshape(-1)
    if vis is not None:  # segment order: the views' columns, then the rest's
        vis = vis[:, :, torch.cat([(~short).nonzero().flatten(), rest])]
    return InplaceRead(b, n, tuple(views), flat, vis)


def _gathered(
    index: list[int] | None,
    table: Tensor,
    lengths: Tensor,
    cap: int,
    num_q: int,
    group: int,
    full: bool,
    holes: bool = True,
    maybe_empty: bool = True,
) -> GatheredRead:
    """The gathered read of requests ``index`` (None: all): ``table (R, H_kv, n)``, ``lengths (R, H_kv)``
    theirs; ``full``: every row holds ``n`` columns; ``holes``: False when no slot inside a length is -1;
    ``maybe_empty``: False when the host lengths show every query row sees a column."""
    reqs, kv_heads, n = table.shape
    dev = table.device
    cols = torch.arange(n, device=dev)
    heads_off = torch.arange(kv_heads, device=dev)[:, None] * cap
    # rows that are all held (no padding, no hole) need neither a mask nor a guarded gather
    held = (
        None
        if full and not (holes and bool((table < 0).any()))
        else (table >= 0) & (cols < lengths[..., None])
    )
    flat = ((table if held is None else torch.where(held, table, 0)) + heads_off[None]).reshape(-1)
    if num_q == 1:
        vis = None if held is None else held[:, :, None, :]
    else:
        limit = lengths[..., None] - num_q + 1 + torch.arange(num_q, device=dev)  # (R, H_kv, Q)
        vis = cols < limit[..., None]
        vis = (vis if held is None else held[:, :, None, :] & vis).repeat(1, 1, group, 1)
    empty = None
    if vis is not None and maybe_empty:
        empty = ~vis.any(-1, keepdim=True)
        empty = empty if bool(empty.any()) else None
    idx = None if index is None else torch.tensor(index, device=dev)
    return GatheredRead(idx, n, flat, held, vis, empty)


def plan_paged_cpu(
    table: Tensor,
    lengths: Tensor,
    cap: int,
    num_q: int,
    group: int,
    run_min: int,
    inplace_min: int,
    rot: Tensor | None = None,
    host: list[list[int]] | None = None,
    holes: bool = True,
    fused: bool = False,
) -> PagedCpuPlan:
    """The plan of a ``paged_cpu`` call: ``table (B, H_kv, C)``, ``lengths (B, H_kv)`` (clamped to
    ``[0, C]``), the pool's ``cap`` slots per head, ``num_q`` query rows, GQA ``group``; ``run_min`` and
    ``inplace_min`` as ``paged_attention_cpu`` takes them. A request holding a pre-RoPE key (``rot
    (B, H_kv, C)`` row >= 0) is gathered (its keys are rotated into the copy). host: ``lengths`` as
    Python ints where the caller keeps them, holes: False where it knows no slot inside a length is
    -1 (then neither is read back). fused: the fused kernel reads this call (one decode row, fp32):
    every request not read in place by runs is read through its own table rows by the kernel
    (``rows``) instead of gathered — a per-head table reads each head's live entries, no more."""
    cols = table.shape[-1]
    host = lengths.tolist() if host is None else [[min(max(n, 0), cols) for n in row] for row in host]
    inplace, together = [], []
    for b in range(table.shape[0]):
        n = max(host[b])
        if n == 0:
            continue
        if n < inplace_min or min(host[b]) != n or (rot is not None and bool((rot[b, :, :n] >= 0).any())):
            together.append(b)  # decided from host values: a short request costs no tensor op here
            continue
        read = _inplace(b, table[b, :, :n], lengths[b], cap, num_q, group, run_min)
        if read is None:
            together.append(b)
        else:
            inplace.append(read)
    rows = None
    if together and fused and num_q == 1 and rot is None:
        rows, together = torch.tensor(together, device=table.device), []
    gathered = None
    if together:
        n = max(max(host[b]) for b in together)
        full = all(min(host[b]) == n for b in together)
        # a row sees nothing only past a hole, or in a head shorter than the query rows
        empty = holes or any(min(host[b]) < num_q for b in together)
        if len(together) == table.shape[0]:  # every request (the common case of short ones): no subsets
            gathered = _gathered(None, table[:, :, :n], lengths, cap, num_q, group, full, holes, empty)
        else:
            idx = torch.tensor(together, device=table.device)
            gathered = _gathered(
                together, table[idx, :, :n], lengths[idx], cap, num_q, group, full, holes, empty
            )
    grouped = None
    if inplace:
        grouped = _group(inplace, table.shape[0], table.shape[1], group * num_q, table.device)
    return PagedCpuPlan(table, lengths, cap, num_q, group, grouped, gathered, rows, fused)
