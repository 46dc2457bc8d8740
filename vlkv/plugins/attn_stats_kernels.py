"""Triton attention statistics (VL-Cache appendix A.3): column sums and below-threshold counts.

Q·Kᵀ, the mask and the probabilities never reach memory. Three launches, as in A.3:
1. ``row_stats_kernel`` partitions over query rows and keeps the online-softmax row max and row sum;
2. ``col_stats_kernel`` partitions over keys, recomputes the probabilities from (max, sum) and reduces
   them over query rows into column sums plus per-block counts (below threshold, visible);
3. ``sum_counts_kernel`` adds the per-block counts.
``attn_stats_fused_kernel`` does the same work in one launch with one program per (sample, head); a
TensorRT AOT plugin can bake only one kernel, so the plugin uses it (see ``ptx.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_stats_kernel(
    q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, m_ptr, l_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, srb, srm,
    H, GROUP, Q, S, D,
    SCALE: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv_base = b * skb + (h // GROUP).to(tl.int64) * skh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    klen = tl.load(klen_ptr + b).to(tl.int32)
    qoff = tl.load(qoff_ptr + b).to(tl.int32)
    row_ok = (rows < Q) & (tl.load(rows_ptr + b * srb + rows * srm, mask=rows < Q, other=0) != 0)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=(rows[:, None] < Q) & (dims[None, :] < D),
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    n_end = klen
    if CAUSAL:
        n_end = tl.minimum(klen, qoff + pid_m * BLOCK_M + BLOCK_M)
    for n0 in range(0, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_ptr + kv_base + cols[:, None] * skn + dims[None, :] * skd,
            mask=(cols[:, None] < S) & (dims[None, :] < D),
            other=0.0,
        )
        if IEEE:  # fp32 would silently drop to tf32 on tensor cores
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * SCALE
        else:
            s = tl.dot(q, tl.trans(k)) * SCALE
        vis = row_ok[:, None] & (cols[None, :] < klen)
        if CAUSAL:
            vis = vis & (cols[None, :] <= qoff + rows[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; shift by 0 so exp() gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    out = pid_bh.to(tl.int64) * Q + rows
    tl.store(m_ptr + out, tl.where(m_i == float("-inf"), 0.0, m_i), mask=rows < Q)
    tl.store(l_ptr + out, l_i, mask=rows < Q)


@triton.jit
def col_stats_kernel(
    q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, m_ptr, l_ptr, colsum_ptr, below_ptr, vis_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, srb, srm,
    H, GROUP, Q, S, D, NUM_NB,
    SCALE: tl.constexpr, THRESHOLD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv_base = b * skb + (h // GROUP).to(tl.int64) * skh
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    klen = tl.load(klen_ptr + b).to(tl.int32)
    qoff = tl.load(qoff_ptr + b).to(tl.int32)
    # This program's key tile stays in registers while the query tiles stream past it.
    k = tl.load(
        k_ptr + kv_base + cols[:, None] * skn + dims[None, :] * skd,
        mask=(cols[:, None] < S) & (dims[None, :] < D),
        other=0.0,
    )
    acc = tl.zeros((BLOCK_N,), tl.float32)
    n_below = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    n_vis = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    m_lo = 0
    if CAUSAL:
        # Rows before (first key - q_offset) cannot see this key block.
        m_lo = (tl.maximum(pid_n * BLOCK_N - qoff, 0) // BLOCK_M) * BLOCK_M
    for m0 in range(m_lo, Q, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = (rows < Q) & (tl.load(rows_ptr + b * srb + rows * srm, mask=rows < Q, other=0) != 0)
        q = tl.load(
            q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
            mask=(rows[:, None] < Q) & (dims[None, :] < D),
            other=0.0,
        )
        stat = pid_bh.to(tl.int64) * Q + rows
        m = tl.load(m_ptr + stat, mask=rows < Q, other=0.0)
        inv_l = 1.0 / tl.maximum(tl.load(l_ptr + stat, mask=rows < Q, other=1.0), 1e-30)
        if IEEE:  # fp32 would silently drop to tf32 on tensor cores
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * SCALE
        else:
            s = tl.dot(q, tl.trans(k)) * SCALE
        vis = row_ok[:, None] & (cols[None, :] < klen)
        if CAUSAL:
            vis = vis & (cols[None, :] <= qoff + rows[:, None])
        p = tl.where(vis, tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
        acc += tl.sum(p, 0)
        n_vis += vis.to(tl.int32)
        if HAS_THRESHOLD:
            # The row max of the probabilities is exp(0) / l = 1 / l.
            n_below += (vis & (p < THRESHOLD * inv_l[:, None])).to(tl.int32)
    tl.store(colsum_ptr + pid_bh.to(tl.int64) * S + cols, acc, mask=cols < S)
    part = pid_bh.to(tl.int64) * NUM_NB + pid_n
    tl.store(vis_ptr + part, tl.sum(tl.sum(n_vis, 1), 0))
    tl.store(below_ptr + part, tl.sum(tl.sum(n_below, 1), 0))


@triton.jit
def sum_counts_kernel(part_ptr, out_ptr, NUM_NB, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    total = tl.zeros((BLOCK,), tl.int64)
    for i0 in range(0, NUM_NB, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        total += tl.load(part_ptr + pid * NUM_NB + idx, mask=idx < NUM_NB, other=0).to(tl.int64)
    tl.store(out_ptr + pid, tl.sum(total, 0))


@triton.jit
def _attn_stats_fused(
    q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, colsum_ptr, below_ptr, vis_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, srb, srm,
    H, GROUP, Q, S, D,
    SCALE: tl.constexpr, THRESHOLD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (sample, head): for each query tile, a row pass then a column pass.

    The program owns its colsum row, so it accumulates there without atomics; the barriers make each
    tile's stores visible to the threads that read them back for the next tile.
    """
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv_base = b * skb + (h // GROUP).to(tl.int64) * skh
    out_row = colsum_ptr + pid_bh.to(tl.int64) * S
    dims = tl.arange(0, BLOCK_D)
    klen = tl.load(klen_ptr + b).to(tl.int32)
    qoff = tl.load(qoff_ptr + b).to(tl.int32)
    for n0 in range(0, S, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_row + cols, tl.zeros((BLOCK_N,), tl.float32), mask=cols < S)
    tl.debug_barrier()
    n_below = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    n_vis = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for m0 in range(0, Q, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = (rows < Q) & (tl.load(rows_ptr + b * srb + rows * srm, mask=rows < Q, other=0) != 0)
        q = tl.load(
            q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
            mask=(rows[:, None] < Q) & (dims[None, :] < D),
            other=0.0,
        )
        n_end = klen
        if CAUSAL:
            n_end = tl.minimum(klen, qoff + m0 + BLOCK_M)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(
                k_ptr + kv_base + cols[:, None] * skn + dims[None, :] * skd,
                mask=(cols[:, None] < S) & (dims[None, :] < D),
                other=0.0,
            )
            if IEEE:  # fp32 would silently drop to tf32 on tensor cores
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * SCALE
            else:
                s = tl.dot(q, tl.trans(k)) * SCALE
            vis = row_ok[:, None] & (cols[None, :] < klen)
            if CAUSAL:
                vis = vis & (cols[None, :] <= qoff + rows[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        m = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = 1.0 / tl.maximum(l_i, 1e-30)
        for n0 in range(0, n_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(
                k_ptr + kv_base + cols[:, None] * skn + dims[None, :] * skd,
                mask=(cols[:, None] < S) & (dims[None, :] < D),
                other=0.0,
            )
            if IEEE:  # fp32 would silently drop to tf32 on tensor cores
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * SCALE
            else:
                s = tl.dot(q, tl.trans(k)) * SCALE
            vis = row_ok[:, None] & (cols[None, :] < klen)
            if CAUSAL:
                vis = vis & (cols[None, :] <= qoff + rows[:, None])
            p = tl.where(vis, tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
            prev = tl.load(out_row + cols, mask=cols < S, other=0.0)
            tl.store(out_row + cols, prev + tl.sum(p, 0), mask=cols < S)
            n_vis += vis.to(tl.int32)
            if HAS_THRESHOLD:
                n_below += (vis & (p < THRESHOLD * inv_l[:, None])).to(tl.int32)
        tl.debug_barrier()
    tl.store(vis_ptr + pid_bh, tl.sum(tl.sum(n_vis, 1), 0).to(tl.int64))
    tl.store(below_ptr + pid_bh, tl.sum(tl.sum(n_below, 1), 0).to(tl.int64))


@triton.jit
def attn_stats_fused_kernel(
    q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, colsum_ptr, below_ptr, vis_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, srb, srm,
    H, GROUP, Q, S, D,
    SCALE: tl.constexpr, THRESHOLD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _attn_stats_fused(
        q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, colsum_ptr, below_ptr, vis_ptr,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, srb, srm, H, GROUP, Q, S, D,
        SCALE, THRESHOLD, CAUSAL, HAS_THRESHOLD, IEEE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def attn_stats_aot_kernel(
    q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr,
    H, HKV, Q, S, D,
    colsum_ptr, below_ptr, vis_ptr,
    SCALE: tl.constexpr, THRESHOLD: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """TensorRT AOT entry: inputs, int32 shape scalars, outputs (the QDP argument order).

    Tensors are contiguous: q (B, H, Q, D), k (B, HKV, S, D), rows (B, Q) int64, klen/qoff (B,) int64;
    colsum (B, H, S) float32, below/visible (B, H) int64. Grid: (B * H,).
    """
    _attn_stats_fused(
        q_ptr, k_ptr, rows_ptr, klen_ptr, qoff_ptr, colsum_ptr, below_ptr, vis_ptr,
        H * Q * D, Q * D, D, 1, HKV * S * D, S * D, D, 1, Q, 1, H, H // HKV, Q, S, D,
        SCALE, THRESHOLD, CAUSAL, HAS_THRESHOLD, IEEE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
