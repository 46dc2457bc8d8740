"""Triton kernel of a decode layer's whole append on the device path: the K/V rows into the pool, every
request's new table column, and the layer's read table, in one launch (launcher: ``paged_append_triton.py``).

The requests' tables are separate tensors (one-sample caches, each ``(1, H_kv, C_b)`` with its own
capacity): the kernel reaches them through a step's *meta* rows, one per (layer, request) of int64
fields (the tables' addresses, the capacity, the new column, its run id, the length after), built once
per step (``vlkv.runtime.kv.step_tables``), so a layer's launch takes the same tensors as every other
layer plus its row offset. Where the Python append wrote each request's column with ~8 tensor ops per
layer, and the paged read's table was cut from the requests' tables and concatenated (~9 more), this is
one launch. Grid ``(B, H_kv)``: one program per request and KV head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vlkv.plugins.glue_kernels import write_pool_row

# a meta row (``(L, B, META_FIELDS)`` int64; its builder ``vlkv.runtime.kv.step_tables`` names the
# fields): 0 the slot table's address, 1 the table capacity, 2-4 the position, modality and order tables'
# addresses, 5 the hole table's (0: no holes), 6 the new column, 7 the run id (the same slot in every
# head; -1: none), 8 the length after the append, 9 to 9 + MAX_SCORES - 1 the float32 running-score
# tables' addresses (0: none; their new column zeroed)
MAX_SCORES = 3
META_FIELDS = 9 + MAX_SCORES


# the read table's width (and so its strides) grows a column a step, and each layer reads its own rows of
# the step's table: not specialised, or a decode compiles new binaries mid-run (see paged_attention_kernels)
PER_STEP_INTS = ("sob", "soh", "srb", "srh", "META_OFF", "W")


@triton.jit(do_not_specialize=PER_STEP_INTS)
def decode_append_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, flag_ptr, ids_ptr, meta_ptr, pos_ptr, mod_ptr, ord_ptr, out_ptr, rot_ptr,
    skb, skh, svb, svh, skph, skps, svph, svps, sfh, sih, sib, spb, sob, soh, srb, srh, src,
    META_OFF, D, P, W,
    RUN_IDS: tl.constexpr, HAS_OUT: tl.constexpr, HAS_ROT: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr, FIELDS: tl.constexpr, N_SCORES: tl.constexpr,
):  # fmt: skip
    """Request ``b``'s new entry in KV head ``h``: its K/V row (cast to the pool's dtype) at its slot and
    the slot's pre-RoPE flag cleared; its table column ``p`` (slot, ``P`` positions, modality, order, no
    hole, running scores 0); with ``HAS_OUT`` the read table's row ``out[b, h, :W]``: the slots of columns ``< p`` (``-1``
    at holes), the new slot at ``p``, 0 after (past the length: never read); with ``HAS_ROT`` (a static step with linked entries) its
    twin ``rot[b, h, :W, :P]``: each held column's ``P`` positions where its slot's key is stored pre-RoPE
    (the pool's flag), ``-1`` elsewhere (post-RoPE, holes, the new column, past the length): what the
    paged read rotates by (``paged_attention_kernels.rope_on_load``'s table form)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = meta_ptr + META_OFF + b * FIELDS
    p = tl.load(row + 6)
    if RUN_IDS:  # noqa: SIM108 (a constexpr branch: the other load is not compiled)
        slot = tl.load(row + 7)
    else:
        slot = tl.load(ids_ptr + h * sih + b * sib).to(tl.int64)
    write_pool_row(
        k_ptr, v_ptr, kp_ptr, vp_ptr, flag_ptr, b, h, slot,
        skb, skh, svb, svh, skph, skps, svph, svps, sfh, D, BLOCK,
    )  # fmt: skip
    # the request's tables: contiguous (1, H_kv, C) / (1, H_kv, C, P), so column p of head h is
    # element h·C + p (times P for positions)
    cap = tl.load(row + 1)
    at = h * cap + p
    slots = tl.load(row + 0).to(tl.pointer_type(tl.int64))
    tl.store(slots + at, slot)
    comp = tl.arange(0, BLOCK_P)
    positions = tl.load(row + 2).to(tl.pointer_type(tl.int64))
    tl.store(positions + at * P + comp, tl.load(pos_ptr + b * spb + comp, mask=comp < P), mask=comp < P)
    modality = tl.load(row + 3).to(tl.pointer_type(tl.int8))
    tl.store(modality + at, tl.load(mod_ptr + b))
    order = tl.load(row + 4).to(tl.pointer_type(tl.int64))
    tl.store(order + at, tl.load(ord_ptr + b))
    hole_addr = tl.load(row + 5)
    # no hole table: the slot table stands in as an address (what it reads there is no hole)
    holes = tl.where(hole_addr != 0, hole_addr, tl.load(row + 0)).to(tl.pointer_type(tl.int8))
    if hole_addr != 0:
        tl.store(holes + at, tl.zeros((), dtype=tl.int8))
    for i in tl.static_range(N_SCORES):  # the running scores' new column (where the request keeps some)
        score_addr = tl.load(row + 9 + i)
        if score_addr != 0:
            tl.store(score_addr.to(tl.pointer_type(tl.float32)) + at, tl.zeros((), dtype=tl.float32))
    if HAS_OUT:
        for c0 in range(0, W, BLOCK_W):
            c = c0 + tl.arange(0, BLOCK_W)
            old = tl.load(slots + h * cap + c, mask=c < p, other=0)
            hole = tl.load(holes + h * cap + c, mask=c < p, other=0)
            val = tl.where(c == p, slot, tl.where((hole != 0) & (hole_addr != 0), -1, old))
            tl.store(out_ptr + b * sob + h * soh + c, val, mask=c < W)
            if HAS_ROT:
                on = (c < p) & (val >= 0)
                pre = tl.load(flag_ptr + h * sfh + tl.maximum(val, 0), mask=on, other=0)
                on = on & (pre != 0)
                two = on[:, None] & (comp < P)[None, :]
                # a name of its own: reassigning the scalar ``at`` inside the loop is an error of Triton's
                # compiler (a loop-carried variable changing type), which the interpreter never raises
                cells = (h * cap + c)[:, None] * P + comp[None, :]
                got = tl.load(positions + cells, mask=two, other=-1)
                dest = rot_ptr + b * srb + h * srh + c[:, None] * src + comp[None, :]
                tl.store(dest, got, mask=(c < W)[:, None] & (comp < P)[None, :])
