"""The device path's decoder-layer glue kernels (``triton_glue``) == their PyTorch references
(``glue_reference``), fp32/fp16/bf16, sizes across block edges, strided rows; under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins.glue_reference import (
    add_rms_norm_reference,
    pool_write_reference,
    rms_norm_reference,
    rope_reference,
    silu_mul_reference,
)

glue = pytest.importorskip("vlkv.plugins.triton_glue", reason="triton is not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the norm sums in another order than torch's mean: fp32 ~1e-6; a half result may round one ulp apart
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 9), (4, 64), (3, 81), (2, 729)])
def test_rms_norm_matches_reference(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    close(glue.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 9), (4, 64), (2, 729)])
def test_add_rms_norm_matches_reference_and_strided_rows(rows, n, dtype):
    g = torch.Generator().manual_seed(7 + n)
    wide = torch.randn(rows, n + 5, generator=g).to(dtype)
    x = wide[:, 2 : 2 + n]  # a row stride wider than the row
    res = torch.randn(rows, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    total, out = glue.add_rms_norm(x, res, w, 1e-5)
    want_total, want = add_rms_norm_reference(x, res, w, 1e-5)
    if dtype == torch.bfloat16:  # the interpreter's fp32 -> bf16 cast is not round-to-nearest
        close(total, want_total, dtype)
    else:
        assert torch.equal(total, want_total)  # the add rounds as torch's does
    close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,q,heads,kv,d", [(4, 1, 4, 2, 16), (2, 3, 3, 1, 8), (1, 1, 9, 9, 128)])
def test_rope_in_place_matches_reference(b, q, heads, kv, d, dtype):
    g = torch.Generator().manual_seed(heads * d)
    x = torch.randn(b * q, heads + 2 * kv, d, generator=g).to(dtype)
    pos = torch.rand(b, q, d // 2, generator=g) * 50
    ang = torch.cat([pos, pos], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    want = rope_reference(x, cos, sin, heads + kv)
    got = glue.rope_(x, cos, sin, heads + kv)
    assert got.data_ptr() == x.data_ptr()
    close(got, want, dtype)
    assert torch.equal(got[:, heads + kv :], want[:, heads + kv :])  # the v heads untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 9), (4, 81), (2, 1500)])
def test_silu_mul_matches_reference(rows, n, dtype):
    g = torch.Generator().manual_seed(n)
    gu = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    close(glue.silu_mul(gu), silu_mul_reference(gu), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("run", [True, False], ids=["run", "per-head"])
def test_pool_write_matches_reference(dtype, run):
    g = torch.Generator().manual_seed(3)
    b, heads, d, s = 4, 2, 16, 40
    k_pool, v_pool = (
        torch.randn(heads, s, d, generator=g).to(dtype),
        torch.randn(heads, s, d, generator=g).to(dtype),
    )
    prerope = torch.rand(heads, s, generator=g) < 0.5
    qkv = torch.randn(b, 6, 1, d, generator=g).to(dtype)
    k, v = qkv[:, 2:4], qkv[:, 4:6]  # views of a fused q/k/v row, as the device layer hands them
    if run:  # one id per request, the same in every head
        ids = torch.tensor([3, 17, 8, 39]).expand(heads, b)
    else:
        ids = torch.randperm(s, generator=g)[: heads * b].view(heads, b)
    want = pool_write_reference(k_pool, v_pool, prerope, ids, k, v)
    glue.pool_write_(k_pool, v_pool, prerope, ids, k, v)
    for got, w in zip((k_pool, v_pool, prerope), want):
        assert torch.equal(got, w)


def test_bad_shapes_name_the_problem():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="rows, N"):
        glue.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="do not match"):
        glue.rope_(x.view(6, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8), 1)
    with pytest.raises(ValueError, match="must match"):
        glue.add_rms_norm(torch.ones(2, 8), torch.ones(2, 9), torch.ones(8), 1e-6)
