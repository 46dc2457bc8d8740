"""PyTorch launcher for ``paged_attention_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.flash_tiles import combine_splits_kernel
from vlkv.plugins.paged_attention_kernels import paged_attention_kernel
from vlkv.plugins.paged_reference import check_paged_args
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32
from vlkv.plugins.triton_selected_attention import default_num_splits, tile_sizes


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
) -> Tensor:
    """Triton version of ``paged_reference.paged_attention_reference``: same arguments and result (q,
    k_pool and v_pool one float dtype), plus num_splits: column splits per (request, KV head); None picks
    one from the launch size.
    """
    check_float_dtype("q", q.dtype)
    if not q.dtype == k_pool.dtype == v_pool.dtype:
        raise ValueError(
            f"q, k_pool, v_pool must share a dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    group, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    if rope:
        rot, cos, sin = rot.to(q.device), cos.to(q.device), sin.to(q.device)
    else:  # unused pointers (HAS_ROPE is off): any tensor on the device
        rot = cos = sin = table
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    table, lengths = table.to(q.device), lengths.to(q.device)
    block_m, block_n, block_d, block_dv = tile_sizes(group * num_q, dim, dim_v)
    grid_m = triton.cdiv(group * num_q, block_m)
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads * grid_m, cols, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    rows = batch * kv_heads * num_splits * group * num_q
    part_m = torch.empty(rows if num_splits > 1 else 1, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows * dim_v if num_splits > 1 else 1, dtype=torch.float32, device=q.device)
    if batch * kv_heads == 0:
        return out.zero_()
    paged_attention_kernel[(batch * kv_heads, grid_m, num_splits)](
        q, k_pool, v_pool, table, lengths, out, part_m, part_l, part_acc, rot, cos, sin,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *lengths.stride(), *out.stride(),
        *(rot.stride() if rope else (0, 0, 0)), *(cos.stride() if rope else (0, 0)),
        kv_heads, group, num_q, dim, dim_v, cols, cos.shape[-1] if rope else 0,
        SCALE=float(scale), NUM_SPLITS=num_splits, IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits_kernel[(batch * kv_heads, grid_m)](
            part_m, part_l, part_acc, out, *out.stride(), kv_heads, group, num_q, dim_v,
            NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_DV=block_dv,
        )  # fmt: skip
    return out
