"""Triton kernels for a decoder layer's glue on the device path: RMSNorm (with the residual add in
front), RoPE in place, SiLU-and-multiply.

Each replays the HF formula it replaces, rounding where the PyTorch ops round (to the tensors' dtype
after each op), so that bf16/fp16 results differ from the references only by the order of the norm's
sum (``glue_reference.py``; the launchers are ``triton_glue.py``). One program per row (norms) or per
(row, head) (RoPE), or per row and block of columns (SiLU): a decode step's few rows make small grids.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, sx, sr, so, ss, EPS,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[r] = w * (x / rms(x)).to(dtype)``; with ``HAS_RESIDUAL`` x is ``res[r] + x[r]`` rounded to
    the dtype first, and stored at ``sum[r]`` (the residual stream after the add)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * sr + cols, mask=inside, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * ss + cols, x, mask=inside)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * (1.0 / tl.sqrt(var + EPS))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * so + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=inside)


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, sxr, sxh, scb, scq, ssb, ssq, Q, HALF, BLOCK: tl.constexpr,
):  # fmt: skip
    """In place: head ``h`` of row ``r`` (``x[r, h, :D]``, D = 2·HALF) becomes ``x·cos + rotate_half(x)·sin``
    with row ``r``'s ``cos / sin`` (sample ``r // Q``, query ``r % Q``); each product rounded to the dtype,
    then the sum (the HF ``apply_rotary_pos_emb`` on tensors of that dtype)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    b = row // Q
    qi = row % Q
    i = tl.arange(0, BLOCK)
    inside = i < HALF
    base = x_ptr + row * sxr + head * sxh
    x1 = tl.load(base + i, mask=inside, other=0.0)
    x2 = tl.load(base + HALF + i, mask=inside, other=0.0)
    c = cos_ptr + b * scb + qi * scq
    s = sin_ptr + b * ssb + qi * ssq
    c1 = tl.load(c + i, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF + i, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(s + i, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF + i, mask=inside, other=0.0).to(tl.float32)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    out2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + i, out1, mask=inside)
    tl.store(base + HALF + i, out2, mask=inside)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, N, sg, so, BLOCK: tl.constexpr):
    """``out[r, j] = silu(gu[r, j]) * gu[r, N + j]`` (the gate and up projections side by side), the SiLU
    rounded to the dtype before the product (``act_fn(gate) * up`` on tensors of that dtype)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    g = tl.load(gu_ptr + row * sg + cols, mask=inside, other=0.0)
    u = tl.load(gu_ptr + row * sg + N + cols, mask=inside, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * so + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=inside)


@triton.jit
def pool_write_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, flag_ptr, ids_ptr,
    skb, skh, svb, svh, skph, skps, svph, svps, sfh, sih, sib, D, BLOCK: tl.constexpr,
):  # fmt: skip
    """Request ``b``'s new K/V row of KV head ``h`` (``k[b, h, :D]``) into the pool at slot ``ids[h, b]``
    (cast to the pool's dtype), and that slot's pre-RoPE flag cleared: a decode append's pool write."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(ids_ptr + h * sih + b * sib).to(tl.int64)
    write_pool_row(
        k_ptr, v_ptr, kp_ptr, vp_ptr, flag_ptr, b, h, slot,
        skb, skh, svb, svh, skph, skps, svph, svps, sfh, D, BLOCK,
    )  # fmt: skip


@triton.jit
def write_pool_row(
    k_ptr, v_ptr, kp_ptr, vp_ptr, flag_ptr, b, h, slot,
    skb, skh, svb, svh, skph, skps, svph, svps, sfh, D, BLOCK: tl.constexpr,
):  # fmt: skip
    """``k[b, h, :D]`` / ``v[b, h, :D]`` into the pools at ``slot`` of KV head ``h`` (cast to the pools'
    dtype) and the slot's pre-RoPE flag cleared (the one-launch append shares it)."""
    d = tl.arange(0, BLOCK)
    inside = d < D
    kr = tl.load(k_ptr + b * skb + h * skh + d, mask=inside)
    vr = tl.load(v_ptr + b * svb + h * svh + d, mask=inside)
    tl.store(kp_ptr + h * skph + slot * skps + d, kr.to(kp_ptr.dtype.element_ty), mask=inside)
    tl.store(vp_ptr + h * svph + slot * svps + d, vr.to(vp_ptr.dtype.element_ty), mask=inside)
    tl.store(flag_ptr + h * sfh + slot, tl.zeros((), dtype=flag_ptr.dtype.element_ty))
