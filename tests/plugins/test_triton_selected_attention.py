"""Triton selected attention (single launch, split + combine, AOT entry) == reference."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import BIG_SELECT_CASE, DTYPES, OUT_TOL, SELECT_CASES, assert_close_tol
from vlkv.plugins.reference import selected_attention_reference
from vlkv.plugins.triton_launch import dot_in_fp32

tsa = pytest.importorskip("vlkv.plugins.triton_selected_attention", reason="triton is not installed")
kernels = pytest.importorskip("vlkv.plugins.selected_attention_kernels", reason="triton is not installed")


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SELECT_CASES, ids=repr)
def test_selected_attention_kernel_matches_reference(case, dtype, num_splits):
    args = case.make(dtype)
    got = tsa.selected_attention_triton(**args, num_splits=num_splits)
    assert got.dtype == dtype
    assert_close_tol(got, selected_attention_reference(**args), OUT_TOL, dtype)
    # (sample 0, KV head 0) selects nothing: its query heads must be exactly zero.
    group = case.heads // case.kv_heads
    assert torch.all(got[0, :group] == 0)


def test_selected_attention_kernel_729_keys_auto_splits_fp32():
    args = BIG_SELECT_CASE.make(torch.float32)
    assert (
        tsa.default_num_splits(args["q"].shape[0] * BIG_SELECT_CASE.kv_heads, BIG_SELECT_CASE.selected, 64)
        > 1
    )
    got = tsa.selected_attention_triton(**args)
    assert_close_tol(got, selected_attention_reference(**args), OUT_TOL, torch.float32)


def test_selected_attention_kernel_reads_strided_views():
    """Transposed (non-contiguous) q and a K/V cache slice are read in place through their strides."""
    args = SELECT_CASES[1].make(torch.float16)
    args["q"] = args["q"].transpose(1, 2).contiguous().transpose(1, 2)
    big_k = torch.randn(2, 2, 20, 8, dtype=torch.float16)
    args["k"] = big_k[:, :, 3:12]
    got = tsa.selected_attention_triton(**args, num_splits=1)
    assert_close_tol(got, selected_attention_reference(**args), OUT_TOL, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_selected_attention_aot_entry_matches_reference(dtype):
    case = SELECT_CASES[2]
    args = case.make(dtype)
    q, k, v = args["q"], args["k"], args["v"]
    out = torch.empty_like(q)
    rows = (case.heads // case.kv_heads) * case.queries
    kernels.selected_attention_aot_kernel[(case.batch * case.kv_heads, -(-rows // 16))](
        q, k, v, args["indices"], args["lengths"],
        case.heads, case.kv_heads, case.queries, case.keys, case.dim, case.selected, out,
        SCALE=args["scale"], IEEE=dot_in_fp32(dtype), BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
    )  # fmt: skip
    assert_close_tol(out, selected_attention_reference(**args), OUT_TOL, dtype)
