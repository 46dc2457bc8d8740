"""PyTorch launcher for ``paged_probs_kernels.py`` (see that module for the algorithm): a statistics decode
step's output and probabilities from one in-place read of K and V through the slot tables."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_probs_kernels import normalise_blocks, paged_probs_kernel, probs_normalise_kernel
from vlkv.plugins.triton_launch import dot_in_fp32
from vlkv.plugins.triton_paged_attention import _partials, launch_args, rope_strides
from vlkv.plugins.triton_selected_attention import SplitPlan, combine_splits, default_num_splits, tile_sizes


def paged_probs_triton(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    num_splits: int | None = None,
    with_vis: bool = True,
    probs_out: Tensor | None = None,
    vis_out: Tensor | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One decode row per request: ``q (B, H_q, 1, D)``, pools ``(H_kv, S, D)`` / ``(H_kv, S, D_v)`` (one
    float dtype), ``table (B, H_kv, C)``, ``lengths (B, H_kv)`` as ``paged_attention_reference`` takes them.

    Returns ``out (B, H_q, 1, D_v)`` in q's dtype (the paged read's output), ``probs (B, H_kv, G, C)``
    float32 (the softmax of ``q·k · scale`` over each row's held columns, 0 at holes, past its length
    and in a row holding nothing: ``paged_probs.paged_decode_probs``' definition) and, with ``with_vis``,
    the held columns ``(B, H_kv, 1, C)`` bool (else None). num_splits: column splits per (request, KV
    head); None picks one from the launch size (about 256 programs). rot, cos, sin, sec: pre-RoPE keys
    rotated on read, as ``triton_paged_attention.paged_attention_triton`` takes them. probs_out: a
    contiguous ``(B, H_kv, G, C)`` float32 tensor the probabilities are written into (and returned), e.g.
    a CUDA graph's fixed buffer; None allocates one.
    vis_out: likewise a contiguous ``(B, H_kv, 1, C)`` bool tensor for the held columns (``with_vis``).
    """
    group, rope, rot4, rot, cos, sin = launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec)
    batch, heads, num_q, dim = q.shape
    if num_q != 1:
        raise ValueError(f"paged_probs_triton takes one query row per request, got {num_q}")
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    table, lengths = table.to(q.device), lengths.to(q.device)
    pairs = batch * kv_heads
    block_m, block_n, block_d, block_dv = tile_sizes(group, dim, dim_v)
    grid_m = triton.cdiv(group, block_m)
    if num_splits is None:
        num_splits = default_num_splits(pairs * grid_m, cols, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # (max, sum) per split and row even with one split (the normalise pass reads them); the accumulator
    # only with several (one split writes the output itself)
    part_m, part_l, part_acc = _partials(pairs * num_splits * group, dim_v if num_splits > 1 else 0, q.device)
    plan = SplitPlan(
        (pairs, grid_m, num_splits), block_m, block_n, block_d, block_dv, part_m, part_l, part_acc
    )
    out = torch.empty(batch, heads, 1, dim_v, dtype=q.dtype, device=q.device)
    probs = probs_out
    if probs is None:
        probs = torch.empty(batch, kv_heads, group, cols, dtype=torch.float32, device=q.device)
    elif probs.shape != (batch, kv_heads, group, cols) or probs.dtype != torch.float32:
        raise ValueError(
            f"probs_out must be ({batch}, {kv_heads}, {group}, {cols}) float32, got "
            f"{tuple(probs.shape)} {probs.dtype}"
        )
    elif not probs.is_contiguous():  # the kernels index it densely (no strides passed)
        raise ValueError("probs_out must be contiguous")
    vis = None
    if with_vis and vis_out is None:
        vis = torch.empty(batch, kv_heads, 1, cols, dtype=torch.bool, device=q.device)
    elif with_vis:
        if vis_out.shape != (batch, kv_heads, 1, cols) or vis_out.dtype != torch.bool:
            raise ValueError(
                f"vis_out must be ({batch}, {kv_heads}, 1, {cols}) bool, got "
                f"{tuple(vis_out.shape)} {vis_out.dtype}"
            )
        if not vis_out.is_contiguous():  # the normalise pass indexes it densely
            raise ValueError("vis_out must be contiguous")
        vis = vis_out
    if pairs == 0 or cols == 0:
        return out.zero_(), probs, None if vis is None else vis.zero_()
    paged_probs_kernel[plan.grid](
        q, k_pool, v_pool, table, lengths, out, probs, part_m, part_l, part_acc, rot, cos, sin,
        table if sec is None else sec,
        q.stride(0), q.stride(1), q.stride(3), *k_pool.stride(), *v_pool.stride(), *table.stride(),
        *lengths.stride(), out.stride(0), out.stride(1), out.stride(3), *rope_strides(rope, rot, rot4, cos),
        kv_heads, group, dim, dim_v, cols, cos.shape[-1] if rope else 0, cos.shape[0] if rope else 1,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, MROPE=sec is not None,
        **plan.constexprs,
    )  # fmt: skip
    # the splits' outputs merged by the normalise pass's first program per pair where one row tile holds
    # the group (G <= 64: every common model), else by their own launch
    combine = num_splits > 1 and grid_m == 1
    if not combine:
        combine_splits(plan, out, kv_heads, group)
    block_g, block_c = normalise_blocks(group)
    probs_normalise_kernel[(pairs, triton.cdiv(cols, block_c))](
        probs, table, lengths, probs if vis is None else vis, part_m, part_l, part_acc, out,
        *table.stride(), *lengths.stride(), out.stride(0), out.stride(1), out.stride(3),
        kv_heads, group, dim_v, cols,
        NUM_SPLITS=num_splits, WRITE_VIS=vis is not None, COMBINE=combine,
        BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_M=block_m, BLOCK_DV=block_dv,
    )  # fmt: skip
    return out, probs, vis
