"""PyTorch launcher for ``paged_lowrank_kernels.py`` (see that module for the algorithm): the paged read of
a pool and AttentionPack's low-rank factor rows in one kernel (no dense copy of the factored entries)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors, check_factors
from vlkv.plugins.paged_lowrank_kernels import paged_lowrank_kernel
from vlkv.plugins.triton_launch import dot_in_fp32
from vlkv.plugins.triton_paged_attention import _plan, launch_args, rope_strides
from vlkv.plugins.triton_selected_attention import combine_splits


def rank_block(factors: PagedFactors) -> int:
    """``BLOCK_R``: the padded ranks' larger, a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, triton.next_power_of_2(max(factors.ranks)))


def paged_lowrank_triton(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    factors: PagedFactors,
    num_splits: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
) -> Tensor:
    """Triton version of ``paged_lowrank.paged_lowrank_reference``: same arguments and result (the factors
    in the pool's dtype), plus ``num_splits`` and ``sec`` as ``triton_paged_attention.paged_attention_triton``
    takes them (the M-RoPE table form: ``rot (B, H_kv, C, P)`` positions)."""
    group, rope, rot4, rot, cos, sin = launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec)
    check_factors(factors, k_pool, v_pool, table)
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    dev = q.device
    table, lengths = table.to(dev), lengths.to(dev)
    f = PagedFactors(*(t.to(dev) for t in (factors.frow, factors.kbar, factors.dk, factors.vbar, factors.dv,
                                           factors.rank_k, factors.rank_v)))  # fmt: skip
    plan = _plan(batch * kv_heads, group * num_q, dim, dim_v, cols, num_splits, dev)
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=dev)
    if batch * kv_heads == 0:
        return out.zero_()
    rank_k, rank_v = f.ranks
    paged_lowrank_kernel[plan.grid](
        q, k_pool, v_pool, table, lengths, out, plan.part_m, plan.part_l, plan.part_acc, rot, cos, sin,
        table if sec is None else sec, f.frow, f.kbar, f.dk, f.vbar, f.dv, f.rank_k, f.rank_v,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *lengths.stride(), *out.stride(),
        *rope_strides(rope, rot, rot4, cos), *f.frow.stride(), *f.kbar.stride(), *f.dk.stride(),
        *f.vbar.stride(), *f.dv.stride(), kv_heads, group, num_q, dim, dim_v, cols,
        cos.shape[-1] if rope else 0, cos.shape[0] if rope else 1, rank_k, rank_v,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, MROPE=sec is not None,
        BLOCK_R=rank_block(f), **plan.constexprs,
    )  # fmt: skip
    combine_splits(plan, out, kv_heads, group)
    return out
