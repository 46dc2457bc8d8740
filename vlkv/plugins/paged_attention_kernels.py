"""Triton paged attention: K/V read in place from one layer's pool through per-request slot tables.

Grid ``(B · H_kv, cdiv(G · Q, BLOCK_M), NUM_SPLITS)``: one program serves the ``G`` query heads of a KV
head (and its ``Q`` query rows) together, so each entry's K/V row is loaded once per group, not once
per query head. The program walks its row of the table ``BLOCK_N`` columns at a time with an online
softmax (running max ``m``, sum ``l``, fp32 accumulator). Causality is by column: query ``i`` sees
columns ``< length - Q + i + 1``; a negative slot inside the length is a hole (masked). With ``HAS_ROPE``
a key stored pre-RoPE (its ``rot`` row >= 0) is rotated as it is loaded (:func:`rope_on_load`: by rows of
``cos/sin``, or with ``MROPE`` by a position table per M-RoPE section, the static step's form). With
``NUM_SPLITS > 1`` the columns are split across programs (flash-decoding) and
``flash_tiles.combine_splits_kernel`` merges the partial (m, l, acc) triples. The query tile, the
online-softmax block update and the store are ``flash_tiles``' helpers, shared with selected attention.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vlkv.plugins.flash_tiles import attend_block, query_tile, store_tile

# the table's width and strides grow by one column a decode step: specialised (Triton's "divisible by 16"
# and "== 1" variants) they make a decode compile new binaries mid-run, each a fraction of a second (a
# likely cause of GPU run 5's one 488 ms step); so do the eager read's ``rot`` strides and its count of
# pre-RoPE rows ``NR`` (which changes with evictions)
PER_STEP_INTS = ("stb", "sth", "COLS", "srb", "srh", "NR")


@triton.jit
def rope_on_load(
    k, k_ptr, kvh, skh, skn, skd, slot, dims, ok, col, b, rot_ptr, srb, srh, src, srp, sec_ptr,
    cos_ptr, sin_ptr, scr, scd, DR, NR, MROPE: tl.constexpr,
):  # fmt: skip
    """The keys ``k (BLOCK_N, BLOCK_D)`` just loaded for columns ``col`` (``ok``: held), with each pre-RoPE
    one (its ``rot`` entry >= 0) rotated: ``k·cos + rotate_half(k)·sin`` on the first ``DR`` dims, in fp32,
    rounded to the pool's dtype (the key the model would have stored).

    Without ``MROPE`` the ``rot`` entry names the row of ``cos/sin (NR, DR)`` (the eager read's rows, one
    per pre-RoPE entry, or a 1-D RoPE table indexed by position). With ``MROPE`` ``rot`` holds each
    column's ``P`` position components (stride ``srp``; component 0 < 0: not rotated), ``cos/sin`` a
    table by position, and ``sec (DR,)`` the component each dim's angle comes from (Qwen2-VL's sections):
    dim ``d`` reads row ``rot[..., sec[d]]``. Rows past the table are clamped to its last (no read outside
    it; the caller sizes the table to the positions it holds)."""
    rr = tl.load(rot_ptr + b * srb + kvh * srh + col * src, mask=ok, other=-1).to(tl.int64)
    spin = ok[:, None] & (rr[:, None] >= 0) & (dims[None, :] < DR)
    half = DR // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    k2 = tl.load(k_ptr + kvh * skh + slot[:, None] * skn + partner[None, :] * skd, mask=spin, other=0.0)
    return rotate_pair(
        k, k2, rr, ok, dims, col, b, kvh, rot_ptr, srb, srh, src, srp, sec_ptr, cos_ptr, sin_ptr, scr, scd,
        DR, NR, MROPE,
    )  # fmt: skip


@triton.jit
def rotate_pair(
    k, k2, rr, ok, dims, col, b, kvh, rot_ptr, srb, srh, src, srp, sec_ptr, cos_ptr, sin_ptr, scr, scd,
    DR, NR, MROPE: tl.constexpr,
):  # fmt: skip
    """:func:`rope_on_load`'s rotation once the keys are in hand: ``k (BLOCK_N, BLOCK_D)`` and its
    rotate-half partner ``k2`` (``k2[:, d] = k[:, d ± DR/2]`` on the first ``DR`` dims), ``rr`` each
    column's ``rot`` entry (component 0), ``ok`` the columns to rotate. A pool read loads ``k2`` from the
    pool; a low-rank read rebuilds it from the factors (``paged_lowrank_kernels``)."""
    spin = ok[:, None] & (rr[:, None] >= 0) & (dims[None, :] < DR)
    half = DR // 2
    if MROPE:
        comp = tl.load(sec_ptr + dims, mask=dims < DR, other=0).to(tl.int64)
        at = tl.load(
            rot_ptr + b * srb + kvh * srh + col[:, None] * src + comp[None, :] * srp, mask=spin, other=0
        ).to(tl.int64)
    else:
        at = rr[:, None]
    at = tl.minimum(tl.maximum(at, 0), NR - 1)
    c = tl.load(cos_ptr + at * scr + dims[None, :] * scd, mask=spin, other=1.0)
    sn = tl.load(sin_ptr + at * scr + dims[None, :] * scd, mask=spin, other=0.0)
    sign = tl.where(dims < half, -1.0, 1.0)
    kr = k.to(tl.float32) * c.to(tl.float32) + sign[None, :] * k2.to(tl.float32) * sn.to(tl.float32)
    return tl.where(spin, round_to(kr, k.dtype), k)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` to nearest-even. For bf16 by hand: what a GPU's conversion does,
    and torch's; Triton's interpreter converts toward zero (an ulp off in about half the values), so
    written out the CPU check sees the same values the GPU reads (finite values: a NaN or inf key is not
    a key a model stores)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit(do_not_specialize=PER_STEP_INTS)
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    rot_ptr, cos_ptr, sin_ptr, sec_ptr,
    sqb, sqh, sqm, sqd, skh, skn, skd, svh, svn, svd,
    stb, sth, stc, slb, slh, sob, soh, som, sod, srb, srh, src, srp, scr, scd,
    HKV, GROUP, Q, D, DV, COLS, DR, NR,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_ROPE: tl.constexpr,
    MROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    GQ = GROUP * Q
    b, kvh, r, heads, qi, q = query_tile(q_ptr, sqb, sqh, sqm, sqd, HKV, GROUP, Q, D, BLOCK_M, BLOCK_D)
    dims = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), 0), COLS)
    # the last column each row sees (exclusive); rows past G·Q see nothing
    limit = tl.where(r < GQ, length - Q + 1 + qi, 0)
    # the tile's furthest column: its last real row sees the most
    stop_all = tl.minimum(tl.max(limit, 0), length)
    per_split = tl.cdiv(tl.cdiv(stop_all, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.program_id(2) * per_split
    stop = tl.minimum(start + per_split, stop_all)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        col = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(tab_ptr + b * stb + kvh * sth + col * stc, mask=col < stop, other=-1).to(tl.int64)
        ok = (col < stop) & (slot >= 0)  # padding and holes read nothing
        k = tl.load(
            k_ptr + kvh * skh + slot[:, None] * skn + dims[None, :] * skd,
            mask=ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )
        if HAS_ROPE:
            k = rope_on_load(
                k, k_ptr, kvh, skh, skn, skd, slot, dims, ok, col, b, rot_ptr, srb, srh, src, srp, sec_ptr,
                cos_ptr, sin_ptr, scr, scd, DR, NR, MROPE,
            )  # fmt: skip
        v = tl.load(
            v_ptr + kvh * svh + slot[:, None] * svn + dv[None, :] * svd,
            mask=ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        seen = ok[None, :] & (col[None, :] < limit[:, None])
        m_i, l_i, acc = attend_block(q, k, v, seen, m_i, l_i, acc, SCALE, IEEE)
    store_tile(
        acc, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sob, soh, som, sod,
        b, heads, qi, r, GQ, DV, NUM_SPLITS, BLOCK_DV,
    )  # fmt: skip


@triton.jit
def paged_attention_aot_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr,
    H, HKV, Q, S, D, C,
    out_ptr,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """TensorRT AOT entry: inputs, int32 shape scalars, output (the QDP argument order).

    Tensors are contiguous: q (B, H, Q, D), k/v pools (HKV, S, D), table (B, HKV, C) int64, lengths
    (B, HKV) int64; out (B, H, Q, D). Grid: (B * HKV, cdiv((H // HKV) * Q, BLOCK_M)), one split, no
    pre-RoPE rotation.
    """
    paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, out_ptr, out_ptr, out_ptr, out_ptr,
        len_ptr, q_ptr, q_ptr, len_ptr,
        H * Q * D, Q * D, D, 1, S * D, D, 1, S * D, D, 1,
        HKV * C, C, 1, HKV, 1, H * Q * D, Q * D, D, 1, 0, 0, 0, 0, 0, 0,
        HKV, H // HKV, Q, D, D, C, 0, 1,
        SCALE, 1, IEEE, False, False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D,
    )  # fmt: skip
