"""PyTorch launcher for ``lowrank_attention_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32


def tile_sizes(group: int, head_dim: int, rank_k: int, rank_v: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_RK, BLOCK_RV); tl.dot needs every tile side >= 16."""
    block_m = min(64, max(16, triton.next_power_of_2(group)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_rk = max(16, triton.next_power_of_2(rank_k))
    block_rv = max(16, triton.next_power_of_2(rank_v))
    widest = max(block_d, block_rk, block_rv)
    return block_m, 32 if widest > 64 else 64, block_d, block_rk, block_rv


def lowrank_attention_triton(
    q: Tensor,
    kbar: Tensor,
    dk: Tensor,
    vbar: Tensor,
    dv: Tensor,
    rows: Tensor,
    k: Tensor,
    v: Tensor,
    dense_len: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Triton version of ``lowrank_reference.lowrank_decode_attention`` (same arguments and result).

    q: (B, H, D). kbar: (B, T, R_k), dk: (B, R_k, H_kv·D), vbar: (B, T, R_v), dv: (B, R_v, H_kv·D).
    rows: (B,) int64. k, v: (B, H_kv, S, D). dense_len: (B,) int64. All floats one dtype.
    Returns (B, H, D) in q's dtype.
    """
    check_float_dtype("q", q.dtype)
    floats = {"kbar": kbar, "dk": dk, "vbar": vbar, "dv": dv, "k": k, "v": v}
    for name, t in floats.items():
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    b, h, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    rank_k, rank_v, t_rows, s = kbar.shape[2], vbar.shape[2], kbar.shape[1], k.shape[2]
    if dk.shape != (b, rank_k, hkv * d) or dv.shape != (b, rank_v, hkv * d) or vbar.shape[:2] != (b, t_rows):
        raise ValueError(
            f"factor shapes disagree: kbar {tuple(kbar.shape)}, dk {tuple(dk.shape)}, vbar {tuple(vbar.shape)}, "
            f"dv {tuple(dv.shape)} for q {tuple(q.shape)} and {hkv} KV heads"
        )
    group = h // hkv
    scale = d**-0.5 if scale is None else scale
    rows = rows.to(device=q.device, dtype=torch.int64)
    dense_len = dense_len.to(device=q.device, dtype=torch.int64)
    block_m, block_n, block_d, block_rk, block_rv = tile_sizes(group, d, rank_k, rank_v)
    out = torch.empty_like(q)
    grid = (b * hkv, triton.cdiv(group, block_m))
    from vlkv.plugins.lowrank_attention_kernels import lowrank_attention_kernel

    lowrank_attention_kernel[grid](
        q, kbar, dk, vbar, dv, rows, k, v, dense_len, out,
        *q.stride(), *kbar.stride(), *dk.stride(), *vbar.stride(), *dv.stride(),
        *rows.stride(), *k.stride(), *v.stride(), *dense_len.stride(), *out.stride(),
        hkv, group, d, rank_k, rank_v, t_rows, s,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_RK=block_rk, BLOCK_RV=block_rv,
    )  # fmt: skip
    return out
