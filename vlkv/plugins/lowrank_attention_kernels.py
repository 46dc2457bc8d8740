"""Triton decode attention over post-RoPE low-rank factors plus dense entries (AttentionPack path (b)).

One program serves the G query heads of one KV head of one sample. It first projects those queries onto
the head's slice of the key basis (``q·D_kᵀ``, a ``(G, R_k)`` tile), then streams the factor rows
``K̄`` in blocks: a score block is ``(q·D_kᵀ)·K̄ᵀ`` and the probability-weighted rows are accumulated in
the *rank space* (``p·V̄``, ``(G, R_v)``). Only then is the accumulator taken through ``D_v`` to head
width, and the dense entries (text) continue the same online softmax. K and V of the factored rows are
never formed; per row the kernel reads ``R_k + R_v`` numbers instead of ``2·D`` per KV head, and the
factors are shared by every KV head of the sample.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _online(s, m_i, l_i):
    """One online-softmax update: the new max, the rescale of what was accumulated, the block's probs."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 operands at IEEE precision, else ``b``'s (half) dtype."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def _lowrank_attention(
    q_ptr, kbar_ptr, dk_ptr, vbar_ptr, dv_ptr, rows_ptr, k_ptr, v_ptr, dlen_ptr, out_ptr,
    sqb, sqh, sqd, sab, sat, sar, sdkb, sdkr, sdkc, svbb, svbt, svbr, sdvb, sdvr, sdvc,
    srb, skb, skh, skn, skd, svb, svh, svn, svd, slb, sob, soh, sod,
    HKV, GROUP, D, RK, RV, T, S,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr,
):  # fmt: skip
    pid_bk = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bk // HKV).to(tl.int64)
    kvh = (pid_bk % HKV).to(tl.int64)
    g = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = kvh * GROUP + g
    on = g < GROUP
    dims = tl.arange(0, BLOCK_D)
    dm = dims < D
    cols = kvh * D + dims  # this KV head's columns of the concatenated-heads bases
    rk = tl.arange(0, BLOCK_RK)
    rv = tl.arange(0, BLOCK_RV)
    q = tl.load(
        q_ptr + b * sqb + heads[:, None] * sqh + dims[None, :] * sqd,
        mask=on[:, None] & dm[None, :],
        other=0.0,
    )
    dk = tl.load(
        dk_ptr + b * sdkb + rk[:, None] * sdkr + cols[None, :] * sdkc,
        mask=(rk[:, None] < RK) & dm[None, :],
        other=0.0,
    )
    # (BLOCK_M, BLOCK_RK) fp32: the queries in this head's key rank space (padded ranks are zero columns)
    qd = tl.dot(q.to(tl.float32), tl.trans(dk.to(tl.float32)), input_precision="ieee")
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc_r = tl.zeros((BLOCK_M, BLOCK_RV), tl.float32)
    n_rows = tl.minimum(tl.load(rows_ptr + b * srb).to(tl.int32), T)
    for t0 in range(0, n_rows, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < n_rows
        kbar = tl.load(
            kbar_ptr + b * sab + t[:, None] * sat + rk[None, :] * sar,
            mask=ok[:, None] & (rk[None, :] < RK),
            other=0.0,
        )
        s = _mm(qd, tl.trans(kbar), IEEE)
        s = tl.where(ok[None, :], s * SCALE, float("-inf"))
        m_i, alpha, p, l_i = _online(s, m_i, l_i)
        vbar = tl.load(
            vbar_ptr + svbb * b + t[:, None] * svbt + rv[None, :] * svbr,
            mask=ok[:, None] & (rv[None, :] < RV),
            other=0.0,
        )
        acc_r = acc_r * alpha[:, None] + _mm(p, vbar, IEEE)
    dv = tl.load(
        dv_ptr + b * sdvb + rv[:, None] * sdvr + cols[None, :] * sdvc,
        mask=(rv[:, None] < RV) & dm[None, :],
        other=0.0,
    )
    # the factored rows' share of the output, at head width: the one (G, R_v) x (R_v, D) product
    acc = tl.dot(acc_r, dv.to(tl.float32), input_precision="ieee")
    n_dense = tl.minimum(tl.load(dlen_ptr + b * slb).to(tl.int32), S)
    for n0 in range(0, n_dense, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < n_dense
        k = tl.load(
            k_ptr + b * skb + kvh * skh + n[:, None] * skn + dims[None, :] * skd,
            mask=ok[:, None] & dm[None, :],
            other=0.0,
        )
        s = _mm(q, tl.trans(k), IEEE)
        s = tl.where(ok[None, :], s * SCALE, float("-inf"))
        m_i, alpha, p, l_i = _online(s, m_i, l_i)
        v = tl.load(
            v_ptr + b * svb + kvh * svh + n[:, None] * svn + dims[None, :] * svd,
            mask=ok[:, None] & dm[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _mm(p, v, IEEE)
    # nothing visible (no rows, no dense entries) leaves l = 0 and acc = 0: zeros, as the reference's NaN-free form
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + b * sob + heads[:, None] * soh + dims[None, :] * sod, out, mask=on[:, None] & dm[None, :]
    )


@triton.jit
def lowrank_attention_kernel(
    q_ptr, kbar_ptr, dk_ptr, vbar_ptr, dv_ptr, rows_ptr, k_ptr, v_ptr, dlen_ptr, out_ptr,
    sqb, sqh, sqd, sab, sat, sar, sdkb, sdkr, sdkc, svbb, svbt, svbr, sdvb, sdvr, sdvc,
    srb, skb, skh, skn, skd, svb, svh, svn, svd, slb, sob, soh, sod,
    HKV, GROUP, D, RK, RV, T, S,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr,
):  # fmt: skip
    _lowrank_attention(
        q_ptr, kbar_ptr, dk_ptr, vbar_ptr, dv_ptr, rows_ptr, k_ptr, v_ptr, dlen_ptr, out_ptr,
        sqb, sqh, sqd, sab, sat, sar, sdkb, sdkr, sdkc, svbb, svbt, svbr, sdvb, sdvr, sdvc,
        srb, skb, skh, skn, skd, svb, svh, svn, svd, slb, sob, soh, sod,
        HKV, GROUP, D, RK, RV, T, S, SCALE, IEEE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_RK, BLOCK_RV,
    )  # fmt: skip


@triton.jit
def lowrank_attention_aot_kernel(
    q_ptr, kbar_ptr, dk_ptr, vbar_ptr, dv_ptr, rows_ptr, k_ptr, v_ptr, dlen_ptr,
    H, HKV, T, S, D, RK, RV,
    out_ptr,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr,
):  # fmt: skip
    """TensorRT AOT entry: inputs, int32 shape scalars, output (the QDP argument order).

    Tensors are contiguous: q (B, H, D), kbar (B, T, RK), dk (B, RK, HKV * D), vbar (B, T, RV),
    dv (B, RV, HKV * D), rows (B,) int64, k/v (B, HKV, S, D), dense_len (B,) int64; out (B, H, D).
    Grid: (B * HKV, cdiv(H // HKV, BLOCK_M)).
    """
    C = HKV * D
    _lowrank_attention(
        q_ptr, kbar_ptr, dk_ptr, vbar_ptr, dv_ptr, rows_ptr, k_ptr, v_ptr, dlen_ptr, out_ptr,
        H * D, D, 1, T * RK, RK, 1, RK * C, C, 1, T * RV, RV, 1, RV * C, C, 1,
        1, HKV * S * D, S * D, D, 1, HKV * S * D, S * D, D, 1, 1, H * D, D, 1,
        HKV, H // HKV, D, RK, RV, T, S, SCALE, IEEE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_RK, BLOCK_RV,
    )  # fmt: skip
