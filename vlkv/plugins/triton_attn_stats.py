"""PyTorch launcher for the kernels in ``attn_stats_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.attn_stats_kernels import (
    attn_stats_fused_kernel,
    col_stats_kernel,
    row_stats_kernel,
    sum_counts_kernel,
)
from vlkv.plugins.reference import AttnStats, check_gqa, resolve_lengths
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32


def block_sizes(head_dim: int, num_keys: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) for the stats kernels; tl.dot needs every tile side >= 16."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32
    return 16 if num_keys < 64 else 32, block_n, block_d


def _prepare(q: Tensor, k: Tensor, query_rows, key_lengths, q_offset):
    """Validate and fill defaults; returns (group, rows (B, Q) int8, key_lengths (B,), q_offset (B,))."""
    group = check_gqa(q, k)
    batch, _, num_q, _ = q.shape
    klen, qoff = resolve_lengths(batch, num_q, k.shape[2], key_lengths, q_offset, q.device)
    if query_rows is None:
        rows = torch.ones(batch, num_q, dtype=torch.int8, device=q.device)
    else:
        rows = query_rows.to(device=q.device, dtype=torch.int8)
    return group, rows, klen.contiguous(), qoff.contiguous()


def compact_rows(q: Tensor, rows: Tensor, q_offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cut ``q`` down to each sample's span of requested rows (a SnapKV / VL-Cache window).

    q: (B, H, Q, D). rows: (B, Q) int8. q_offset: (B,) int64. Returns ``q (B, H, W, D)``, ``rows (B, W)``
    and ``q_offset (B,)`` shifted by each span's first row, so causal visibility is unchanged; W is the
    widest span. The kernels launch over query blocks, so a 64-row window of an 8k prompt then costs
    64 rows' blocks instead of 8k. Returned unchanged when the spans cover more than half of Q.
    """
    b, _, num_q, _ = q.shape
    if num_q <= 1:  # nothing to cut (a decode row): no read back, a host sync per layer on a GPU
        return q, rows, q_offset
    want = rows != 0
    if not bool(want.any()):
        return q, rows, q_offset
    ar = torch.arange(num_q, device=q.device)
    first = torch.where(want, ar, num_q).amin(1)
    last = torch.where(want, ar, -1).amax(1)
    first = torch.where(last >= 0, first, torch.zeros_like(first))
    width = int((last - first + 1).clamp(min=0).max())
    if 2 * width > num_q:
        return q, rows, q_offset
    idx = first[:, None] + torch.arange(width, device=q.device)[None, :]  # (B, W)
    inside = idx < num_q
    idx = idx.clamp(max=num_q - 1)
    q_c = q.gather(2, idx[:, None, :, None].expand(b, q.shape[1], width, q.shape[3])).contiguous()
    rows_c = (rows.gather(1, idx) * inside).to(torch.int8).contiguous()
    return q_c, rows_c, (q_offset + first).contiguous()


def attn_stats_triton(
    q: Tensor,
    k: Tensor,
    scale: float,
    query_rows: Tensor | None = None,
    causal: bool = True,
    threshold: float | None = None,
    key_lengths: Tensor | None = None,
    q_offset: Tensor | None = None,
    fused: bool = False,
) -> AttnStats:
    """Triton version of ``attn_stats_reference`` (same arguments, no chunking needed).

    q: (B, H, Q, D) fp16/bf16/fp32. k: (B, Hkv, S, D) same dtype. query_rows: (B, Q) bool.
    key_lengths, q_offset: (B,) int64. fused=True runs the single-launch kernel used by the TRT plugin.
    """
    check_float_dtype("q", q.dtype)
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    group, rows, klen, qoff = _prepare(q, k, query_rows, key_lengths, q_offset)
    if query_rows is not None:
        q, rows, qoff = compact_rows(q, rows, qoff)
    batch, heads, num_q, dim = q.shape
    num_k = k.shape[2]
    block_m, block_n, block_d = block_sizes(dim, num_k)
    dev = q.device
    colsum = torch.empty(batch, heads, num_k, dtype=torch.float32, device=dev)
    common = dict(
        SCALE=float(scale),
        CAUSAL=bool(causal),
        IEEE=dot_in_fp32(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    strides = (*q.stride(), *k.stride(), *rows.stride())
    if fused:
        below = torch.empty(batch, heads, dtype=torch.int64, device=dev)
        visible = torch.empty(batch, heads, dtype=torch.int64, device=dev)
        attn_stats_fused_kernel[(batch * heads,)](
            q, k, rows, klen, qoff, colsum, below, visible, *strides, heads, group, num_q, num_k, dim,
            THRESHOLD=float(threshold or 0.0), HAS_THRESHOLD=threshold is not None, **common,
        )  # fmt: skip
        return AttnStats(colsum, below if threshold is not None else None, visible)

    row_max = torch.empty(batch, heads, num_q, dtype=torch.float32, device=dev)
    row_sum = torch.empty_like(row_max)
    row_stats_kernel[(triton.cdiv(max(num_q, 1), block_m), batch * heads)](
        q, k, rows, klen, qoff, row_max, row_sum, *strides, heads, group, num_q, num_k, dim, **common
    )
    num_nb = triton.cdiv(max(num_k, 1), block_n)
    part_below = torch.empty(batch * heads, num_nb, dtype=torch.int32, device=dev)
    part_vis = torch.empty_like(part_below)
    col_stats_kernel[(num_nb, batch * heads)](
        q, k, rows, klen, qoff, row_max, row_sum, colsum, part_below, part_vis,
        *strides, heads, group, num_q, num_k, dim, num_nb,
        THRESHOLD=float(threshold or 0.0), HAS_THRESHOLD=threshold is not None, **common,
    )  # fmt: skip
    counts = torch.empty(2, batch * heads, dtype=torch.int64, device=dev)
    for i, part in enumerate((part_vis, part_below)):
        sum_counts_kernel[(batch * heads,)](part, counts[i], num_nb, BLOCK=128)
    below = counts[1].view(batch, heads) if threshold is not None else None
    return AttnStats(colsum, below, counts[0].view(batch, heads))
