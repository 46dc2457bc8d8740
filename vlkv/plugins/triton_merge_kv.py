"""PyTorch launcher for the kernels in ``merge_kv_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.merge_kv_kernels import merge_finalize_kernel, merge_scan_kernel, merge_scatter_kernel
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32


def _check(k: Tensor, v: Tensor, assign: Tensor, counts: Tensor) -> None:
    check_float_dtype("k", k.dtype)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match")
    if assign.shape != k.shape[:3] or counts.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"assign {tuple(assign.shape)} must be (B, Hkv, S) and counts {tuple(counts.shape)} (B, Hkv, S_out)"
            f" for k {tuple(k.shape)}"
        )


def merge_kv_triton(
    k: Tensor, v: Tensor, assign: Tensor, counts: Tensor, strategy: str = "scatter"
) -> tuple[Tensor, Tensor]:
    """Triton version of ``merge_kv_reference``.

    k, v: (B, Hkv, S, D) one float dtype. assign: (B, Hkv, S) int32/int64 target slot or -1.
    counts: (B, Hkv, S_out) int32/int64. strategy: "scatter" (atomics, two launches) or "scan" (one launch).
    Returns k_out, v_out: (B, Hkv, S_out, D) in k's dtype.
    """
    _check(k, v, assign, counts)
    batch, kv_heads, num_src, dim = k.shape
    num_out = counts.shape[-1]
    block_d = max(16, triton.next_power_of_2(dim))
    k_out = torch.empty(batch, kv_heads, num_out, dim, dtype=k.dtype, device=k.device)
    v_out = torch.empty_like(k_out)
    if strategy == "scan":
        block_t = 32
        merge_scan_kernel[(batch * kv_heads, triton.cdiv(max(num_out, 1), block_t))](
            k, v, assign, counts, k_out, v_out,
            *k.stride(), *v.stride(), *assign.stride(), *counts.stride(), *k_out.stride(), *v_out.stride(),
            kv_heads, num_src, num_out, dim,
            IEEE=dot_in_fp32(k.dtype), BLOCK_T=block_t, BLOCK_S=32, BLOCK_D=block_d,
        )  # fmt: skip
        return k_out, v_out
    if strategy != "scatter":
        raise ValueError(f"strategy must be 'scatter' or 'scan', got {strategy!r}")
    block_s, block_t = 32, 32
    for x, out in ((k, k_out), (v, v_out)):
        acc = torch.zeros(batch * kv_heads, num_out, dim, dtype=torch.float32, device=k.device)
        merge_scatter_kernel[(batch * kv_heads, triton.cdiv(max(num_src, 1), block_s))](
            x, assign, acc, *x.stride(), *assign.stride(), kv_heads, num_src, num_out, dim,
            BLOCK_S=block_s, BLOCK_D=block_d,
        )  # fmt: skip
        merge_finalize_kernel[(batch * kv_heads, triton.cdiv(max(num_out, 1), block_t))](
            acc, counts, out, *counts.stride(), *out.stride(), kv_heads, num_out, dim,
            BLOCK_T=block_t, BLOCK_D=block_d,
        )  # fmt: skip
    return k_out, v_out
