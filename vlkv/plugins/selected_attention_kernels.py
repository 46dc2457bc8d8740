"""Triton attention over selected K/V rows (decode after selection), flash-decoding style.

K/V rows are read in place by slot index; no gathered copy is made. One program serves all G query heads
of a KV head, so each selected K/V row is loaded once per group, not once per query head. With
``num_splits > 1`` the selected list is split across programs (flash-decoding) and a second launch merges
the partial (max, sum, accumulator) triples; with one split a single launch writes the output, which is
the form the TensorRT AOT plugin bakes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _selected_attention(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sib, sih, sik, slb, slh, sob, soh, som, sod,
    HKV, GROUP, Q, D, DV, K_SEL,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    GQ = GROUP * Q
    pid_bk = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bk // HKV).to(tl.int64)
    kvh = (pid_bk % HKV).to(tl.int64)
    # Row r of this tile is query row r % Q of query head kvh * GROUP + r // Q.
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = kvh * GROUP + r // Q
    qi = r % Q
    dims = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b * sqb + heads[:, None] * sqh + qi[:, None] * sqm + dims[None, :] * sqd,
        mask=(r[:, None] < GQ) & (dims[None, :] < D),
        other=0.0,
    )
    length = tl.minimum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), K_SEL)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, length)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        sel = n0 + tl.arange(0, BLOCK_N)
        ok = sel < stop
        slot = tl.load(idx_ptr + b * sib + kvh * sih + sel * sik, mask=ok, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + b * skb + kvh * skh + slot[:, None] * skn + dims[None, :] * skd,
            mask=ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_ptr + b * svb + kvh * svh + slot[:, None] * svn + dv[None, :] * svd,
            mask=ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:  # noqa: SIM108 - a constexpr branch reads clearer than a ternary in a kernel
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        # An empty selection leaves l = 0 and acc = 0: the output is zeros, as the reference defines.
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + b * sob + heads[:, None] * soh + qi[:, None] * som + dv[None, :] * sod,
            out,
            mask=(r[:, None] < GQ) & (dv[None, :] < DV),
        )
    else:
        part = (pid_bk.to(tl.int64) * NUM_SPLITS + split) * GQ + r
        tl.store(part_m_ptr + part, m_i, mask=r < GQ)
        tl.store(part_l_ptr + part, l_i, mask=r < GQ)
        tl.store(
            part_acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=(r[:, None] < GQ) & (dv[None, :] < DV)
        )


@triton.jit
def selected_attention_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sib, sih, sik, slb, slh, sob, soh, som, sod,
    HKV, GROUP, Q, D, DV, K_SEL,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    _selected_attention(
        q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sib, sih, sik, slb, slh, sob, soh, som, sod, HKV, GROUP, Q, D, DV, K_SEL,
        SCALE, NUM_SPLITS, IEEE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip


@triton.jit
def selected_attention_aot_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr,
    H, HKV, Q, S, D, K_SEL,
    out_ptr,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """TensorRT AOT entry: inputs, int32 shape scalars, output (the QDP argument order).

    Tensors are contiguous: q (B, H, Q, D), k/v (B, HKV, S, D), idx (B, HKV, K_SEL) int64,
    lengths (B, HKV) int64; out (B, H, Q, D). Grid: (B * HKV, cdiv((H // HKV) * Q, BLOCK_M)), one split.
    """
    _selected_attention(
        q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, out_ptr, out_ptr, out_ptr,
        H * Q * D, Q * D, D, 1, HKV * S * D, S * D, D, 1, HKV * S * D, S * D, D, 1,
        HKV * K_SEL, K_SEL, 1, HKV, 1, H * Q * D, Q * D, D, 1, HKV, H // HKV, Q, D, D, K_SEL,
        SCALE, 1, IEEE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D,
    )  # fmt: skip


@triton.jit
def combine_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    sob, soh, som, sod, HKV, GROUP, Q, DV,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    GQ = GROUP * Q
    pid_bk = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bk // HKV).to(tl.int64)
    kvh = (pid_bk % HKV).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    m_all = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        part = (pid_bk.to(tl.int64) * NUM_SPLITS + split) * GQ + r
        m_all = tl.maximum(m_all, tl.load(part_m_ptr + part, mask=r < GQ, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for split in range(NUM_SPLITS):
        part = (pid_bk.to(tl.int64) * NUM_SPLITS + split) * GQ + r
        w = tl.exp(tl.load(part_m_ptr + part, mask=r < GQ, other=float("-inf")) - m_safe)
        l_all += w * tl.load(part_l_ptr + part, mask=r < GQ, other=0.0)
        a = tl.load(
            part_acc_ptr + part[:, None] * DV + dv[None, :], mask=(r[:, None] < GQ) & (dv[None, :] < DV)
        )
        acc += w[:, None] * a
    out = acc / tl.maximum(l_all, 1e-30)[:, None]
    heads = kvh * GROUP + r // Q
    qi = r % Q
    tl.store(
        out_ptr + b * sob + heads[:, None] * soh + qi[:, None] * som + dv[None, :] * sod,
        out,
        mask=(r[:, None] < GQ) & (dv[None, :] < DV),
    )
