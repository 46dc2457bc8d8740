"""What a paged decode read takes from a layer's cache: its slot table, lengths and pre-RoPE rows.

``vlkv.plugins.ops.paged_attention`` (and ``paged_probs``) read one layer's pool through per-request,
per-KV-head slot tables; :func:`paged_tables` builds those arguments from a
:class:`~vlkv.runtime.cache.LayerKV` or a scheduler's batch view (:class:`~vlkv.runtime.kv.batch.LayerBatch`)
without reading any K/V: holes become ``-1`` slots, and linked (pre-RoPE) entries are rotated by the
model's rotary table at the positions their cache gives them (:func:`rope_by_position`, no read back). Low-rank factor rows stay negative slots here;
``kv/paged_factors`` names them for the paged low-rank read.

On fp32 CPU pools a decode layer skips both that table build and the Python append:
``vlkv.runtime.fused_append.fused_decode_row`` hands the new rows, the caches' own tables and holes to
one C++ call that writes and reads (``vlkv/plugins/paged_append.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.kv.rope_table import table_as_rows


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
    op's pre-RoPE keywords (``rot``, ``cos``, ``sin`` by the rotary table, :func:`rope_by_position`;
    empty when no request holds linked entries, or without ``rope``: a caller that builds its own,
    ``kv/paged_factors``), and :class:`PagedHost`, what the host already knows of the lengths (so the
    ops route without reads). Reads nothing back."""
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
    """The pre-RoPE keywords (``rot``, ``cos``, ``sin``) for the held pre-RoPE (linked) entries of a
    layer, at the positions this cache gives them (the model's rotary, 1-D or M-RoPE), in the rotary
    table's row form (:func:`rope_by_position`; M-RoPE's table form where the read is the Triton
    kernel's): no read back on a GPU. Empty without linked entries (a host
    attribute); a layer whose linked entries were all evicted gets ``rot`` all ``-1`` (nothing rotated)."""
    from vlkv.plugins.ops import use_triton

    rows = getattr(layer, "rows", [layer])
    if not any(r.linked for r in rows):
        return {}
    # where the read is the Triton kernel's (CUDA, forced Triton) M-RoPE takes the table form: no sync
    sec_form = use_triton(layer.pool.keys[layer.layer])
    return rope_by_position(layer, linked_prerope(layer, table, lengths), sec_form=sec_form)


def rope_by_position(layer, pre: Tensor, sec_form: bool = False) -> dict:
    """Pre-RoPE keywords rotating the columns of ``pre (B, H_kv, n)`` bool by the model's rotary table
    (``Rope.table``: rows by position, built once per model, dtype, device and pool size), ``-1``
    where not rotated. No boolean-mask gather and no read of the largest position (the row form that
    gave one ``cos/sin`` row per rotated entry cost 3 host syncs a layer).

    - 1-D RoPE: ``rot (B, H_kv, n)`` each column's position, ``cos, sin (T, D_r)`` the table: a row
      form every paged read takes (a column's row of ``cos`` is its position's).
    - M-RoPE, ``sec_form``: ``rot (B, H_kv, n, P)`` the positions and ``sec (D_r,)`` (the Triton
      kernels' table form, ``kv/rope_table``); else the row form every paged read takes, one row per
      ROTATED column (``cos, sin (R, D_r)``, ``rope_table.table_as_rows`` of those columns only), found
      by mask: 2 host syncs a layer (a CPU read's, where a sync costs nothing). A row for every column
      (``B·H_kv·n`` rows, no sync) would move several times the keys' own bytes each layer at long
      contexts. The paged ops take the table form (``sec``), so a read on the Triton kernel asks for it
      (``_rope_rows``). Empty when no column is rotated."""
    n = pre.shape[2]
    rows = getattr(layer, "rows", [layer])
    positions = torch.cat([_columns(r.positions, n) for r in rows]).to(pre.device)  # (B, H_kv, n, P)
    like = layer.pool.keys[layer.layer]
    tab = layer.pool.rope.table(like, positions.shape[-1], layer.pool.capacity(layer.layer))
    if tab.sec is None:
        return {"rot": torch.where(pre, positions[..., 0], -1), "cos": tab.cos, "sin": tab.sin}
    if sec_form:
        return {
            "rot": torch.where(pre[..., None], positions, -1),
            "cos": tab.cos,
            "sin": tab.sin,
            "sec": tab.sec,
        }
    if not bool(pre.any()):
        return {}
    at = positions[pre][None, None]  # (1, 1, R, P): the rotated columns only
    _, cos, sin = table_as_rows(at, tab)
    rot = torch.full(pre.shape, -1, dtype=torch.long, device=pre.device)
    rot[pre] = torch.arange(cos.shape[0], device=pre.device)
    return {"rot": rot, "cos": cos, "sin": sin}


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
