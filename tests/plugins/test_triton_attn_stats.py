"""Triton attention statistics (three-launch A.3 kernels, fused kernel, AOT entry) == reference."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import BIG_STATS_CASE, DTYPES, STATS_CASES, STATS_TOL, StatsCase, assert_close_tol
from vlkv.plugins.reference import attn_stats_reference, resolve_lengths

triton_attn_stats = pytest.importorskip("vlkv.plugins.triton_attn_stats", reason="triton is not installed")
kernels = pytest.importorskip("vlkv.plugins.attn_stats_kernels", reason="triton is not installed")


def check(case: StatsCase, dtype: torch.dtype, fused: bool) -> None:
    args = case.make(dtype)
    got = triton_attn_stats.attn_stats_triton(**args, fused=fused)
    ref = attn_stats_reference(**args)
    assert_close_tol(got.colsum, ref.colsum, STATS_TOL, dtype)
    torch.testing.assert_close(got.below, ref.below, rtol=0, atol=0)
    torch.testing.assert_close(got.visible, ref.visible, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["a3", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", STATS_CASES, ids=repr)
def test_attn_stats_kernel_matches_reference(case, dtype, fused):
    check(case, dtype, fused)


def test_attn_stats_kernel_729_keys_fp32():
    check(BIG_STATS_CASE, torch.float32, fused=False)


def test_attn_stats_kernel_without_threshold():
    q, k = torch.randn(2, 4, 3, 16, dtype=torch.float16), torch.randn(2, 2, 9, 16, dtype=torch.float16)
    got = triton_attn_stats.attn_stats_triton(q, k, 0.25)
    assert got.below is None
    torch.testing.assert_close(got.colsum, attn_stats_reference(q, k, 0.25).colsum, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_attn_stats_aot_entry_matches_reference(dtype):
    """The kernel TensorRT bakes: contiguous tensors, int64 masks, QDP argument order."""
    case = STATS_CASES[2]
    args = case.make(dtype)
    q, k = args["q"], args["k"]
    batch, heads, num_q, dim = q.shape
    klen, qoff = resolve_lengths(batch, num_q, k.shape[2], args["key_lengths"], args["q_offset"], q.device)
    colsum = torch.empty(batch, heads, k.shape[2])
    below = torch.empty(batch, heads, dtype=torch.int64)
    visible = torch.empty_like(below)
    kernels.attn_stats_aot_kernel[(batch * heads,)](
        q, k, args["query_rows"].long(), klen, qoff, heads, k.shape[1], num_q, k.shape[2], dim,
        colsum, below, visible,
        SCALE=args["scale"], THRESHOLD=args["threshold"], CAUSAL=True, HAS_THRESHOLD=True,
        IEEE=dtype == torch.float32, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
    )  # fmt: skip
    ref = attn_stats_reference(**args)
    assert_close_tol(colsum, ref.colsum, STATS_TOL, dtype)
    assert torch.equal(below, ref.below) and torch.equal(visible, ref.visible)


def test_attn_stats_kernel_rejects_integer_inputs():
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        triton_attn_stats.attn_stats_triton(
            torch.ones(1, 1, 1, 4, dtype=torch.int32), torch.ones(1, 1, 1, 4), 1.0
        )
