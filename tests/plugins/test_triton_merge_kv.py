"""Triton K/V merging (atomic scatter, one-launch scan, AOT entry) == reference."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import BIG_MERGE_CASE, DTYPES, MERGE_CASES, OUT_TOL, assert_close_tol
from vlkv.plugins.reference import merge_kv_reference

tmk = pytest.importorskip("vlkv.plugins.triton_merge_kv", reason="triton is not installed")
kernels = pytest.importorskip("vlkv.plugins.merge_kv_kernels", reason="triton is not installed")


@pytest.mark.parametrize("strategy", ["scatter", "scan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MERGE_CASES, ids=repr)
def test_merge_kv_kernel_matches_reference(case, dtype, strategy):
    args = case.make(dtype)
    k_out, v_out = tmk.merge_kv_triton(**args, strategy=strategy)
    k_ref, v_ref = merge_kv_reference(**args)
    assert k_out.dtype == dtype and k_out.shape == k_ref.shape
    assert_close_tol(k_out, k_ref, OUT_TOL, dtype)
    assert_close_tol(v_out, v_ref, OUT_TOL, dtype)
    assert torch.all(k_out[args["counts"] == 0] == 0)


def test_merge_kv_kernel_729_keys_fp32():
    args = BIG_MERGE_CASE.make(torch.float32)
    for got, ref in zip(tmk.merge_kv_triton(**args), merge_kv_reference(**args)):
        assert_close_tol(got, ref, OUT_TOL, torch.float32)


def test_merge_kv_aot_entry_matches_reference():
    case = MERGE_CASES[2]
    args = case.make(torch.float16)
    k_out = torch.empty(case.batch, case.kv_heads, case.targets, case.dim, dtype=torch.float16)
    v_out = torch.empty_like(k_out)
    kernels.merge_kv_aot_kernel[(case.batch * case.kv_heads, -(-case.targets // 32))](
        args["k"], args["v"], args["assign"], args["counts"], case.kv_heads, case.keys, case.targets, case.dim,
        k_out, v_out, IEEE=False, BLOCK_T=32, BLOCK_S=32, BLOCK_D=64,
    )  # fmt: skip
    k_ref, v_ref = merge_kv_reference(**args)
    assert_close_tol(k_out, k_ref, OUT_TOL, torch.float16)
    assert_close_tol(v_out, v_ref, OUT_TOL, torch.float16)


def test_merge_kv_kernel_rejects_bad_strategy_and_shapes():
    args = MERGE_CASES[1].make(torch.float32)
    with pytest.raises(ValueError, match="strategy"):
        tmk.merge_kv_triton(**args, strategy="sort")
    with pytest.raises(ValueError, match="assign"):
        tmk.merge_kv_triton(args["k"], args["v"], args["assign"][..., :-1], args["counts"])
