"""Triton segment mean of K/V rows into target slots (token merging).

Two strategies:
- scatter (default at runtime): each source row is atomically added into a float32 workspace, then a
  second launch divides by the counts and casts. O(S * D) work; summation order is not fixed.
- scan (single launch, used by the TensorRT AOT plugin, which cannot zero a workspace): each program
  owns a tile of targets and sweeps all sources, summing them with a one-hot tl.dot. O(S * S_out * D)
  work on tensor cores, deterministic, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_scatter_kernel(
    x_ptr, assign_ptr, acc_ptr,
    sxb, sxh, sxn, sxd, sab, sah, san,
    HKV, S, S_OUT, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bk = tl.program_id(0)
    b = (pid_bk // HKV).to(tl.int64)
    h = (pid_bk % HKV).to(tl.int64)
    src = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    tgt = tl.load(assign_ptr + b * sab + h * sah + src * san, mask=src < S, other=-1).to(tl.int64)
    keep = (tgt >= 0)[:, None] & (dims[None, :] < D)
    x = tl.load(x_ptr + b * sxb + h * sxh + src[:, None] * sxn + dims[None, :] * sxd, mask=keep, other=0.0)
    dest = acc_ptr + (pid_bk.to(tl.int64) * S_OUT + tgt)[:, None] * D + dims[None, :]
    tl.atomic_add(dest, x.to(tl.float32), mask=keep)


@triton.jit
def merge_finalize_kernel(
    acc_ptr, counts_ptr, out_ptr,
    scb, sch, scn, sob, soh, son, sod,
    HKV, S_OUT, D,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bk = tl.program_id(0)
    b = (pid_bk // HKV).to(tl.int64)
    h = (pid_bk % HKV).to(tl.int64)
    tgt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    tile = (tgt[:, None] < S_OUT) & (dims[None, :] < D)
    acc = tl.load(
        acc_ptr + (pid_bk.to(tl.int64) * S_OUT + tgt)[:, None] * D + dims[None, :], mask=tile, other=0.0
    )
    cnt = tl.load(counts_ptr + b * scb + h * sch + tgt * scn, mask=tgt < S_OUT, other=0).to(tl.float32)
    mean = tl.where(cnt[:, None] > 0, acc / tl.maximum(cnt, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * sob + h * soh + tgt[:, None] * son + dims[None, :] * sod, mean, mask=tile)


@triton.jit
def _merge_scan(
    k_ptr, v_ptr, assign_ptr, counts_ptr, k_out_ptr, v_out_ptr,
    skb, skh, skn, skd, svb, svh, svn, svd, sab, sah, san, scb, sch, scn,
    sokb, sokh, sokn, sokd, sovb, sovh, sovn, sovd,
    HKV, S, S_OUT, D,
    IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bk = tl.program_id(0)
    b = (pid_bk // HKV).to(tl.int64)
    h = (pid_bk % HKV).to(tl.int64)
    tgt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    acc_k = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    acc_v = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        src = s0 + tl.arange(0, BLOCK_S)
        assign = tl.load(assign_ptr + b * sab + h * sah + src * san, mask=src < S, other=-1).to(tl.int64)
        onehot = assign[None, :] == tgt[:, None]
        rows = (src[:, None] < S) & (dims[None, :] < D)
        k = tl.load(
            k_ptr + b * skb + h * skh + src[:, None] * skn + dims[None, :] * skd, mask=rows, other=0.0
        )
        v = tl.load(
            v_ptr + b * svb + h * svh + src[:, None] * svn + dims[None, :] * svd, mask=rows, other=0.0
        )
        # A one-hot row times the sources is an exact sum: products are x * 1 or x * 0.
        if IEEE:
            sel = onehot.to(tl.float32)
            acc_k += tl.dot(sel, k.to(tl.float32), input_precision="ieee")
            acc_v += tl.dot(sel, v.to(tl.float32), input_precision="ieee")
        else:
            acc_k += tl.dot(onehot.to(k.dtype), k)
            acc_v += tl.dot(onehot.to(v.dtype), v)
    cnt = tl.load(counts_ptr + b * scb + h * sch + tgt * scn, mask=tgt < S_OUT, other=0).to(tl.float32)
    inv = tl.where(cnt > 0, 1.0 / tl.maximum(cnt, 1.0), 0.0)[:, None]
    tile = (tgt[:, None] < S_OUT) & (dims[None, :] < D)
    tl.store(
        k_out_ptr + b * sokb + h * sokh + tgt[:, None] * sokn + dims[None, :] * sokd, acc_k * inv, mask=tile
    )
    tl.store(
        v_out_ptr + b * sovb + h * sovh + tgt[:, None] * sovn + dims[None, :] * sovd, acc_v * inv, mask=tile
    )


@triton.jit
def merge_scan_kernel(
    k_ptr, v_ptr, assign_ptr, counts_ptr, k_out_ptr, v_out_ptr,
    skb, skh, skn, skd, svb, svh, svn, svd, sab, sah, san, scb, sch, scn,
    sokb, sokh, sokn, sokd, sovb, sovh, sovn, sovd,
    HKV, S, S_OUT, D,
    IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _merge_scan(
        k_ptr, v_ptr, assign_ptr, counts_ptr, k_out_ptr, v_out_ptr,
        skb, skh, skn, skd, svb, svh, svn, svd, sab, sah, san, scb, sch, scn,
        sokb, sokh, sokn, sokd, sovb, sovh, sovn, sovd, HKV, S, S_OUT, D,
        IEEE, BLOCK_T, BLOCK_S, BLOCK_D,
    )  # fmt: skip


@triton.jit
def merge_kv_aot_kernel(
    k_ptr, v_ptr, assign_ptr, counts_ptr,
    HKV, S, S_OUT, D,
    k_out_ptr, v_out_ptr,
    IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """TensorRT AOT entry: inputs, int32 shape scalars, outputs (the QDP argument order).

    Tensors are contiguous: k/v (B, HKV, S, D), assign (B, HKV, S) int64, counts (B, HKV, S_OUT) int64;
    k_out/v_out (B, HKV, S_OUT, D). Grid: (B * HKV, cdiv(S_OUT, BLOCK_T)).
    """
    _merge_scan(
        k_ptr, v_ptr, assign_ptr, counts_ptr, k_out_ptr, v_out_ptr,
        HKV * S * D, S * D, D, 1, HKV * S * D, S * D, D, 1, HKV * S, S, 1, HKV * S_OUT, S_OUT, 1,
        HKV * S_OUT * D, S_OUT * D, D, 1, HKV * S_OUT * D, S_OUT * D, D, 1, HKV, S, S_OUT, D,
        IEEE, BLOCK_T, BLOCK_S, BLOCK_D,
    )  # fmt: skip
