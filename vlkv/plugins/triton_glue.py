"""Launchers of the device path's decoder-layer glue kernels (``glue_kernels.py``): one launch each for
RMSNorm, the residual add and the post-attention RMSNorm together, RoPE over the fused q/k/v rows in
place, SiLU-and-multiply over the fused gate/up rows, and a decode append's pool write (K/V rows and
pre-RoPE flags). References: ``glue_reference.py``.

They replace, per decoder layer of a decode step, the ~40 aten ops of the HF glue (RMSNorm: 6 each, RoPE:
16, the activation and product: 2, the residual add: 1) with 4 launches and 4 output allocations:
a GPU decode step is host-bound (~12.5k ops a step at 30 layers, docs/benchmarks/2026-11-26-h200-run4/).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.glue_kernels import pool_write_kernel, rms_norm_kernel, rope_kernel, silu_mul_kernel
from vlkv.plugins.triton_launch import check_float_dtype

# the widest row one norm program reads (a row per program; LLaVA-1.5-7B: 4,096)
MAX_NORM = 1 << 15


def _rows(x: Tensor, name: str) -> None:
    check_float_dtype(name, x.dtype)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be (rows, N) with unit column stride, got {tuple(x.shape)} {x.stride()}"
        )


def _norm_width(x: Tensor) -> None:
    if x.shape[1] > MAX_NORM:
        raise ValueError(f"x: rows of {x.shape[1]} exceed the {MAX_NORM} one norm program reads")


def _out(out: Tensor | None, shape, like: Tensor, name: str) -> Tensor:
    """``out`` where the caller gives one (a reused buffer: one allocation fewer a launch), else new."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: {tuple(out.shape)} {out.dtype} given, {tuple(shape)} {like.dtype} needed")
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """``x (R, N)``, ``weight (N,)`` contiguous, x's dtype → ``(R, N)`` (``rms_norm_reference``), into
    ``out`` where given."""
    _rows(x, "x")
    _norm_width(x)
    out = _out(out, x.shape, x, "out")
    n = x.shape[1]
    rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, out, n, x.stride(0), 0, out.stride(0), 0, float(eps),
        HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    total: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``residual + x`` and its RMSNorm, both ``(R, N)`` (``add_rms_norm_reference``), into ``total`` and
    ``out`` where given."""
    _rows(x, "x")
    _rows(residual, "residual")
    _norm_width(x)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    total, out = _out(total, x.shape, x, "total"), _out(out, x.shape, x, "out")
    n = x.shape[1]
    rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, total, n, x.stride(0), residual.stride(0), out.stride(0),
        total.stride(0), float(eps), HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return total, out


def rope_(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """Rotate the first ``heads`` heads of ``x (B·Q, H_all, D)`` (unit stride on D) in place by
    ``cos / sin (B, Q, D)`` (unit stride on D, x's dtype); returns x (``rope_reference``)."""
    check_float_dtype("x", x.dtype)
    rows, _, d = x.shape
    b, q, dc = cos.shape
    if dc != d or d % 2 or b * q != rows or sin.shape != cos.shape or x.stride(-1) != 1:
        raise ValueError(f"rope_: x {tuple(x.shape)} and cos/sin {tuple(cos.shape)} do not match")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("rope_: cos/sin need unit stride on D and x's dtype")
    if rows and heads:
        rope_kernel[(rows, heads)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), cos.stride(1), sin.stride(0),
            sin.stride(1), q, d // 2, BLOCK=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return x


def silu_mul(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """``gate_up (R, 2·I)`` → ``silu(gate) * up`` ``(R, I)`` (``silu_mul_reference``), into ``out`` where
    given."""
    _rows(gate_up, "gate_up")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = _out(out, (rows, n), gate_up, "out")
    block = min(triton.next_power_of_2(max(n, 1)), 1024)
    if rows and n:
        silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


def pool_write_(k_pool: Tensor, v_pool: Tensor, prerope: Tensor, ids: Tensor, k: Tensor, v: Tensor) -> None:
    """A decode append's pool write in one launch (``pool_write_reference``): request ``b``'s new rows
    ``k, v (B, H_kv, 1, D)`` (any strides but unit on D) into ``k_pool / v_pool (H_kv, S, D)`` (unit stride
    on D) at slots ``ids (H_kv, B)`` int64 (any strides: a run's one id per request is a stride-0
    expand), and ``prerope (H_kv, S)`` bool cleared there."""
    b, heads, one, d = k.shape
    if v.shape != k.shape or one != 1 or ids.shape != (heads, b) or k_pool.shape[0] != heads:
        raise ValueError(
            f"pool_write_: k {tuple(k.shape)}, v {tuple(v.shape)}, ids {tuple(ids.shape)} do not match"
        )
    if k_pool.shape[-1] != d or v_pool.shape[-1] != v.shape[-1] or prerope.shape != k_pool.shape[:2]:
        raise ValueError(
            f"pool_write_: pools {tuple(k_pool.shape)} / flags {tuple(prerope.shape)} do not match"
        )
    if any(t.stride(-1) != 1 for t in (k, v, k_pool, v_pool)) or prerope.stride(-1) != 1:
        raise ValueError("pool_write_: K/V rows, pools and flags need unit stride on their last dimension")
    if b and heads:
        pool_write_kernel[(b, heads)](
            k, v, k_pool, v_pool, prerope, ids, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), prerope.stride(0),
            ids.stride(0), ids.stride(1), d, BLOCK=triton.next_power_of_2(d),
        )  # fmt: skip
