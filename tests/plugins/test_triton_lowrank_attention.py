"""Triton rank-space decode attention (AttentionPack path (b)) == its PyTorch reference.

Sizes hit the block edges: factor rows and dense entries at 1, at BLOCK_N ± 1 and past two blocks;
ranks below, at and above 16 (the smallest dot tile) and different for K and V; GQA groups of 1, 3 and
more than one row tile; samples with no factored rows, no dense entries, or neither.
"""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, LOWRANK_CASES, OUT_TOL, LowRankCase, assert_close_tol
from vlkv.plugins.lowrank_reference import lowrank_decode_attention
from vlkv.plugins.triton_launch import dot_in_fp32

tla = pytest.importorskip("vlkv.plugins.triton_lowrank_attention", reason="triton is not installed")
kernels = pytest.importorskip("vlkv.plugins.lowrank_attention_kernels", reason="triton is not installed")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LOWRANK_CASES, ids=repr)
def test_lowrank_kernel_matches_reference(case, dtype):
    args = case.make(dtype, seed=len(case.rows) + case.dim)
    got = tla.lowrank_attention_triton(**args)
    want = lowrank_decode_attention(**args)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got.float()).all()
    assert_close_tol(got, want, OUT_TOL, dtype)


def test_lowrank_kernel_nothing_visible_gives_zeros():
    args = LowRankCase(2, 2, 2, 16, (0, 3), (0, 2), 4, 4).make(torch.float32)
    got = tla.lowrank_attention_triton(**args)
    assert torch.all(got[0] == 0) and got[1].abs().sum() > 0
    assert_close_tol(got, lowrank_decode_attention(**args), OUT_TOL, torch.float32)


def test_lowrank_kernel_reads_strided_views():
    """A transposed q and a slice of a larger dense cache are read in place through their strides."""
    case = LOWRANK_CASES[1]
    args = case.make(torch.float16)
    args["q"] = args["q"].transpose(0, 1).contiguous().transpose(0, 1)
    big = torch.randn(2, 2, 80, 16, dtype=torch.float16)
    args["k"] = big[:, :, 7 : 7 + args["k"].shape[2]]
    got = tla.lowrank_attention_triton(**args)
    assert_close_tol(got, lowrank_decode_attention(**args), OUT_TOL, torch.float16)


def test_lowrank_kernel_exact_factors_equal_dense_attention():
    """With full-rank exact factors the rank-space result equals plain attention over dense K/V."""
    g = torch.Generator().manual_seed(3)
    b, hkv, grp, d, t = 1, 2, 2, 16, 20
    kd, vd = torch.randn(b, t, hkv * d, generator=g), torch.randn(b, t, hkv * d, generator=g)
    eye = torch.eye(hkv * d).expand(b, -1, -1).contiguous()
    q = torch.randn(b, hkv * grp, d, generator=g)
    empty = torch.zeros(b, hkv, 1, d)
    got = tla.lowrank_attention_triton(
        q, kd, eye, vd, eye, torch.tensor([t]), empty, empty, torch.tensor([0])
    )
    k = kd.view(b, t, hkv, d).transpose(1, 2).repeat_interleave(grp, 1)
    v = vd.view(b, t, hkv, d).transpose(1, 2).repeat_interleave(grp, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lowrank_kernel_refuses_mismatched_factors():
    args = LOWRANK_CASES[1].make(torch.float32)
    args["dk"] = args["dk"][:, :, :-1]
    with pytest.raises(ValueError, match="factor shapes disagree"):
        tla.lowrank_attention_triton(**args)
    args = LOWRANK_CASES[1].make(torch.float32)
    args["vbar"] = args["vbar"].half()
    with pytest.raises(ValueError, match="vbar must have q's dtype"):
        tla.lowrank_attention_triton(**args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lowrank_aot_entry_matches_reference(dtype):
    case = LOWRANK_CASES[2]
    args = case.make(dtype)
    q = args["q"]
    out = torch.empty_like(q)
    t, s = args["kbar"].shape[1], args["k"].shape[2]
    kernels.lowrank_attention_aot_kernel[(case.batch * case.kv_heads, 1)](
        q, args["kbar"], args["dk"], args["vbar"], args["dv"], args["rows"], args["k"], args["v"],
        args["dense_len"], q.shape[1], case.kv_heads, t, s, case.dim, case.rank_k, case.rank_v, out,
        SCALE=case.dim**-0.5, IEEE=dot_in_fp32(dtype), BLOCK_M=16, BLOCK_N=64, BLOCK_D=32,
        BLOCK_RK=16, BLOCK_RV=16,
    )  # fmt: skip
    assert_close_tol(out, lowrank_decode_attention(**args), OUT_TOL, dtype)
