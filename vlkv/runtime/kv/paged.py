"""What a paged decode read takes from a layer's cache: its slot table, lengths and pre-RoPE rows.

``vlkv.plugins.ops.paged_attention`` (and ``paged_probs``) read one layer's pool through per-request,
per-KV-head slot tables; :func:`paged_tables` builds those arguments from a
:class:`~vlkv.runtime.cache.LayerKV` or a scheduler's batch view (:class:`~vlkv.runtime.kv.batch.LayerBatch`)
without reading any K/V: holes become ``-1`` slots, and linked (pre-RoPE) entries get one cos/sin row
each at the position their cache gives them.

On fp32 CPU pools a decode layer skips both that table build and the Python append:
:func:`fused_decode_row` does the append's host bookkeeping and hands the new rows, the caches' own tables
and holes to one C++ call that writes and reads (``vlkv/plugins/paged_append.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.kv.appends import reserve_decode_entries


@dataclass(frozen=True)
class PagedHost:
    """A paged read's lengths as the cache keeps them on the host.

    lengths: ``[[n] * H_kv]`` per request, the ``lengths (B, H_kv)`` the read takes, as Python ints.
    holes: some row may hold a ``-1`` slot inside its length (per-head holes); False: none does.
    """

    lengths: list[list[int]]
    holes: bool


def paged_tables(layer) -> tuple[Tensor, Tensor, Tensor, dict, PagedHost]:
    """What ``ops.paged_attention`` reads for a layer (or a batch view) in a decode step:
    ``table (B, H_kv, n)``, its slot table with ``-1`` at holes (``n`` its longest row),
    ``lengths (B, H_kv)``, ``attended (B,)`` float64, the entries a row attends (mean over heads), the
    op's pre-RoPE keywords (``rot``, ``cos``, ``sin``; empty when no entry is stored pre-RoPE), and
    :class:`PagedHost`, what the host already knows of the lengths (so the ops route without reads)."""
    n = layer.max_length
    table = layer.table(n)
    lengths = layer.lengths
    open_ = layer.open_mask(n)
    if open_ is not None:
        table = table.masked_fill(~open_, -1)
    wide = lengths[:, None].expand(-1, table.shape[1])
    rows = getattr(layer, "rows", [layer])  # a batch view's requests, or the layer itself
    heads = table.shape[1]
    # a -1 slot inside a length is a hole (masked above) or a low-rank factor row (not read paged)
    holes = open_ is not None or any(r.lowrank is not None for r in rows)
    host = PagedHost([[m] * heads for r in rows for m in r.host_lengths()], holes)
    return table, wide, attended_entries(lengths, open_), _rope_rows(layer, table, wide), host


def _rope_rows(layer, table: Tensor, lengths: Tensor) -> dict:
    """``rot (B, H_kv, n)`` / ``cos, sin (R, D)`` for the held pre-RoPE (linked) entries of a layer:
    one row per such entry, at the position this cache gives it (the model's rotary, 1-D or M-RoPE)."""
    rows = getattr(layer, "rows", [layer])
    if not any(r.linked for r in rows):
        return {}
    n = table.shape[2]
    pool = layer.pool
    held = (table >= 0) & (torch.arange(n, device=table.device) < lengths[..., None])
    pre = pool.is_prerope(layer.layer, table.clamp_min(0)) & held
    if not bool(pre.any()):
        return {}
    positions = torch.cat([_columns(r.positions, n) for r in rows])  # (B, H_kv, n, P)
    like = pool.keys[layer.layer]
    # Rope's cos/sin rows (its 1-D table gather, or the model's M-RoPE) for the R entries to rotate
    cos, sin = pool.rope.cos_sin(like, positions[pre][None])  # (1, R, D)
    rot = torch.full_like(table, -1)
    rot[pre] = torch.arange(cos.shape[1], device=table.device)
    return {"rot": rot, "cos": cos[0], "sin": sin[0]}


def _columns(t: Tensor, n: int) -> Tensor:
    """The first ``n`` columns (dim 2) of a per-entry table, zero-padded past its capacity."""
    t = t[:, :, :n]
    if t.shape[2] < n:
        t = torch.cat([t, t.new_zeros(*t.shape[:2], n - t.shape[2], *t.shape[3:])], dim=2)
    return t


def attended_entries(lengths: Tensor, open_: Tensor | None) -> Tensor:
    """``(B,)`` float64 entries the last row attended (mean over KV heads): ``lengths (B,)`` minus holes."""
    if open_ is None:
        return lengths.double()
    visible = torch.arange(open_.shape[2], device=open_.device)[None, None, :] < lengths[:, None, None]
    return (open_ & visible).double().sum(2).mean(1)


def fused_decode_row(ctx, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """A decode layer's cache append and attention as one C++ call (``vlkv/plugins/paged_append.py``),
    where the step and the cache allow it; None where they do not (the caller appends through
    ``ctx.update`` and attends through the registered attention function, the reference path).

    ``ctx`` is the step's context (the torch backend's ``_StepContext``), ``q (B, H, 1, D)`` post-RoPE,
    ``k, v (B, H_kv, 1, D)`` the new entries. The host side of the append (tables grown, slots
    allocated, lengths and sequence indices advanced: :func:`~vlkv.runtime.kv.appends.reserve_decode_entries`)
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
    if any(r.linked for r in owners) or not ctx._paged(layer, layer_idx):
        return None
    if rows is not None and any(r.batch != 1 for r in rows):
        return None
    pool = layer.pool
    b, heads, _, dim = q.shape
    kv_heads = pool.spec.kv_heads
    if not paged_append.fits(pool.spec, heads, dim) or k.shape != (b, kv_heads, 1, dim) or v.shape != k.shape:
        return None
    new = _step_columns(ctx)
    res = reserve_decode_entries(owners, new["order_next"], new["order_rows"])
    past, ids = res.past, res.ids
    # read after the append: a growable pool (and a table) may have grown for it
    k_pool, v_pool = pool.keys[layer.layer], pool.values[layer.layer]
    columns = paged_append.NewColumns(
        [r.positions for r in owners],
        [r.modality for r in owners],
        [r.order for r in owners],
        past,
        new["positions"],
        new["modality"],
        new["order"],
    )
    # statistics wanted from this layer (H2O every step...): the kernel writes the probabilities too
    wanted = [name for name, req in ctx.requests.items() if req.wants(layer_idx)]
    width = max(r.max_length for r in owners) if wanted else None
    try:
        got = paged_append.append_attend(
            q.view(b, kv_heads, heads // kv_heads, dim),
            k,
            v,
            k_pool,
            v_pool,
            pool._prerope[layer.layer],
            ids,
            [r.slots for r in owners],
            [_NO_HOLES if r.holes is None else r.holes for r in owners],
            columns,
            past + 1 if rows is not None else layer.lengths,
            scale,
            probs_width=width,
        )
    except BaseException:
        # refused (some checks run after the rows are written) or interrupted: the layer as it was,
        # not counting entries whose K/V may be missing
        res.cancel()
        raise
    if wanted:
        # every column of every row held (no holes, every request as long as the widest): no mask
        full = all(r.holes is None and min(r.host_lengths()) == width for r in owners)
        ctx._put_one_row_stats(layer_idx, wanted, got[2], None if full else got[3][:, :, None, :])
    ctx.past[layer_idx] = past
    ctx.attended[layer_idx] = got[1]
    return got[0].view(b, 1, heads, dim)


def _step_columns(ctx) -> dict:
    """What every layer's new column gets in this step, split once per step (kept on the context while
    its inputs and orders are the same objects): ``positions (B, P)`` int64, ``modality (B,)`` int8,
    ``order (B,)`` int64, ``order_next`` = order + 1 and its ``order_rows`` per request."""
    inputs, order = ctx.inputs, ctx.order
    memo = ctx.__dict__.get("_fused_columns")
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
    ctx.__dict__["_fused_columns"] = (inputs, order, cols)
    return cols


_NO_HOLES = torch.empty(0, dtype=torch.bool)
