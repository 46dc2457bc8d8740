"""Launcher of ``paged_append_kernels.decode_append_kernel`` (a decode layer's pool write, every request's
new table column and the layer's read table in one launch) and its PyTorch reference.

The kernel writes through addresses: each request's tables must stay the tensors the step's meta rows
name, contiguous, with room for the new column — ``vlkv.runtime.kv.step_tables.StepTables`` builds the
rows and checks that on the host before each launch.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_append_kernels import MAX_SCORES, decode_append_kernel
from vlkv.plugins.paged_append_kernels import META_FIELDS as FIELDS


def decode_append_(
    k_pool: Tensor,
    v_pool: Tensor,
    prerope: Tensor,
    k: Tensor,
    v: Tensor,
    meta: Tensor,
    layer: int,
    new_positions: Tensor,
    new_modality: Tensor,
    new_order: Tensor,
    ids: Tensor | None = None,
    out: Tensor | None = None,
    rot_out: Tensor | None = None,
) -> None:
    """One decode layer's append (see ``paged_append_kernels``).

    ``k, v (B, H_kv, 1, D)`` the new rows (unit stride on D) into ``k_pool / v_pool (H_kv, S, D)`` and
    their flags ``prerope (H_kv, S)`` cleared; ``meta (L, B, FIELDS)`` int64 contiguous, the step's rows,
    ``layer`` the row block this layer reads; ``new_positions (B, P)`` int64, ``new_modality (B,)``
    int8, ``new_order (B,)`` int64 (unit stride) the new column's values. ``ids (H_kv, B)`` int64 the
    slots (any strides); None: the meta rows' run ids (one slot per request, every head). ``out (B, H_kv,
    W)`` int64 (unit stride on W): the layer's read table is written there; None: not written.
    ``rot_out (B, H_kv, W, P)`` int64 (unit stride on P; with ``out``): each held column's positions where
    its key is stored pre-RoPE (``prerope``), ``-1`` elsewhere; None: not written.
    """
    b, heads, one, d = k.shape
    if v.shape != k.shape or one != 1 or k_pool.shape[0] != heads or k_pool.shape[-1] != d:
        raise ValueError(
            f"decode_append_: k {tuple(k.shape)}, v {tuple(v.shape)}, pool {tuple(k_pool.shape)}"
        )
    if v_pool.shape != k_pool.shape or prerope.shape != k_pool.shape[:2]:
        raise ValueError(
            f"decode_append_: pools / flags {tuple(v_pool.shape)} {tuple(prerope.shape)} do not match"
        )
    if (
        meta.dim() != 3
        or meta.shape[1:] != (b, FIELDS)
        or meta.dtype != torch.long
        or not meta.is_contiguous()
    ):
        raise ValueError(
            f"decode_append_: meta must be contiguous int64 (L, {b}, {FIELDS}), got {tuple(meta.shape)}"
        )
    if not 0 <= layer < meta.shape[0]:
        raise ValueError(f"decode_append_: layer {layer} outside the meta's {meta.shape[0]} layers")
    p = new_positions.shape[-1]
    if new_positions.shape != (b, p) or new_modality.shape != (b,) or new_order.shape != (b,):
        raise ValueError("decode_append_: new_positions (B, P), new_modality (B,), new_order (B,) needed")
    if (new_positions.dtype, new_modality.dtype, new_order.dtype) != (torch.long, torch.int8, torch.long):
        raise ValueError("decode_append_: new positions / order int64 and modality int8 needed")
    if new_positions.stride(-1) != 1 or new_modality.stride(0) != 1 or new_order.stride(0) != 1:
        raise ValueError("decode_append_: the new column's values need unit stride")
    if any(t.stride(-1) != 1 for t in (k, v, k_pool, v_pool, prerope)):
        raise ValueError("decode_append_: K/V rows, pools and flags need unit stride on their last dimension")
    if ids is not None and (ids.shape != (heads, b) or ids.dtype != torch.long):
        raise ValueError(f"decode_append_: ids must be int64 ({heads}, {b}), got {tuple(ids.shape)}")
    if out is not None and (out.shape[:2] != (b, heads) or out.dtype != torch.long or out.stride(-1) != 1):
        raise ValueError(f"decode_append_: out must be int64 ({b}, {heads}, W), got {tuple(out.shape)}")
    if rot_out is not None and (
        out is None
        or rot_out.shape != (*out.shape, new_positions.shape[-1])
        or rot_out.dtype != torch.long
        or rot_out.stride(-1) != 1
    ):
        raise ValueError(
            f"decode_append_: rot_out must be int64 (B, H_kv, W, P) beside out, got {tuple(rot_out.shape)}"
        )
    if not (b and heads):
        return
    width = 0 if out is None else out.shape[2]
    sih, sib = (0, 0) if ids is None else ids.stride()
    sob, soh = (0, 0) if out is None else out.stride()[:2]
    decode_append_kernel[(b, heads)](
        k, v, k_pool, v_pool, prerope, meta if ids is None else ids, meta, new_positions, new_modality,
        new_order, meta if out is None else out, meta if rot_out is None else rot_out,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), prerope.stride(0), sih, sib, new_positions.stride(0), sob, soh,
        *((0, 0, 0) if rot_out is None else rot_out.stride()[:3]),
        layer * b * FIELDS, d, p, width,
        RUN_IDS=ids is None, HAS_OUT=out is not None, HAS_ROT=rot_out is not None,
        BLOCK=triton.next_power_of_2(d),
        BLOCK_P=triton.next_power_of_2(p), BLOCK_W=min(triton.next_power_of_2(max(width, 1)), 1024),
        FIELDS=FIELDS, N_SCORES=MAX_SCORES,
    )  # fmt: skip


def decode_append_reference(
    k_pool: Tensor,
    v_pool: Tensor,
    prerope: Tensor,
    k: Tensor,
    v: Tensor,
    tables: list[dict[str, Tensor | None]],
    columns: list[int],
    ids: Tensor,
    new_positions: Tensor,
    new_modality: Tensor,
    new_order: Tensor,
    width: int,
) -> tuple[Tensor, Tensor, Tensor, list[dict[str, Tensor | None]], Tensor]:
    """What :func:`decode_append_` writes, as new tensors: the pools and flags, each request's tables
    (``tables[b]``: ``slots``, ``positions``, ``modality``, ``order``, ``holes`` or None, shaped
    ``(1, H_kv, C_b[, P])``; optionally ``scores``, a list of ``(1, H_kv, C_b)`` float32 running-score
    tables, zeroed there) with column ``columns[b]`` written, and the ``(B, H_kv, width)`` read table.
    ``ids (H_kv, B)`` int64 the slots."""
    heads = ids.shape[0]
    kp, vp, flags = k_pool.clone(), v_pool.clone(), prerope.clone()
    hh = torch.arange(heads)[:, None].expand_as(ids)
    kp[hh, ids] = k[:, :, 0].transpose(0, 1).to(kp.dtype)
    vp[hh, ids] = v[:, :, 0].transpose(0, 1).to(vp.dtype)
    flags[hh, ids] = False
    new_tables, read = [], torch.zeros(len(tables), heads, width, dtype=torch.long)
    for b, (t, p) in enumerate(zip(tables, columns)):
        scores = [x.clone() for x in t.get("scores", ())]
        t = {name: None if x is None else x.clone() for name, x in t.items() if name != "scores"}
        for x in scores:
            x[0, :, p] = 0
        if scores:
            t["scores"] = scores
        t["slots"][0, :, p] = ids[:, b]
        t["positions"][0, :, p] = new_positions[b]
        t["modality"][0, :, p] = new_modality[b]
        t["order"][0, :, p] = new_order[b]
        row = t["slots"][0, :, :p]
        if t["holes"] is not None:
            t["holes"][0, :, p] = False
            row = row.masked_fill(t["holes"][0, :, :p], -1)
        read[b, :, :p] = row[:, :width]
        if p < width:
            read[b, :, p] = ids[:, b]
        new_tables.append(t)
    return kp, vp, flags, new_tables, read
