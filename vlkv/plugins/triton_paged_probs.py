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
    kv_heads, dim, dim_v, cols = k_pool.shape[0], q.shape[3], v_pool.shape[-1], table.shape[-1]
    table, lengths = table.to(q.device), lengths.to(q.device)
    plan, out, probs, vis = stats_buffers(q, kv_heads, dim_v, cols, num_splits, with_vis, probs_out, vis_out)
    if plan is None:  # nothing to read
        return out, probs, vis
    part_m, part_l, part_acc = plan.part_m, plan.part_l, plan.part_acc
    paged_probs_kernel[plan.grid](
        q, k_pool, v_pool, table, lengths, out, probs, part_m, part_l, part_acc, rot, cos, sin,
        table if sec is None else sec,
        q.stride(0), q.stride(1), q.stride(3), *k_pool.stride(), *v_pool.stride(), *table.stride(),
        *lengths.stride(), out.stride(0), out.stride(1), out.stride(3), *rope_strides(rope, rot, rot4, cos),
        kv_heads, group, dim, dim_v, cols, cos.shape[-1] if rope else 0, cos.shape[0] if rope else 1,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), HAS_ROPE=rope, MROPE=sec is not None,
        **plan.constexprs,
    )  # fmt: skip
    normalise_probs(plan, probs, table, lengths, vis, out, kv_heads)
    return out, probs, vis


def stats_buffers(
    q: Tensor,
    kv_heads: int,
    dim_v: int,
    cols: int,
    num_splits: int | None,
    with_vis: bool,
    probs_out: Tensor | None,
    vis_out: Tensor | None,
) -> tuple[SplitPlan | None, Tensor, Tensor, Tensor | None]:
    """A statistics read's launch plan and buffers (shared by ``paged_probs_triton`` and
    ``triton_paged_lowrank``): ``(plan, out (B, H_q, 1, D_v), probs (B, H_kv, G, C) float32, vis (B, H_kv,
    1, C) bool or None)``, ``probs``/``vis`` the given buffers once checked (contiguous, of those shapes
    and dtypes) or new ones. The plan keeps (max, sum) per split and row even with one split (the
    normalise pass reads them), the accumulator only with several. ``plan`` None: nothing to read (no
    pair or no column), ``out`` and ``vis`` zeroed."""
    batch, heads, num_q, dim = q.shape
    if num_q != 1:
        raise ValueError(f"a statistics read takes one query row per request, got {num_q}")
    group = heads // max(kv_heads, 1)
    pairs = batch * kv_heads
    block_m, block_n, block_d, block_dv = tile_sizes(group, dim, dim_v)
    grid_m = triton.cdiv(group, block_m)
    if num_splits is None:
        num_splits = default_num_splits(pairs * grid_m, cols, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    part_m, part_l, part_acc = _partials(pairs * num_splits * group, dim_v if num_splits > 1 else 0, q.device)
    plan = SplitPlan(
        (pairs, grid_m, num_splits), block_m, block_n, block_d, block_dv, part_m, part_l, part_acc
    )
    out = torch.empty(batch, heads, 1, dim_v, dtype=q.dtype, device=q.device)
    probs = _checked(probs_out, (batch, kv_heads, group, cols), torch.float32, "probs_out", q.device)
    vis = _checked(vis_out, (batch, kv_heads, 1, cols), torch.bool, "vis_out", q.device) if with_vis else None
    if pairs == 0 or cols == 0:
        return None, out.zero_(), probs, None if vis is None else vis.zero_()
    return plan, out, probs, vis


def _checked(buf: Tensor | None, shape: tuple, dtype: torch.dtype, name: str, device) -> Tensor:
    """``buf`` checked against ``shape`` and ``dtype`` and contiguous (the kernels index it densely, no
    strides passed), or a new tensor of them."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != shape or buf.dtype != dtype:
        raise ValueError(f"{name} must be {shape} {dtype}, got {tuple(buf.shape)} {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return buf


def normalise_probs(
    plan: SplitPlan,
    probs: Tensor,
    held: Tensor,
    lengths: Tensor,
    vis: Tensor | None,
    out: Tensor,
    kv_heads: int,
) -> None:
    """The normalise pass over a statistics read's logits in ``probs`` (``held (B, H_kv, C)``: a column
    is held where ``>= 0``), writing ``vis`` where given. The splits' outputs are merged by its first
    program per pair where one row tile holds the group (``G <= 64``: every common model), else by their
    own launch first."""
    pairs, grid_m, num_splits = plan.grid
    group = probs.shape[2]
    cols = probs.shape[3]
    combine = num_splits > 1 and grid_m == 1
    if not combine:
        combine_splits(plan, out, kv_heads, group)
    block_g, block_c = normalise_blocks(group)
    probs_normalise_kernel[(pairs, triton.cdiv(cols, block_c))](
        probs, held, lengths, probs if vis is None else vis, plan.part_m, plan.part_l, plan.part_acc, out,
        *held.stride(), *lengths.stride(), out.stride(0), out.stride(1), out.stride(3),
        kv_heads, group, out.shape[3], cols,
        NUM_SPLITS=num_splits, WRITE_VIS=vis is not None, COMBINE=combine,
        BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_M=plan.block_m, BLOCK_DV=plan.block_dv,
    )  # fmt: skip
