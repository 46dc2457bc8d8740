"""PyTorch launcher for the kernels in ``selected_attention_kernels.py`` (see that module for the algorithm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from vlkv.plugins.flash_tiles import combine_splits_kernel
from vlkv.plugins.reference import check_gqa
from vlkv.plugins.selected_attention_kernels import selected_attention_kernel
from vlkv.plugins.triton_launch import check_float_dtype, dot_in_fp32


def tile_sizes(group_rows: int, head_dim: int, value_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV); tl.dot needs every tile side >= 16."""
    block_m = min(64, max(16, triton.next_power_of_2(group_rows)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(value_dim))
    return block_m, 32 if max(block_d, block_dv) > 64 else 64, block_d, block_dv


def default_num_splits(programs: int, num_selected: int, block_n: int) -> int:
    """Split the selection until about 256 programs run (two waves on an H100), one key block minimum."""
    return max(1, min(triton.cdiv(256, max(programs, 1)), triton.cdiv(max(num_selected, 1), block_n), 64))


@dataclass(frozen=True)
class SplitPlan:
    """How a flash-decoding kernel (``flash_tiles``) is launched over ``B·H_kv`` (request, KV head) pairs:
    grid ``(B·H_kv, grid_m, num_splits)``, its tile sizes, and the fp32 partial buffers the splits fill
    for ``combine_splits`` (one element each with one split: the kernel then writes the output)."""

    grid: tuple[int, int, int]
    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    part_m: Tensor  # (B·H_kv·num_splits·G·Q,) running max per split and row
    part_l: Tensor  # same shape: running sum
    part_acc: Tensor  # (B·H_kv·num_splits·G·Q·D_v,) accumulator

    @property
    def constexprs(self) -> dict[str, int]:
        """The kernels' launch constexprs: ``NUM_SPLITS`` and the four ``BLOCK_*`` sizes."""
        blocks = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_D": self.block_d}
        return {"NUM_SPLITS": self.grid[2], **blocks, "BLOCK_DV": self.block_dv}


def plan_splits(
    pairs: int, group_rows: int, dim: int, dim_v: int, cols: int, num_splits: int | None, device
) -> SplitPlan:
    """The :class:`SplitPlan` for ``pairs`` (B·H_kv) of ``group_rows`` (G·Q) query rows each over ``cols``
    keys (head dims ``dim``, ``dim_v``); ``num_splits`` None picks one from the launch size."""
    block_m, block_n, block_d, block_dv = tile_sizes(group_rows, dim, dim_v)
    grid_m = triton.cdiv(group_rows, block_m)
    if num_splits is None:
        num_splits = default_num_splits(pairs * grid_m, cols, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    rows = pairs * num_splits * group_rows
    part_m = torch.empty(rows if num_splits > 1 else 1, dtype=torch.float32, device=device)
    part_acc = torch.empty(rows * dim_v if num_splits > 1 else 1, dtype=torch.float32, device=device)
    grid = (pairs, grid_m, num_splits)
    return SplitPlan(grid, block_m, block_n, block_d, block_dv, part_m, torch.empty_like(part_m), part_acc)


def combine_splits(plan: SplitPlan, out: Tensor, kv_heads: int, group: int) -> None:
    """Merge the splits' partial triples into ``out (B, H_q, Q, D_v)`` (nothing to do with one split)."""
    if plan.grid[2] > 1:
        combine_splits_kernel[plan.grid[:2]](
            plan.part_m, plan.part_l, plan.part_acc, out, *out.stride(), kv_heads, group, out.shape[2],
            out.shape[3], NUM_SPLITS=plan.grid[2], BLOCK_M=plan.block_m, BLOCK_DV=plan.block_dv,
        )  # fmt: skip


def selected_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    lengths: Tensor,
    scale: float,
    num_splits: int | None = None,
) -> Tensor:
    """Triton version of ``selected_attention_reference``.

    q: (B, H, Q, D). k: (B, Hkv, S, D), v: (B, Hkv, S, Dv), all one float dtype.
    indices: (B, Hkv, K) int32/int64 slots, valid where position < lengths. lengths: (B, Hkv) int64.
    num_splits: key-list splits per (sample, KV head); None picks one from the launch size.
    Returns (B, H, Q, Dv) in q's dtype.
    """
    check_float_dtype("q", q.dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    group = check_gqa(q, k)
    batch, heads, num_q, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[-1]
    num_sel = indices.shape[-1]
    lengths = lengths.to(device=q.device)
    plan = plan_splits(batch * kv_heads, group * num_q, dim, dim_v, num_sel, num_splits, q.device)
    out = torch.empty(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    selected_attention_kernel[plan.grid](
        q, k, v, indices, lengths, out, plan.part_m, plan.part_l, plan.part_acc,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *lengths.stride(), *out.stride(),
        kv_heads, group, num_q, dim, dim_v, num_sel,
        SCALE=float(scale), IEEE=dot_in_fp32(q.dtype), **plan.constexprs,
    )  # fmt: skip
    combine_splits(plan, out, kv_heads, group)
    return out
