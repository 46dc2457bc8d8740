"""PyTorch launcher for ``paged_lowrank_kernels.py`` (see that module for the algorithm): the paged read of
a pool and AttentionPack's low-rank factor rows in one kernel (no dense copy of the factored entries)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors, check_factors, factored_span
from vlkv.plugins.paged_lowrank_kernels import paged_lowrank_kernel
from vlkv.plugins.paged_probs_kernels import normalise_blocks, probs_normalise_kernel
from vlkv.plugins.triton_launch import dot_in_fp32
from vlkv.plugins.triton_paged_attention import _partials, _plan, launch_args, rope_strides
from vlkv.plugins.triton_selected_attention import SplitPlan, combine_splits, default_num_splits, tile_sizes


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
    batch, heads, num_q, dim = q.shape
    group = heads // max(k_pool.shape[0], 1)
    plan = _plan(
        batch * k_pool.shape[0], group * num_q, dim, v_pool.shape[-1], table.shape[-1], num_splits, q.device
    )
    out = torch.empty(batch, heads, num_q, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    _launch(q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, None)
    combine_splits(plan, out, k_pool.shape[0], group)
    return out


def paged_lowrank_probs_triton(
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
    probs_out: Tensor | None = None,
    vis_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A statistics decode step (one query row) of :func:`paged_lowrank_triton`: ``out (B, H_q, 1, D_v)``,
    ``probs (B, H_kv, G, C)`` float32 and the held columns ``vis (B, H_kv, 1, C)`` bool (factored columns
    held), as ``triton_paged_probs.paged_probs_triton`` returns them, from the same one read (the kernel
    keeps the logits; ``paged_probs_kernels.probs_normalise_kernel`` normalises them). ``probs_out`` /
    ``vis_out``: buffers to write ``probs`` / ``vis`` into (a static step's: fixed addresses), contiguous,
    of those shapes (``vis_out`` ``(B, H_kv, 1, C)``)."""
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    if num_q != 1:
        raise ValueError(f"paged_lowrank_probs_triton takes one query row per request, got {num_q}")
    group = heads // max(kv_heads, 1)
    pairs = batch * kv_heads
    block_m, block_n, block_d, block_dv = tile_sizes(group, dim, dim_v)
    grid_m = triton.cdiv(group, block_m)
    if num_splits is None:
        num_splits = default_num_splits(pairs * grid_m, cols, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # (max, sum) per split and row even with one split (the normalise pass reads them)
    part_m, part_l, part_acc = _partials(pairs * num_splits * group, dim_v if num_splits > 1 else 0, q.device)
    plan = SplitPlan(
        (pairs, grid_m, num_splits), block_m, block_n, block_d, block_dv, part_m, part_l, part_acc
    )
    out = torch.empty(batch, heads, 1, dim_v, dtype=q.dtype, device=q.device)
    probs = _out(probs_out, (batch, kv_heads, group, cols), torch.float32, q.device, "probs_out")
    vis = _out(vis_out, (batch, kv_heads, 1, cols), torch.bool, q.device, "vis_out")
    if pairs == 0 or cols == 0:
        return out.zero_(), probs, vis.zero_()
    _launch(q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, probs)
    if num_splits > 1:
        combine_splits(plan, out, kv_heads, group)
    # the normalise pass marks held columns by slot >= 0: a factored column is held whatever its slot
    held = torch.where(factors.frow.to(q.device) >= 0, 0, table.to(q.device))
    block_g, block_c = normalise_blocks(group)
    probs_normalise_kernel[(pairs, triton.cdiv(cols, block_c))](
        probs, held, lengths.to(q.device), vis, part_m, part_l, part_acc, out,
        *held.stride(), *lengths.stride(), out.stride(0), out.stride(1), out.stride(3),
        kv_heads, group, dim_v, cols,
        NUM_SPLITS=num_splits, WRITE_VIS=True, COMBINE=False,
        BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_M=block_m, BLOCK_DV=block_dv,
    )  # fmt: skip
    return out, probs, vis


def _out(buf: Tensor | None, shape: tuple, dtype: torch.dtype, device, name: str) -> Tensor:
    """``buf`` checked against ``shape`` and ``dtype`` (contiguous), or a new tensor of them."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous {dtype} {shape}, got {buf.dtype} {tuple(buf.shape)}")
    return buf


def _launch(q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, probs) -> None:
    """One ``paged_lowrank_kernel`` launch on ``plan`` into ``out`` (and the logits into ``probs`` when
    given: ``LOGITS``); arguments as :func:`paged_lowrank_triton` takes them."""
    group, rope, rot4, rot, cos, sin = launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec)
    check_factors(factors, k_pool, v_pool, table)
    kv_heads, num_q, dim = k_pool.shape[0], q.shape[2], q.shape[3]
    dim_v, cols = v_pool.shape[-1], table.shape[-1]
    dev = q.device
    table, lengths = table.to(dev), lengths.to(dev)
    f = PagedFactors(*(t.to(dev) for t in (factors.frow, factors.kbar, factors.dk, factors.vbar, factors.dv,
                                           factors.rank_k, factors.rank_v)))  # fmt: skip
    if q.shape[0] * kv_heads == 0:
        out.zero_()
        return
    rank_k, rank_v = f.ranks
    span = factored_span(f, lengths)  # (B, H_kv, 2): a program outside it loads no basis
    paged_lowrank_kernel[plan.grid](
        q, k_pool, v_pool, table, lengths, out, out if probs is None else probs, plan.part_m, plan.part_l,
        plan.part_acc, rot, cos, sin, table if sec is None else sec,
        f.frow, f.kbar, f.dk, f.vbar, f.dv, f.rank_k, f.rank_v, span,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *lengths.stride(), *out.stride(),
        *rope_strides(rope, rot, rot4, cos), *f.frow.stride(), *f.kbar.stride(), *f.dk.stride(),
        *f.vbar.stride(), *f.dv.stride(), span.stride(0), span.stride(1), kv_heads, group, num_q, dim, dim_v, cols,
        cos.shape[-1] if rope else 0, cos.shape[0] if rope else 1, rank_k, rank_v,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, MROPE=sec is not None,
        LOGITS=probs is not None, BLOCK_R=rank_block(f), **plan.constexprs,
    )  # fmt: skip
