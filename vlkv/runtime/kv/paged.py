"""What a paged decode read takes from a layer's cache: its slot table, lengths and pre-RoPE rows.

``vlkv.plugins.ops.paged_attention`` (and ``paged_probs``) read one layer's pool through per-request,
per-KV-head slot tables; :func:`paged_tables` builds those arguments from a
:class:`~vlkv.runtime.cache.LayerKV` or a scheduler's batch view (:class:`~vlkv.runtime.kv.batch.LayerBatch`)
without reading any K/V: holes become ``-1`` slots, and linked (pre-RoPE) entries get one cos/sin row
each at the position their cache gives them. Low-rank factor rows stay negative slots here;
``kv/paged_factors`` names them for the paged low-rank read.

On fp32 CPU pools a decode layer skips both that table build and the Python append:
``vlkv.runtime.fused_append.fused_decode_row`` hands the new rows, the caches' own tables and holes to
one C++ call that writes and reads (``vlkv/plugins/paged_append.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedHost:
    """A paged read's lengths as the cache keeps them on the host.

    lengths: ``[[n] * H_kv]`` per request, the ``lengths (B, H_kv)`` the read takes, as Python ints.
    holes: some row may hold a ``-1`` slot inside its length (per-head holes); False: none does.
    """

    lengths: list[list[int]]
    holes: bool


def paged_tables(layer, rope: bool = True) -> tuple[Tensor, Tensor, Tensor, dict, PagedHost]:
    """What ``ops.paged_attention`` reads for a layer (or a batch view) in a decode step:
    ``table (B, H_kv, n)``, its slot table with ``-1`` at holes (``n`` its longest row),
    ``lengths (B, H_kv)``, ``attended (B,)`` float64, the entries a row attends (mean over heads), the
    op's pre-RoPE keywords (``rot``, ``cos``, ``sin``; empty when no entry is stored pre-RoPE, or
    without ``rope``: a caller that builds the rotary table form itself, ``kv/paged_factors``, skips the
    row form's mask read back, gather and largest-position read), and :class:`PagedHost`, what the host
    already knows of the lengths (so the ops route without reads)."""
    n = layer.max_length
    table = layer.table(n)
    lengths = layer.lengths
    open_ = layer.open_mask(n)
    if open_ is not None:
        table = table.masked_fill(~open_, -1)
    wide = lengths[:, None].expand(-1, table.shape[1])
    rows = getattr(layer, "rows", [layer])  # a batch view's requests, or the layer itself
    heads = table.shape[1]
    # a negative slot inside a length is a hole (masked above) or a low-rank factor row (-(1 + row):
    # the plain read skips it; kv/paged_factors names it for the low-rank read)
    holes = open_ is not None or any(r.lowrank is not None for r in rows)
    host = PagedHost([[m] * heads for r in rows for m in r.host_lengths()], holes)
    rot = _rope_rows(layer, table, wide) if rope else {}
    return table, wide, attended_entries(lengths, open_), rot, host


def linked_prerope(layer, table: Tensor, lengths: Tensor) -> Tensor:
    """``(B, H_kv, n)`` bool: the held columns of ``table`` (slots ``>= 0`` inside ``lengths``) whose
    pool entry is stored pre-RoPE (linked entries). A device mask, no read back."""
    n = table.shape[2]
    held = (table >= 0) & (torch.arange(n, device=table.device) < lengths[..., None])
    return layer.pool.is_prerope(layer.layer, table.clamp_min(0)) & held


def _rope_rows(layer, table: Tensor, lengths: Tensor) -> dict:
    """``rot (B, H_kv, n)`` / ``cos, sin (R, D)`` for the held pre-RoPE (linked) entries of a layer:
    one row per such entry, at the position this cache gives it (the model's rotary, 1-D or M-RoPE)."""
    rows = getattr(layer, "rows", [layer])
    if not any(r.linked for r in rows):
        return {}
    n = table.shape[2]
    pool = layer.pool
    pre = linked_prerope(layer, table, lengths)
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
