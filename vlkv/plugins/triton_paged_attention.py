"""PyTorch launcher for ``paged_attention_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins.paged_attention_kernels import paged_attention_kernel
from vlkv.plugins.paged_reference import check_paged_args
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32
from vlkv.plugins.triton_selected_attention import combine_splits, plan_splits


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
    plan = plan_splits(batch * kv_heads, group * num_q, dim, dim_v, cols, num_splits, q.device)
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    if batch * kv_heads == 0:
        return out.zero_()
    paged_attention_kernel[plan.grid](
        q, k_pool, v_pool, table, lengths, out, plan.part_m, plan.part_l, plan.part_acc, rot, cos, sin,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *lengths.stride(), *out.stride(),
        *(rot.stride() if rope else (0, 0, 0)), *(cos.stride() if rope else (0, 0)),
        kv_heads, group, num_q, dim, dim_v, cols, cos.shape[-1] if rope else 0,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, **plan.constexprs,
    )  # fmt: skip
    combine_splits(plan, out, kv_heads, group)
    return out
