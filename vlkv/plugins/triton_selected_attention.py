"""PyTorch launcher for the kernels in ``selected_attention_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.flash_tiles import combine_splits_kernel
from vlkv.plugins.reference import check_gqa
from vlkv.plugins.selected_attention_kernels import selected_attention_kernel
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32


def tile_sizes(group_rows: int, head_dim: int, value_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV); tl.dot needs every tile side >= 16."""
    block_m = min(64, max(16, triton.next_power_of_2(group_rows)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(value_dim))
    return block_m, 32 if max(block_d, block_dv) > 64 else 64, block_d, block_dv


def default_num_splits(programs: int, num_selected: int, block_n: int) -> int:
    """Split the selection until about 256 programs run (two waves on an H100), one key block minimum."""
    return max(1, min(triton.cdiv(256, max(programs, 1)), triton.cdiv(max(num_selected, 1), block_n), 64))


def selected_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    lengths: Tensor,
    scale: float,
    num_splits: int | None = None,
) -> Tensor:
    """Triton version of ``selected_attention_reference``.

    q: (B, H, Q, D). k: (B, Hkv, S, D), v: (B, Hkv, S, Dv), all one float dtype.
    indices: (B, Hkv, K) int32/int64 slots, valid where position < lengths. lengths: (B, Hkv) int64.
    num_splits: key-list splits per (sample, KV head); None picks one from the launch size.
    Returns (B, H, Q, Dv) in q's dtype.
    """
    check_float_dtype("q", q.dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    group = check_gqa(q, k)
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[-1]
    num_sel = indices.shape[-1]
    lengths = lengths.to(device=q.device)
    block_m, block_n, block_d, block_dv = tile_sizes(group * num_q, dim, dim_v)
    grid_m = triton.cdiv(group * num_q, block_m)
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads * grid_m, num_sel, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    rows = batch * kv_heads * num_splits * group * num_q
    part_m = torch.empty(rows if num_splits > 1 else 1, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows * dim_v if num_splits > 1 else 1, dtype=torch.float32, device=q.device)
    selected_attention_kernel[(batch * kv_heads, grid_m, num_splits)](
        q, k, v, indices, lengths, out, part_m, part_l, part_acc,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *lengths.stride(), *out.stride(),
        kv_heads, group, num_q, dim, dim_v, num_sel,
        SCALE=float(scale), NUM_SPLITS=num_splits, IEEE=dot_in_fp32(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits_kernel[(batch * kv_heads, grid_m)](
            part_m, part_l, part_acc, out, *out.stride(), kv_heads, group, num_q, dim_v,
            NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_DV=block_dv,
        )  # fmt: skip
    return out
