"""What the flash-decoding kernels (``selected_attention_kernels``, ``paged_attention_kernels``) share.

Both run on the grid ``(B · H_kv, cdiv(G · Q, BLOCK_M), NUM_SPLITS)``: one program serves the ``G`` query
heads of a KV head (and its ``Q`` query rows) together, so each K/V row is loaded once per group. They
differ only in how a block of K/V rows is found (a selected index list, or a slot table with holes and
pre-RoPE keys); the tile of query rows, the online-softmax update of a block and the tile's store are
these ``@triton.jit`` helpers (inlined into each kernel when it compiles). With ``NUM_SPLITS > 1`` a
program stores its partial (max, sum, accumulator) triple and ``combine_splits_kernel`` merges them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def query_tile(
    q_ptr, sqb, sqh, sqm, sqd, HKV, GROUP, Q, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """This program's tile: request ``b`` and KV head ``kvh`` (int64), rows ``r (BLOCK_M,)`` (row r is
    query row ``qi = r % Q`` of query head ``heads = kvh * GROUP + r // Q``) and ``q (BLOCK_M, BLOCK_D)``
    in q's dtype, 0 past the ``G·Q`` rows and ``D`` dims."""
    pid_bk = tl.program_id(0)
    b = (pid_bk // HKV).to(tl.int64)
    kvh = (pid_bk % HKV).to(tl.int64)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = kvh * GROUP + r // Q
    qi = r % Q
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + b * sqb + heads[:, None] * sqh + qi[:, None] * sqm + dims[None, :] * sqd,
        mask=(r[:, None] < GROUP * Q) & (dims[None, :] < D),
        other=0.0,
    )
    return b, kvh, r, heads, qi, q


@triton.jit
def block_logits(q, k, seen, SCALE: tl.constexpr, IEEE: tl.constexpr):
    """``q (BLOCK_M, BLOCK_D)`` · ``k (BLOCK_N, BLOCK_D)``ᵀ times ``SCALE``, fp32, ``-inf`` where a row does
    not see a column (``seen``: bool, broadcast to (BLOCK_M, BLOCK_N))."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return tl.where(seen, s * SCALE, float("-inf"))


@triton.jit
def attend_logits(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One online-softmax step over a block's logits ``s (BLOCK_M, BLOCK_N)`` (:func:`block_logits`) and
    values ``v (BLOCK_N, BLOCK_DV)``: the running max ``m_i``, sum ``l_i`` (BLOCK_M,) and ``acc (BLOCK_M,
    BLOCK_DV)``, all fp32. (A statistics kernel keeps ``s`` between the two halves.)"""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet adds 0
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:  # noqa: SIM108 - a constexpr branch reads clearer than a ternary in a kernel
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def attend_block(q, k, v, seen, m_i, l_i, acc, SCALE: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step of ``q (BLOCK_M, BLOCK_D)`` over a block ``k (BLOCK_N, BLOCK_D)``, ``v
    (BLOCK_N, BLOCK_DV)``, of which each row sees ``seen`` (bool, broadcast to (BLOCK_M, BLOCK_N)).
    Returns the running max ``m_i``, sum ``l_i`` (BLOCK_M,) and ``acc (BLOCK_M, BLOCK_DV)``, all fp32."""
    return attend_logits(block_logits(q, k, seen, SCALE, IEEE), v, m_i, l_i, acc, IEEE)


@triton.jit
def store_tile(
    acc, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sob, soh, som, sod,
    b, heads, qi, r, GQ, DV, NUM_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One split: ``acc / l`` into ``out`` at the tile's rows; several: the partial triple into the flat
    ``part_*`` buffers (row ``(program_id(0) · NUM_SPLITS + split) · G·Q + r``) for ``combine_splits_kernel``."""
    dv = tl.arange(0, BLOCK_DV)
    if NUM_SPLITS == 1:
        # a row that saw nothing keeps l = 0 and acc = 0: its output is zeros, as the references define
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + b * sob + heads[:, None] * soh + qi[:, None] * som + dv[None, :] * sod,
            out,
            mask=(r[:, None] < GQ) & (dv[None, :] < DV),
        )
    else:
        part = (tl.program_id(0).to(tl.int64) * NUM_SPLITS + tl.program_id(2)) * GQ + r
        tl.store(part_m_ptr + part, m_i, mask=r < GQ)
        tl.store(part_l_ptr + part, l_i, mask=r < GQ)
        tl.store(
            part_acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=(r[:, None] < GQ) & (dv[None, :] < DV)
        )


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
