"""Triton paged decode with probabilities: one read of K and V in place through the slot tables gives the
attention output AND each row's softmax over its table columns (a statistics step's two results).

``paged_probs_kernel`` runs on ``paged_attention_kernel``'s grid ``(B · H_kv, cdiv(G, BLOCK_M),
NUM_SPLITS)`` for one query row per request: a program walks its split of a (request, KV head)'s table
row ``BLOCK_N`` columns at a time, accumulates the output by online softmax (``flash_tiles``' query tile
and store), and writes each block's scaled logits (``-inf`` at holes) into the ``(B, H_kv, G, C)`` fp32
probabilities buffer, plus its running (max, sum) per row into the partial buffers (with one split too:
the normalise pass needs them). ``probs_normalise_kernel`` then turns the logits into probabilities in
place with the combined (max, sum) of the splits, writes 0 past each row's length (nothing was written
there), optionally the ``(B, H_kv, 1, C)`` held-column mask, and with several splits merges their
outputs (``combine_splits_kernel``): two launches a layer. Nothing is gathered, nothing upcast in memory:
K/V are read once, the logits (4 bytes per column and query head) twice. With ``HAS_ROPE`` pre-RoPE keys
are rotated as they load, as in the paged read (``paged_attention_kernels.rope_on_load``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vlkv.plugins.flash_tiles import (
    attend_logits,
    block_logits,
    combine_splits_kernel,
    query_tile,
    store_tile,
)
from vlkv.plugins.paged_attention_kernels import PER_STEP_INTS, rope_on_load


# the per-step ints of ``paged_attention_kernel`` (the table's width and strides grow a column a step; the
# width is the probabilities' row stride too): not specialised, or a decode compiles new binaries mid-run
@triton.jit(do_not_specialize=PER_STEP_INTS)
def paged_probs_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, out_ptr, logit_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    rot_ptr, cos_ptr, sin_ptr, sec_ptr,
    sqb, sqh, sqd, skh, skn, skd, svh, svn, svd, stb, sth, stc, slb, slh, sob, soh, sod,
    srb, srh, src, srp, scr, scd,
    HKV, GROUP, D, DV, COLS, DR, NR,
    SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_ROPE: tl.constexpr,
    MROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b, kvh, r, heads, qi, q = query_tile(q_ptr, sqb, sqh, 0, sqd, HKV, GROUP, 1, D, BLOCK_M, BLOCK_D)
    dims = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    rows = r < GROUP
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), 0), COLS)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.program_id(2) * per_split
    stop = tl.minimum(start + per_split, length)
    # row r's logits: (request, KV head) pair program_id(0), query head r of its group, C columns each
    logit_row = logit_ptr + (tl.program_id(0).to(tl.int64) * GROUP + r) * COLS
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        col = n0 + tl.arange(0, BLOCK_N)
        inside = col < stop
        slot = tl.load(tab_ptr + b * stb + kvh * sth + col * stc, mask=inside, other=-1).to(tl.int64)
        ok = inside & (slot >= 0)  # padding and holes read nothing
        k = tl.load(
            k_ptr + kvh * skh + slot[:, None] * skn + dims[None, :] * skd,
            mask=ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )
        if HAS_ROPE:  # pre-RoPE keys rotated as they load (the paged read's helper)
            k = rope_on_load(
                k, k_ptr, kvh, skh, skn, skd, slot, dims, ok, col, b, rot_ptr, srb, srh, src, srp, sec_ptr,
                cos_ptr, sin_ptr, scr, scd, DR, NR, MROPE,
            )  # fmt: skip
        v = tl.load(
            v_ptr + kvh * svh + slot[:, None] * svn + dv[None, :] * svd,
            mask=ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        # flash_tiles.attend_block in its two halves: the scaled logits are kept and stored between them
        s = block_logits(q, k, ok[None, :] & rows[:, None], SCALE, IEEE)
        tl.store(logit_row[:, None] + col[None, :], s, mask=rows[:, None] & inside[None, :])
        m_i, l_i, acc = attend_logits(s, v, m_i, l_i, acc, IEEE)
    store_tile(
        acc, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sob, soh, 0, sod,
        b, heads, qi, r, GROUP, DV, NUM_SPLITS, BLOCK_DV,
    )  # fmt: skip
    if NUM_SPLITS == 1:  # store_tile wrote the output only; the normalise pass needs (max, sum) too
        part = tl.program_id(0).to(tl.int64) * GROUP + r
        tl.store(part_m_ptr + part, m_i, mask=rows)
        tl.store(part_l_ptr + part, l_i, mask=rows)


# the normalise pass's own per-step ints (it takes no ``rot``: an older Triton refuses a name not in the
# signature)
NORMALISE_INTS = ("stb", "sth", "COLS")


@triton.jit(do_not_specialize=NORMALISE_INTS)
def probs_normalise_kernel(
    prob_ptr, tab_ptr, len_ptr, vis_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    stb, sth, stc, slb, slh, sob, soh, sod, HKV, GROUP, DV, COLS,
    NUM_SPLITS: tl.constexpr, WRITE_VIS: tl.constexpr, COMBINE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Grid ``(B · H_kv, cdiv(C, BLOCK_C))``: the logits of ``BLOCK_C`` columns of one (request, KV head)'s
    ``G`` rows become ``exp(logit - max) / sum`` in place (0 at holes, past the length, in a row holding
    nothing); with ``WRITE_VIS`` the held-column mask of those columns into ``vis_ptr`` (int8/bool). With
    ``COMBINE`` (several splits, ``G <= BLOCK_M``) each pair's first program also merges the splits'
    output (``combine_splits_kernel``, whose row tile is then program_id(1) = 0): one launch fewer."""
    if COMBINE:  # noqa: SIM102 - a constexpr branch (compiled out), then a runtime one
        if tl.program_id(1) == 0:
            combine_splits_kernel(
                part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sob, soh, 0, sod, HKV, GROUP, 1, DV,
                NUM_SPLITS, BLOCK_M, BLOCK_DV,
            )  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    b = pair // HKV
    kvh = pair % HKV
    r = tl.arange(0, BLOCK_G)
    rows = r < GROUP
    m_all = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        part = (pair * NUM_SPLITS + split) * GROUP + r
        m_all = tl.maximum(m_all, tl.load(part_m_ptr + part, mask=rows, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros((BLOCK_G,), tl.float32)
    for split in range(NUM_SPLITS):
        part = (pair * NUM_SPLITS + split) * GROUP + r
        w = tl.exp(tl.load(part_m_ptr + part, mask=rows, other=float("-inf")) - m_safe)
        l_all += w * tl.load(part_l_ptr + part, mask=rows, other=0.0)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + kvh * slh).to(tl.int32), 0), COLS)
    inside = col < length
    where = prob_ptr + (pair * GROUP + r)[:, None] * COLS + col[None, :]
    # past the length nothing was written: read as -inf, stored as 0
    x = tl.load(where, mask=rows[:, None] & inside[None, :], other=float("-inf"))
    p = tl.exp(x - m_safe[:, None]) / tl.maximum(l_all, 1e-30)[:, None]
    tl.store(where, p, mask=rows[:, None] & (col < COLS)[None, :])
    if WRITE_VIS:
        slot = tl.load(tab_ptr + b * stb + kvh * sth + col * stc, mask=inside, other=-1)
        tl.store(vis_ptr + pair * COLS + col, (inside & (slot >= 0)).to(tl.int8), mask=col < COLS)


def normalise_blocks(group: int) -> tuple[int, int]:
    """``(BLOCK_G, BLOCK_C)`` of :func:`probs_normalise_kernel`: every row of a group, and about 1k
    elements (4 KB of fp32) per program; not from the table's width, which grows a column a step (a
    block size from it would compile new binaries mid-decode)."""
    block_g = triton.next_power_of_2(max(group, 1))
    return block_g, max(16, 1024 // block_g)
