"""A decode layer's cache append and paged read as one C++ call, on fp32 CPU pools.

The reference path of a decode layer appends its new K/V through the step context's ``update`` (the
Python append, ``kv/appends.py``) and then attends through the registered attention function (the
paged read, ``attention_rows._paged_one_row``): ~60 tensor ops per layer around one kernel.
:func:`fused_decode_row` does the append's host bookkeeping here
(:func:`~vlkv.runtime.kv.reservation.reserve_decode_entries`) and hands the new rows, the caches' own tables
and holes to one C++ call that writes and reads (``vlkv/plugins/paged_append.py``); if that call fails
the reservation is taken back, so a layer is appended whole or not at all. The skinny decoder layer
(``models/skinny_layer.py``) calls it in place of ``update`` + the attention function.

On the Triton path (CUDA, or ``VLKV_FORCE_TRITON=1``) :func:`device_decode_append` takes ``update``'s
place: the same reservation, with the step's lengths and next sequence indices computed once for every
layer (``advance_all``), and the past lengths from the reservation: no host-to-device copy of them a
layer (a stream sync on CUDA). Its writes are one launch (``paged_append_triton.decode_append_``): the
K/V rows, every request's new table column and the paged read's table, from the table rows the step
built once for every layer (``kv/step_tables.py``); where those rows do not hold for a layer, the pool
write as one launch (``triton_glue.pool_write_``), each request's column as the Python append writes it
and the read's table from ``paged_tables``. The paged read follows as in ``update``.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from vlkv.runtime.kv.reservation import advance_all, reserve_decode_entries

# the Triton path's decode append (VLKV_DEVICE_LAYER=0: off, with models/device_layer's decode layer)
DEVICE_APPEND = os.environ.get("VLKV_DEVICE_LAYER", "1") != "0"
# its step-level table rows (``kv/step_tables.py``: one launch a layer for the write, every request's
# column and the read table); VLKV_STEP_TABLES=0: the per-request column writes (the reference)
STEP_TABLES = os.environ.get("VLKV_STEP_TABLES", "1") != "0"


def fused_decode_row(ctx, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """A decode layer's cache append and attention as one C++ call (``vlkv/plugins/paged_append.py``),
    where the step and the cache allow it; None where they do not (the caller appends through
    ``ctx.update`` and attends through the registered attention function, the reference path).

    ``ctx`` is the step's :class:`~vlkv.runtime.step_context.StepContext` (read through its public
    ``cache``, ``inputs``, ``order``, ``one_row``, ``reads_paged``, ``requests``, ``put_one_row_stats``,
    ``past``, ``attended``, ``new_columns``), ``q (B, H, 1, D)`` post-RoPE,
    ``k, v (B, H_kv, 1, D)`` the new entries. The host side of the append (tables grown, slots
    allocated, lengths and sequence indices advanced: :func:`~vlkv.runtime.kv.reservation.reserve_decode_entries`)
    runs here; the kernel writes the K/V rows and the tables' new column, then reads every (request, KV
    head)'s slot row in place — the caches' own tables, holes skipped, nothing copied. Returns
    ``(B, 1, H, D)`` (the layout the output projection takes) and records what ``ctx.attend`` would
    have: the past lengths, the entries attended, and the statistics wanted from this layer (the kernel
    writes the probabilities from the same read).

    Taken for: one new row per request, a paged read (no selected attention, link step, low-rank
    factors or swapped-out request), no pre-RoPE (linked) entries, fp32 CPU pools, the kernel built and
    on (``VLKV_CPU_KERNEL`` and ``VLKV_CPU_APPEND``)."""
    from vlkv.plugins import paged_append, paged_cpu

    if not (paged_append.FUSED_APPEND and paged_cpu.FUSED_KERNEL) or not getattr(ctx, "one_row", False):
        return None
    if ctx.order is None:
        return None
    if q.device.type != "cpu" or q.dtype != torch.float32 or q.shape[2] != 1:
        return None
    layer = ctx.cache.layers[layer_idx]
    rows = getattr(layer, "rows", None)  # a scheduler's batch view, or None for a batch cache
    owners = [layer] if rows is None else rows
    if any(r.linked for r in owners) or not ctx.reads_paged(layer, layer_idx):
        return None
    if rows is not None and any(r.batch != 1 for r in rows):
        return None
    pool = layer.pool
    b, heads, _, dim = q.shape
    kv_heads = pool.spec.kv_heads
    if not paged_append.fits(pool.spec, heads, dim) or k.shape != (b, kv_heads, 1, dim) or v.shape != k.shape:
        return None
    new = _step_columns(ctx)
    # statistics wanted from this layer (H2O every step...): the kernel writes the probabilities too.
    # ``exact_output`` (budget 1) needs nothing more: the call's output is the same bits with or without
    # probabilities, the plain step of this path (test_fused_append_exact.py); sending exact requests
    # to the separate read instead would differ from the full cache's fused step in the last bits
    wanted = [name for name, req in ctx.requests.items() if req.wants(layer_idx)]
    # the C++ call zeroes the running scores' new column (the reservation's 2 ops a table and request),
    # where every score table is as it takes them (shaped like its slot table, float32, unit column
    # stride: checked on the host, no op; a table the reservation grows stays so); else the reservation
    # zeroes them, as before
    in_call = any(r.scores for r in owners) and all(
        _score_fits(s, r.slots) for r in owners for s in r.scores.values()
    )
    ahead = _ahead(ctx, new, layer_idx)
    res = reserve_decode_entries(owners, new["order_next"], new["order_rows"], ahead, zero_scores=not in_call)
    try:  # from here on a failure takes the reservation back (the layer appended whole or not at all)
        past = res.past
        width = max(r.max_length for r in owners) if wanted else None
        columns = paged_append.NewColumns(
            [r.positions for r in owners],
            [r.modality for r in owners],
            [r.order for r in owners],
            past,
            new["positions"],
            new["modality"],
            new["order"],
            # read after the reservation: growing a table for the column replaced it
            [list(r.scores.values()) for r in owners] if in_call else (),
        )
        # the pool's tensors read after the reservation: a growable pool may have grown for it
        got = paged_append.append_attend(
            q.view(b, kv_heads, heads // kv_heads, dim),
            k,
            v,
            pool.keys[layer.layer],
            pool.values[layer.layer],
            pool.prerope_flags(layer.layer),
            res.ids,
            [r.slots for r in owners],
            [_NO_HOLES if r.holes is None else r.holes for r in owners],
            columns,
            res.after if rows is not None else layer.lengths,
            scale,
            probs_width=width,
        )
    except BaseException:
        # refused (some of the kernel's checks run after it wrote the rows) or interrupted: the layer
        # as it was, not counting entries whose K/V may be missing
        res.cancel()
        raise
    if wanted:
        # every column of every row held (no holes, every request as long as the widest): no mask
        full = all(r.holes is None and min(r.host_lengths()) == width for r in owners)
        ctx.put_one_row_stats(layer_idx, wanted, got[2], None if full else got[3][:, :, None, :])
    ctx.past[layer_idx] = past
    ctx.attended[layer_idx] = got[1]
    return got[0].view(b, 1, heads, dim)


def _score_fits(score: Tensor, slots: Tensor) -> bool:
    """A running-score table the C++ append zeroes: float32 CPU, shaped like its ``slots`` table, unit
    column stride."""
    return (
        score.shape == slots.shape and score.dtype == torch.float32 and score.stride(2) == 1 and score.is_cpu
    )


def _step_columns(ctx) -> dict:
    """What every layer's new column gets in this step, split once per step (kept as the context's
    ``new_columns`` while its inputs and orders are the same objects): ``positions (B, P)`` int64,
    ``modality (B,)`` int8, ``order (B,)`` int64, ``order_next`` = order + 1 and its ``order_rows`` per
    request."""
    inputs, order = ctx.inputs, ctx.order
    memo = ctx.new_columns
    if memo is not None and memo[0] is inputs and memo[1] is order:
        return memo[2]
    ord_new = order[:, 0].to(torch.long)
    nxt = ord_new + 1
    cols = {
        "positions": inputs.positions[:, 0].to(torch.long),
        "modality": inputs.modality[:, 0].to(torch.int8),
        "order": ord_new,
        "order_next": nxt,
        "order_rows": list(nxt),
    }
    ctx.new_columns = (inputs, order, cols)
    return cols


def _ahead(ctx, new: dict, layer_idx: int):
    """This layer's lengths and next sequence indices after the step's append, computed for every
    layer at the step's first fused layer (:func:`~vlkv.runtime.kv.reservation.advance_all`: ~10 ops
    for the step where each layer spent 2, or 2 per request on a batch view's one-sample caches);
    None where the cache's layers do not all hold the same number of samples."""
    memo = new.get("ahead")
    if memo is None:
        per = [[la] if getattr(la, "rows", None) is None else la.rows for la in ctx.cache.layers]
        samples = {sum(o.batch for o in owners) for owners in per}
        even = len(samples) == 1 and samples == {new["order_next"].shape[0]}
        memo = new["ahead"] = advance_all(per, new["order_next"]) if even else False
    return memo[layer_idx] if memo else None


