"""Triton attention over selected K/V rows (decode after selection), flash-decoding style.

K/V rows are read in place by slot index; no gathered copy is made. One program serves all G query heads
of a KV head, so each selected K/V row is loaded once per group, not once per query head. With
``num_splits > 1`` the selected list is split across programs (flash-decoding) and a second launch merges
the partial (max, sum, accumulator) triples (``flash_tiles.combine_splits_kernel``); with one split a
single launch writes the output, which is the form the TensorRT AOT plugin bakes. The query tile, the
online-softmax block update and the store are ``flash_tiles``' helpers, shared with paged attention.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vlkv.plugins.flash_tiles import attend_block, query_tile, store_tile


@triton.jit
def _selected_attention(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sib, sih, sik, slb, slh, sob, soh, som, sod,
    HKV, GROUP, Q, D, DV, K_SEL,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b, kvh, r, heads, qi, q = query_tile(q_ptr, sqb, sqh, sqm, sqd, HKV, GROUP, Q, D, BLOCK_M, BLOCK_D)
    dims = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    length = tl.minimum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), K_SEL)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.program_id(2) * per_split
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
        m_i, l_i, acc = attend_block(q, k, v, ok[None, :], m_i, l_i, acc, SCALE, IEEE)
    # an empty selection leaves l = 0 and acc = 0: the output is zeros, as the reference defines
    store_tile(
        acc, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sob, soh, som, sod,
        b, heads, qi, r, GROUP * Q, DV, NUM_SPLITS, BLOCK_DV,
    )  # fmt: skip


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
