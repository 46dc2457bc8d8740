"""Triton paged attention over a pool and low-rank factor rows (``paged_lowrank``: the layout and the
reference): ``paged_attention_kernels``' paged read, where a column whose ``frow`` is ``>= 0`` is rebuilt
from its factor row instead of loaded from a slot.

Grid and online softmax as the paged read's (``flash_tiles``), but a row's columns are cut among its
``NUM_SPLITS`` programs in a *virtual order* (``paged_lowrank.split_layout``, the same cut in PyTorch):
its factored span first (``span (B, H_kv, 2)`` int32: first factored column, one past the last; ``C, 0``
where none), then the dense rest. The span gets its own splits, as many as its share of the columns but
``CHUNK`` columns each on average (``paged_lowrank.factored_chunk``: the basis loads total at most a
quarter of the dense K/V the span replaces; the tile rounding can leave one split shorter than ``CHUNK``) and one split fewer than ``NUM_SPLITS``; the other splits take the
dense columns. ``NUM_SPLITS`` and ``CHUNK`` are shapes (a static step's grid stays fixed); the cut itself
reads ``span`` on the device. Only the span's splits load the request's basis slices, once each,
``D_k[:, h·D : (h+1)·D]`` (``(BLOCK_R, BLOCK_D)``; with rotation also its rotate-half column permutation)
and ``D_v``'s; any other program (a dense request's, the text's) loads none (masked) and skips the
rank-space work. (Cut contiguously, every split meeting the span loaded the bases again: 2.33x the dense
bytes at Qwen2-VL-7B batch 1's 20 splits.) Then per tile of ``BLOCK_N`` columns:

- keys: the tile's factor rows ``K̄ (BLOCK_N, BLOCK_R)`` (columns past each row's rank masked) by the
  slice, one ``tl.dot``, rounded to the pool's dtype (the entry path (a) would rebuild), then rotated by
  the column's ``rot`` row like a pre-RoPE pool key (``rotate_pair``: the partner half comes from a
  second ``tl.dot`` with the permuted slice, the same products as the first's partner column): RoPE does
  not factor through the rank space, so keys are rebuilt per row; a tile with no factored column (a
  dense neighbour's, the text) skips this (a runtime branch);
- keys of a post-RoPE request (AttentionPack path (b), ``post (B,)`` int32 per request: path (a) and (b)
  requests share a launch): never rebuilt. The program projects its query heads onto the head's key
  basis once, ``q·D_kᵀ`` (``(BLOCK_M, BLOCK_R)`` fp32), and a tile's factored logits are that times
  ``K̄ᵀ`` in fp32, as the eager rank-space read (``attention_rows._rank_space_one_row``) takes them: no
  rotation (the factors hold rotated keys), no rounding, ``BLOCK_M·R`` products a column where the
  rebuild costs ``R·D`` plus the ``D`` of the logit. The bytes are path (a)'s: the same rows and
  basis slice (the partner slice is not loaded);
- values: accumulated in the rank space, ``acc_r += p·V̄`` (``(BLOCK_M, BLOCK_R)``, rescaled with the
  dense accumulator; a tile without factored columns skips it), and ``acc += acc_r·D_v`` once at the
  end: a factored row reads ``R`` values, not ``D``. Linear, so a split's partial triple stays mergeable
  by ``combine_splits_kernel``.

With ``LOGITS`` (one query row: a statistics step) it also stores each block's scaled logits into the
``(B, H_kv, G, C)`` fp32 buffer and its (max, sum) per row, as ``paged_probs_kernels.paged_probs_kernel``
does: that module's ``probs_normalise_kernel`` then makes them probabilities.

A factored row is ``R_k + R_v`` elements shared by all ``H_kv`` heads (each head's program reads them), where
a dense entry is ``2·D`` per head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vlkv.plugins.flash_tiles import block_logits, query_tile, store_tile
from vlkv.plugins.paged_attention_kernels import PER_STEP_INTS, rope_on_load, rotate_pair, round_to

# besides the paged read's: the frow table's strides grow with the columns, and the padded ranks (RK, RV)
# and with them the stacked rows' and bases' strides change with every request's factoring; Triton
# specialises an int on == 1 and divisibility by 16, so any of these would pick a new binary mid-run
LOWRANK_PER_STEP = (*PER_STEP_INTS, "sfb", "sfh", "skbn", "sdkb", "svbn", "sdvb", "RK", "RV", "CHUNK")


@triton.jit
def factor_rows(bar_ptr, rank_ptr, fr, sbn, sbr, RMAX, BLOCK_R: tl.constexpr):
    """``(BLOCK_N, BLOCK_R)`` the factor rows ``fr`` (``-1``: not a factored column, 0 there), each masked
    past its rank (and past ``RMAX``, the stacked rows' width)."""
    rc = tl.arange(0, BLOCK_R)
    # each row's rank loaded as a (BLOCK_N, BLOCK_R) tile (its value repeated across the columns), its mask
    # built here from ``fr``: a (BLOCK_N,) rank load (the caller's mask or this one) left Triton 3.6's sm_90
    # layout passes with a mask and pointers of different layouts (H200 run 7); a tile shares the rows' layout
    row = fr[:, None] + tl.zeros((1, BLOCK_R), tl.int64)
    fac = row >= 0
    rank = tl.load(rank_ptr + row, mask=fac, other=0)
    on = fac & (rc[None, :] < rank) & (rc[None, :] < RMAX)
    return tl.load(bar_ptr + row * sbn + rc[None, :] * sbr, mask=on, other=0.0)


@triton.jit
def basis_slice(ptr, b, kvh, sbb, sbr, sbc, cols, WIDTH, RMAX, BLOCK_R: tl.constexpr):
    """``(BLOCK_R, len(cols))`` request ``b``'s basis rows, KV head ``kvh``'s columns ``cols`` (< WIDTH)."""
    rc = tl.arange(0, BLOCK_R)
    on = (rc[:, None] < RMAX) & (cols[None, :] < WIDTH)
    return tl.load(
        ptr + b * sbb + rc[:, None] * sbr + (kvh * WIDTH + cols[None, :]) * sbc, mask=on, other=0.0
    )


@triton.jit
def rank_dot(a, basis, IEEE: tl.constexpr):
    """``a (M, BLOCK_R) · basis (BLOCK_R, N)`` in fp32 (IEEE: fp32 operands, no tf32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), basis.to(tl.float32), input_precision="ieee")
    return tl.dot(a, basis)


@triton.jit(do_not_specialize=LOWRANK_PER_STEP)
def paged_lowrank_kernel(
    # paged_attention_kernel's arguments (triton_paged_attention.shared_launch), then the factors'
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    rot_ptr, cos_ptr, sin_ptr, sec_ptr, sqb, sqh, sqm, sqd, skh, skn, skd, svh, svn, svd,
    stb, sth, stc, slb, slh, sob, soh, som, sod, srb, srh, src, srp, scr, scd,
    HKV, GROUP, Q, D, DV, COLS, DR, NR,
    logit_ptr, frow_ptr, kbar_ptr, dk_ptr, vbar_ptr, dvb_ptr, rk_ptr, rv_ptr, span_ptr, post_ptr,
    sfb, sfh, sfc, skbn, skbr, sdkb, sdkr, sdkc, svbn, svbr, sdvb, sdvr, sdvc, ssb, ssh, RK, RV, CHUNK,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_ROPE: tl.constexpr,
    MROPE: tl.constexpr, LOGITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    GQ = GROUP * Q
    pair = tl.program_id(0).to(tl.int64)
    b, kvh, r, heads, qi, q = query_tile(q_ptr, sqb, sqh, sqm, sqd, HKV, GROUP, Q, D, BLOCK_M, BLOCK_D)
    dims = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), 0), COLS)
    limit = tl.where(r < GQ, length - Q + 1 + qi, 0)
    stop_all = tl.minimum(tl.max(limit, 0), length)
    # the row's columns in a virtual order, its factored span [a, e) first, then the dense rest: the span's
    # own splits (at least CHUNK columns each) load the bases, the others never meet a factored column
    # (paged_lowrank.split_layout, the same cut in PyTorch)
    a = tl.minimum(tl.maximum(tl.load(span_ptr + b * ssb + kvh * ssh), 0), stop_all)
    n_f = tl.minimum(tl.maximum(tl.load(span_ptr + b * ssb + kvh * ssh + 1), a), stop_all) - a
    # as many of the splits as the span's share of the columns (rounded), no more than one per CHUNK
    share = (2 * NUM_SPLITS * n_f + stop_all) // tl.maximum(2 * stop_all, 1)
    splits_f = tl.minimum(tl.maximum(tl.minimum(n_f // CHUNK, share), 1), max(NUM_SPLITS - 1, 1))
    splits_f = tl.where(n_f > 0, splits_f, 0)
    per_f = tl.cdiv(tl.cdiv(n_f, tl.maximum(splits_f, 1)), BLOCK_N) * BLOCK_N
    per_d = tl.cdiv(tl.cdiv(stop_all - n_f, tl.maximum(NUM_SPLITS - splits_f, 1)), BLOCK_N) * BLOCK_N
    split = tl.program_id(2)
    on_f = split < splits_f
    start = tl.where(on_f, split * per_f, n_f + (split - splits_f) * per_d)
    stop = tl.where(on_f, tl.minimum(start + per_f, n_f), tl.minimum(start + per_d, stop_all))
    holds = on_f & (start < stop)
    stop = tl.where(split == NUM_SPLITS - 1, stop_all, stop)  # the last split walks what is left
    # the request's basis slices for this head, loaded once for every column the program walks, and only
    # by the span's splits: elsewhere every load is masked (no bytes moved)
    dk = basis_slice(dk_ptr, b, kvh, sdkb, sdkr, sdkc, dims, D, tl.where(holds, RK, 0), BLOCK_R)
    post = tl.load(post_ptr + b) != 0  # path (b): this request's keys were factored after RoPE
    half = DR // 2
    partner = tl.where(dims < DR, tl.where(dims < half, dims + half, dims - half), dims)
    dk2 = basis_slice(dk_ptr, b, kvh, sdkb, sdkr, sdkc, partner, D, tl.where(holds & ~post, RK, 0), BLOCK_R)
    # path (b) attends in the rank space: the query heads projected once onto the head's key basis,
    # (BLOCK_M, BLOCK_R) fp32, then a tile's factored logits are qd·K̄ᵀ (no key rebuilt, none rotated)
    qd = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    if holds & post:
        qd = rank_dot(q, tl.trans(dk), IEEE)
    vbasis = basis_slice(dvb_ptr, b, kvh, sdvb, sdvr, sdvc, dv, DV, tl.where(holds, RV, 0), BLOCK_R)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    acc_r = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)  # Σ p·V̄ of the factored columns
    for n0 in range(start, stop, BLOCK_N):
        virtual = n0 + tl.arange(0, BLOCK_N)
        inside = virtual < stop
        col = tl.where(virtual < n_f, a + virtual, tl.where(virtual < n_f + a, virtual - n_f, virtual))
        slot = tl.load(tab_ptr + b * stb + kvh * sth + col * stc, mask=inside, other=-1).to(tl.int64)
        fr = tl.load(frow_ptr + b * sfb + kvh * sfh + col * sfc, mask=inside, other=-1).to(tl.int64)
        fac = inside & (fr >= 0)
        dense = inside & (slot >= 0) & (fr < 0)  # a factored column's slot is never read
        k = tl.load(
            k_ptr + kvh * skh + slot[:, None] * skn + dims[None, :] * skd,
            mask=dense[:, None] & (dims[None, :] < D),
            other=0.0,
        )
        if HAS_ROPE:
            k = rope_on_load(
                k, k_ptr, kvh, skh, skn, skd, slot, dims, dense, col, b, rot_ptr, srb, srh, src, srp, sec_ptr,
                cos_ptr, sin_ptr, scr, scd, DR, NR, MROPE,
            )  # fmt: skip
        # a tile without factored columns (a dense request's, or past the image) skips the rebuild's dots
        any_fac = tl.max(fac.to(tl.int32), 0) > 0
        if (
            HAS_ROPE
        ):  # loaded before the branch: masked by ``fac`` inside it, Triton 3.6 failed (see factor_rows)
            rr = tl.load(rot_ptr + b * srb + kvh * srh + col * src, mask=inside, other=-1).to(tl.int64)
        if any_fac & ~post:  # path (a): keys rebuilt, rounded, rotated
            kb = factor_rows(kbar_ptr, rk_ptr, fr, skbn, skbr, RK, BLOCK_R)
            kf = round_to(rank_dot(kb, dk, IEEE), k.dtype)  # the entry path (a) rebuilds
            if HAS_ROPE:
                kf2 = round_to(rank_dot(kb, dk2, IEEE), k.dtype)
                kf = rotate_pair(
                    kf, kf2, rr, fac, dims, col, b, kvh, rot_ptr, srb, srh, src, srp, sec_ptr, cos_ptr, sin_ptr,
                    scr, scd, DR, NR, MROPE,
                )  # fmt: skip
            k = tl.where(fac[:, None], kf, k)
        v = tl.load(
            v_ptr + kvh * svh + slot[:, None] * svn + dv[None, :] * svd,
            mask=dense[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        seen = (dense | fac)[None, :] & (col[None, :] < limit[:, None])
        s = block_logits(q, k, seen, SCALE, IEEE)
        if any_fac & post:  # path (b): the factored columns' k is 0 above, their logits (q·D_kᵀ)·K̄ᵀ
            kb = factor_rows(kbar_ptr, rk_ptr, fr, skbn, skbr, RK, BLOCK_R)
            sf = rank_dot(qd, tl.trans(kb.to(tl.float32)), True)
            s += tl.where(fac[None, :], sf * SCALE, 0.0)
        if LOGITS:  # a statistics step (Q = 1): the scaled logits kept for the normalise pass
            tl.store(
                logit_ptr + (pair * GQ + r)[:, None] * COLS + col[None, :],
                s,
                mask=(r < GQ)[:, None] & inside[None, :],
            )
        # flash_tiles.attend_logits with a second (rank-space) accumulator sharing its rescale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        acc_r = acc_r * alpha[:, None]
        if any_fac:  # the factored columns' values, in the rank space
            vb = factor_rows(vbar_ptr, rv_ptr, fr, svbn, svbr, RV, BLOCK_R)
            if IEEE:
                acc_r += tl.dot(p, vb.to(tl.float32), input_precision="ieee")
            else:
                acc_r += tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    if holds:  # back from the rank space once: (Σ p·V̄)·D_v, in fp32
        acc += tl.dot(acc_r, vbasis.to(tl.float32), input_precision="ieee")
    store_tile(
        acc, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sob, soh, som, sod,
        b, heads, qi, r, GQ, DV, NUM_SPLITS, BLOCK_DV,
    )  # fmt: skip
    if LOGITS and NUM_SPLITS == 1:  # store_tile wrote the output only; the normalise pass needs (max, sum)
        tl.store(part_m_ptr + pair * GQ + r, m_i, mask=r < GQ)
        tl.store(part_l_ptr + pair * GQ + r, l_i, mask=r < GQ)
