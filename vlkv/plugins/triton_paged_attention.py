"""PyTorch launcher for ``paged_attention_kernels.py`` (see that module for the algorithm).

Every decode layer launches it once: its fp32 partial buffers (the splits' running max, sum and
accumulator) are kept per device and size and reused by the next launch (:func:`_partials`) instead of
three allocations a layer; launches on one stream run in order, so a buffer is free again when the
next kernel starts (``combine_splits`` read it before).
"""

from __future__ import annotations

import threading

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_attention_kernels import paged_attention_kernel
from vlkv.plugins.paged_reference import check_paged_args
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32
from vlkv.plugins.triton_selected_attention import (
    SplitPlan,
    combine_splits,
    default_num_splits,
    plan_splits,
    tile_sizes,
)

# (thread, device, rows, D_v) → the partial buffers (part_m, part_l, part_acc) of a launch that size
_PARTIALS: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
# sizes kept at once (a step's layers share one; batch and split count change between steps)
_MAX_PARTIALS = 8


def _partials(rows: int, dim_v: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The fp32 ``(rows,)``, ``(rows,)``, ``(rows·D_v,)`` partial buffers, reused across launches."""
    key = (threading.get_ident(), device, rows, dim_v)  # two threads' launches never share one
    got = _PARTIALS.get(key)
    if got is None:
        if len(_PARTIALS) >= _MAX_PARTIALS:
            _PARTIALS.clear()
        part = torch.empty(rows * (2 + dim_v), dtype=torch.float32, device=device)
        got = _PARTIALS[key] = (part[:rows], part[rows : 2 * rows], part[2 * rows :])
    return got


def _plan(pairs: int, group_rows: int, dim: int, dim_v: int, cols: int, num_splits: int | None, device):
    """``plan_splits``' :class:`SplitPlan` with reused partial buffers (:func:`_partials`)."""
    block_m, block_n, block_d, block_dv = tile_sizes(group_rows, dim, dim_v)
    grid_m = triton.cdiv(group_rows, block_m)
    if num_splits is None:
        num_splits = default_num_splits(pairs * grid_m, cols, block_n)
    if num_splits < 1:
        return plan_splits(pairs, group_rows, dim, dim_v, cols, num_splits, device)  # its error
    rows = pairs * num_splits * group_rows if num_splits > 1 else 1
    part_m, part_l, part_acc = _partials(rows, dim_v if num_splits > 1 else 1, device)
    grid = (pairs, grid_m, num_splits)
    return SplitPlan(grid, block_m, block_n, block_d, block_dv, part_m, part_l, part_acc)


def paged_attention_triton(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    num_splits: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
) -> Tensor:
    """Triton version of ``paged_reference.paged_attention_reference``: same arguments and result (q,
    k_pool and v_pool one float dtype), plus num_splits: column splits per (request, KV head); None picks
    one from the launch size.

    sec: None, or the M-RoPE table form (the static decode step's): ``rot (B, H_kv, C, P)`` int64 each
    column's position components (component 0 < 0: stored post-RoPE), ``cos, sin (T, D_r)`` a table by
    position, ``sec (D_r,)`` int64 the component each dim's angle reads (:func:`rope_form`).
    """
    rope_args = launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec)
    group = rope_args[0]
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    table, lengths = table.to(q.device), lengths.to(q.device)
    plan = _plan(batch * kv_heads, group * num_q, dim, dim_v, cols, num_splits, q.device)
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    if batch * kv_heads == 0:
        return out.zero_()
    args, constexprs = shared_launch(q, k_pool, v_pool, table, lengths, scale, out, plan, rope_args, sec)
    paged_attention_kernel[plan.grid](*args, **constexprs)
    combine_splits(plan, out, kv_heads, group)
    return out


def launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec):
    """The checks and rotary arguments both paged kernels' launches share (tensors as
    :func:`paged_attention_triton` takes them): ``(group, rope, rot4, rot, cos, sin)`` with ``rope`` whether
    keys are rotated on read and ``rot, cos, sin`` on q's device (the table itself where unused: the
    kernel's ``HAS_ROPE`` is off, any tensor on the device serves as a pointer)."""
    check_float_dtype("q", q.dtype)
    if not q.dtype == k_pool.dtype == v_pool.dtype:
        raise ValueError(
            f"q, k_pool, v_pool must share a dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    rot4, rot = rope_form(rot, cos, sec)
    group, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    if rope:
        rot, cos, sin = rot.to(q.device), cos.to(q.device), sin.to(q.device)
    else:
        rot = cos = sin = table
    return group, rope, rot4, rot, cos, sin


def shared_launch(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    out: Tensor,
    plan: SplitPlan,
    rope_args: tuple,
    sec: Tensor | None,
) -> tuple[tuple, dict]:
    """``(args, constexprs)``: the leading positional arguments ``paged_attention_kernel`` and
    ``paged_lowrank_kernel`` share, in their order (the tensors, the plan's partials, the rotary tensors
    and ``sec``; their strides; ``HKV, GROUP, Q, D, DV, COLS, DR, NR``), and their common constexprs
    (``SCALE, IEEE, HAS_ROPE, MROPE`` and the plan's). ``rope_args``: :func:`launch_args`' return; ``table``
    and ``lengths`` already on q's device. No tensor op (a static step's device half counts them)."""
    group, rope, rot4, rot, cos, sin = rope_args
    args = (
        q, k_pool, v_pool, table, lengths, out, plan.part_m, plan.part_l, plan.part_acc, rot, cos, sin,
        table if sec is None else sec,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *lengths.stride(), *out.stride(),
        *rope_strides(rope, rot, rot4, cos), k_pool.shape[0], group, q.shape[2], q.shape[3], v_pool.shape[-1],
        table.shape[-1], cos.shape[-1] if rope else 0, cos.shape[0] if rope else 1,
    )  # fmt: skip
    constexprs = dict(SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, MROPE=sec is not None)
    return args, {**constexprs, **plan.constexprs}


def rope_form(
    rot: Tensor | None, cos: Tensor | None, sec: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """``(rot4, rot)``: with ``sec`` (the M-RoPE table form) the ``(B, H_kv, C, P)`` positions and their
    component 0 as the ``(B, H_kv, C)`` rows ``check_paged_args`` checks; else ``(None, rot)``. Checks
    ``sec`` against the table's width."""
    if sec is None:
        return None, rot
    if rot is None or rot.dim() != 4 or cos is None:
        raise ValueError("sec (the M-RoPE table form) needs rot (B, H_kv, C, P) and cos/sin tables")
    if sec.shape != (cos.shape[-1],) or sec.dtype != torch.long:
        raise ValueError(f"sec must be int64 ({cos.shape[-1]},), got {tuple(sec.shape)} {sec.dtype}")
    return rot, rot[..., 0]


def rope_strides(rope: bool, rot: Tensor, rot4: Tensor | None, cos: Tensor) -> tuple[int, ...]:
    """The kernels' ``srb, srh, src, srp, scr, scd`` (zeros without pre-RoPE keys)."""
    if not rope:
        return (0,) * 6
    return (*rot.stride(), 0 if rot4 is None else rot4.stride(3), *cos.stride())