_NO_HOLES = torch.empty(0, dtype=torch.bool)


def device_decode_append(ctx, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
    """A decode layer's cache append on the Triton path, in place of ``ctx.update`` (see the module
    docstring); returns the layer's ``(k_pool, v_pool)`` for the registered attention function to read
    paged (``ctx.past`` / ``ctx.paged`` recorded as ``update`` records them), or None where it is not
    taken (the caller calls ``ctx.update``).

    ``k, v (B, H_kv, 1, D)`` the new entries (unit stride on D). Taken for: a scheduler's batch view of
    one-sample caches, one new row per request, a paged read (``ctx.reads_paged``, or low-rank factors
    read in place, ``ctx.reads_factors_paged``: then ``ctx.factor_tables`` builds the read's tables
    after the append, as ``update`` does), no pre-RoPE (linked) entries; ``VLKV_DEVICE_LAYER=0`` (``DEVICE_APPEND``) turns it off with the device layer."""
    from vlkv.runtime.kv.paged import paged_tables

    if not DEVICE_APPEND or not getattr(ctx, "one_row", False) or ctx.order is None or k.shape[2] != 1:
        return None
    layer = ctx.cache.layers[layer_idx]
    rows = getattr(layer, "rows", None)
    if rows is None or any(r.batch != 1 or r.linked for r in rows):
        return None
    # low-rank factors (AttentionPack) read in place: the same append, then their own tables
    factored = not ctx.reads_paged(layer, layer_idx)
    if factored and not ctx.reads_factors_paged(layer):
        return None
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.device != layer.pool.keys[layer.layer].device:
        return None
    new = _step_columns(ctx)
    step = _step_tables(ctx, new, k.device)
    pool, at = layer.pool, layer.layer
    # with the step's rows the launch zeroes the running scores' new column (2 ops a score table,
    # request and layer less); where the rows do not hold, the column writes below zero it
    zeroed = step is None
    ahead = _ahead(ctx, new, layer_idx)
    res = reserve_decode_entries(rows, new["order_next"], new["order_rows"], ahead, zero_scores=zeroed)
    try:  # from here on a failure takes the reservation back (the layer appended whole or not at all)
        keys, values = pool.keys[at], pool.values[at]
        if step is not None and step.holds(layer_idx, rows, res):
            paged = _append_by_rows(
                step, layer_idx, rows, res, keys, values, pool.prerope_flags(at), k, v, new, not factored
            )
        else:
            if not zeroed:
                for r, p in zip(rows, res.host):
                    r.zero_score_column(p)
            paged = _append_by_columns(ctx, new, rows, res, keys, values, pool.prerope_flags(at), k, v)
    except BaseException:
        res.cancel()
        raise
    ctx.past[layer_idx] = res.past
    if factored:
        ctx.paged[layer_idx] = ctx.factor_tables(layer)
    else:
        ctx.paged[layer_idx] = paged_tables(layer) if paged is None else paged
    return keys, values


def _step_tables(ctx, new: dict, device):
    """The step's :class:`~vlkv.runtime.kv.step_tables.StepTables` (built at its first device append,
    kept in ``new``), or None where the cache's layers are not all batch views of as many one-sample
    caches (``VLKV_STEP_TABLES=0``: never, the per-request column writes)."""
    memo = new.get("step_tables")
    if memo is None:
        from vlkv.runtime.kv.step_tables import StepTables

        per = [getattr(la, "rows", None) for la in ctx.cache.layers]
        even = all(p is not None and len(p) == len(per[0]) and all(r.batch == 1 for r in p) for p in per)
        memo = new["step_tables"] = StepTables(per, device) if STEP_TABLES and even and per else False
    return memo or None


def _append_by_rows(step, layer_idx, rows, res, keys, values, flags, k, v, new, read=True) -> tuple | None:
    """The layer's pool write, table columns and read table in one launch from the step's rows
    (``paged_append_triton.decode_append_``); returns what ``paged_tables`` would (None where a request
    holds holes, or without ``read``, a layer with low-rank factors: the caller builds it)."""
    from vlkv.plugins.paged_append_triton import decode_append_
    from vlkv.runtime.kv.paged import PagedHost

    cols = new.get("device_columns")
    if cols is None:  # the new column's values on the pool's device, once per step
        dev = keys.device
        cols = new["device_columns"] = tuple(
            new[n].to(dev).contiguous() for n in ("positions", "modality", "order")
        )
    built = not read or any(r.holes is not None for r in rows)  # the caller builds the read's tables
    width = step.width(layer_idx)
    out = (
        None if built else torch.empty(len(rows), keys.shape[0], width, dtype=torch.long, device=keys.device)
    )
    ids = None if step.runs[layer_idx] is not None else res.ids
    decode_append_(keys, values, flags, k, v, step.meta, layer_idx, *cols, ids=ids, out=out)
    if built:
        return None
    heads = keys.shape[0]
    host = PagedHost([[p + 1] * heads for p in step.columns[layer_idx]], False)
    return out, step.lengths[layer_idx], step.attended[layer_idx], {}, host


def _append_by_columns(ctx, new, rows, res, keys, values, flags, k, v) -> None:
    """The layer's pool write as one launch, then each request's table column by tensor ops
    (``Appends._put_column``): where the step's rows do not hold. Returns None (``paged_tables`` reads)."""
    from vlkv.plugins import triton_glue

    per = new.get("per_request")
    if per is None:  # each request's new column values on the pool's device, split once per step
        dev = k.device
        cols = (new["positions"], new["modality"], new["order"])
        per = new["per_request"] = tuple(list(c.to(dev)) for c in cols)
    triton_glue.pool_write_(keys, values, flags, res.ids, k, v)
    if res.run is not None:  # every row continues its run: its table column from its int id
        cols = list(res.spare)
    else:
        cols = [s if isinstance(s, int) else res.ids[:, i] for i, s in enumerate(res.spare)]
    for r, p, col, pos, mod, order in zip(rows, res.host, cols, *per):
        r._put_column(p, col, pos, mod, order)
    return None
