"""Dispatch between the Triton kernels and the references, and the cheap package import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.plugins.cases import MERGE_CASES, OUT_TOL, SELECT_CASES, STATS_CASES, STATS_TOL, assert_close_tol
from vlkv.plugins import ops
from vlkv.plugins.reference import attn_stats_reference, merge_kv_reference, selected_attention_reference


def test_import_vlkv_plugins_is_cheap():
    code = (
        "import sys, vlkv.plugins as p; "
        "assert 'triton' not in sys.modules and 'torch' not in sys.modules, 'eager import'; "
        "assert {'attn_stats', 'merge_kv', 'register_plugins'} <= set(dir(p))"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={"PATH": "", "PYTHONPATH": ":".join(sys.path)}
    )


def test_cpu_tensors_use_reference(monkeypatch):
    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    assert not ops.use_triton(q, k)
    got = ops.attn_stats(q, k, 0.3, threshold=0.1)
    ref = attn_stats_reference(q, k, 0.3, threshold=0.1)
    assert torch.equal(got.colsum, ref.colsum) and torch.equal(got.below, ref.below)


def test_forced_triton_runs_kernels_on_cpu(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv(ops.FORCE_TRITON_ENV, "1")
    dtype = torch.float16
    stats_args = STATS_CASES[1].make(dtype)
    assert ops.use_triton(stats_args["q"])
    got = ops.attn_stats(**stats_args)
    assert_close_tol(got.colsum, attn_stats_reference(**stats_args).colsum, STATS_TOL, dtype)
    sel_args = SELECT_CASES[1].make(dtype)
    assert_close_tol(
        ops.selected_attention(**sel_args), selected_attention_reference(**sel_args), OUT_TOL, dtype
    )
    merge_args = MERGE_CASES[1].make(dtype)
    for got_t, ref_t in zip(ops.merge_kv(**merge_args), merge_kv_reference(**merge_args)):
        assert_close_tol(got_t, ref_t, OUT_TOL, dtype)


def test_forced_triton_without_triton_says_so(monkeypatch):
    monkeypatch.setenv(ops.FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        ops.use_triton(torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_dispatch_matches_reference(dtype, monkeypatch):
    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    stats_args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in STATS_CASES[2].make(dtype).items()}
    assert ops.use_triton(stats_args["q"])
    got = ops.attn_stats(**stats_args)
    ref = attn_stats_reference(**stats_args)
    assert_close_tol(got.colsum, ref.colsum, STATS_TOL, dtype)
    sel_args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in SELECT_CASES[2].make(dtype).items()}
    assert_close_tol(
        ops.selected_attention(**sel_args), selected_attention_reference(**sel_args), OUT_TOL, dtype
    )
