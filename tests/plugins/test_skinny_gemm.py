"""The few-row C++ GEMM (``vlkv/plugins/skinny_gemm.py``) against ``F.linear``.

What must hold: ``y = x @ Wᵀ (+ b)`` equals ``F.linear`` within fp32 rounding (it sums each dot product
in another order) for 1-8 rows over shapes that hit its blocks' edges (odd K: the scalar tail; N not a
multiple of its weight-row block: the one-row tail); inputs it cannot take are refused with one line
(raw kernel) or routed to torch (``fits`` False); without a compiler it warns once and ``fits`` is False;
``VLKV_CPU_GEMM`` switches it; its session-7 form (the benchmarks' before) gives the same bits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import vlkv.plugins.skinny_gemm as gemm
from tests.conftest import switch_values

# fp32 rounding of a reordered sum of K ≤ 1,537 unit-normal products (|y| ~ sqrt(K) ≈ 40)
TOL = {"rtol": 1e-5, "atol": 5e-4}
SHAPES = [(1, 1), (7, 15), (9, 16), (33, 17), (96, 40), (192, 576), (576, 577), (81, 1537)]


@pytest.fixture(autouse=True)
def _built():
    if gemm.kernel() is None:  # a C++ compiler is part of the CPU test environment
        pytest.fail("the skinny GEMM could not be built here")


@pytest.mark.parametrize("rows", range(1, gemm.MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(rows, n, k, bias):
    torch.manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    got = gemm.kernel().gemm(x, w, b)
    assert got.shape == (rows, n) and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), **TOL)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_sums_alike(n, k, bias):
    """1-2 rows stream the weight row after row, 3-8 rows read it in register blocks of weight rows:
    each output is still one vector accumulator over K in order, so a row's result does not depend on
    how many rows share the call (bit for bit)."""
    torch.manual_seed(n + k)
    x, w = torch.randn(gemm.MAX_ROWS, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    mod = gemm.kernel()
    alone = torch.cat([mod.gemm(x[r : r + 1].contiguous(), w, b) for r in range(gemm.MAX_ROWS)])
    for rows in range(2, gemm.MAX_ROWS + 1):
        assert torch.equal(mod.gemm(x[:rows].contiguous(), w, b), alone[:rows]), rows


@pytest.mark.parametrize("rows", range(1, gemm.MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", [(37, 100), (576, 577), (4099, 576), (576, 1536), (3, 7), (37, 8960)])
@pytest.mark.parametrize("form", [1, 2])
def test_earlier_forms_give_the_same_bits(form, rows, n, k):
    """The kernel's forms — one weight row at a time (1-4 rows) or two (5-8), lines 8 KiB ahead into L2
    where the weight is larger than that, 4 rows per block where x exceeds 32 KiB at 3-4 rows (K = 8,960)
    — against session 7's (``set_gemm_form(1)``) and session 8's (``2``: two weight rows per block at
    3-8 rows, lines into L1), the benchmarks' befores: each output is one vector accumulator over K in
    order either way, so the bits are equal."""
    torch.manual_seed(rows + n + k)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    mod = gemm.kernel()
    try:
        mod.set_gemm_form(0)
        now = mod.gemm(x, w, b)
        mod.set_gemm_form(form)
        before = mod.gemm(x, w, b)
    finally:
        mod.set_gemm_form(gemm.default_form())
    assert torch.equal(now, before)
    torch.testing.assert_close(now, F.linear(x, w, b), **TOL)


ZEN = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: 17\n"


def test_each_cpu_kind_starts_with_its_measured_form(monkeypatch):
    """Zen 5 (AMD family 26) starts with session 8's form, which decoded faster there; Zen 4 (25), other
    vendors and an unreadable cpuinfo with form 0; ``VLKV_GEMM_FORM`` overrides, a bad value is one line."""
    monkeypatch.delenv(gemm.FORM_ENV, raising=False)
    assert gemm.default_form(ZEN.format(26)) == 2
    assert gemm.default_form(ZEN.format(25)) == 0
    assert gemm.default_form("vendor_id\t: GenuineIntel\ncpu family\t: 6\n") == 0
    assert gemm.default_form("") == 0
    monkeypatch.setenv(gemm.FORM_ENV, "1")
    assert gemm.default_form(ZEN.format(26)) == 1
    monkeypatch.setenv(gemm.FORM_ENV, "fast")
    with pytest.raises(ValueError, match="VLKV_GEMM_FORM must be 0, 1 or 2, got 'fast'"):
        gemm.default_form(ZEN.format(26))


def test_the_form_switch_takes_three_forms():
    with pytest.raises(
        RuntimeError,
        match=r"set_gemm_form: 0 \(current\), 1 \(session 7's blocks\) or 2 \(session 8's\), got 3",
    ):
        gemm.kernel().set_gemm_form(3)


def test_max_rows_is_the_kernels_row_limit():
    """One source of truth: the C++ text's row limit is ``MAX_ROWS`` (the decode layer compiles it too)."""
    assert gemm._KERNELS.startswith(f"#define VLKV_MAX_ROWS {gemm.MAX_ROWS}\n")
    with pytest.raises(RuntimeError, match=f"1 <= R <= {gemm.MAX_ROWS} rows"):
        gemm.kernel().gemm(torch.randn(gemm.MAX_ROWS + 1, 40), torch.randn(50, 40), None)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_split_output_rows_exactly(threads):
    """Each output row is one thread's dot product: the result is the same bits at any thread count."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 576), torch.randn(4099, 576)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.kernel().gemm(x, w, None)
        torch.set_num_threads(threads)
        assert torch.equal(gemm.kernel().gemm(x, w, None), one)
    finally:
        torch.set_num_threads(was)
    torch.testing.assert_close(one, F.linear(x, w), **TOL)


def test_linear_takes_any_layout_of_x_and_leading_dims():
    torch.manual_seed(1)
    w, b = torch.randn(50, 40), torch.randn(50)
    x = torch.randn(40, 6).t().reshape(3, 2, 40)  # not row-major: made so (a few rows)
    assert gemm.fits(x, w, 6)
    got = gemm.linear(x, w, b)
    assert got.shape == (3, 2, 50) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), **TOL)


def test_the_raw_kernel_refuses_what_it_cannot_read():
    k = gemm.kernel()
    x, w = torch.randn(4, 40), torch.randn(50, 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        k.gemm(x, torch.randn(40, 50).t(), None)  # a transposed weight
    with pytest.raises(RuntimeError, match="contiguous"):
        k.gemm(torch.randn(40, 4).t(), w, None)
    with pytest.raises(RuntimeError, match="1 <= R <= 8"):
        k.gemm(torch.randn(9, 40), w, None)
    with pytest.raises(RuntimeError, match="float32"):
        k.gemm(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match="bias"):
        k.gemm(x, w, torch.randn(49))


def test_fits_routes_the_rest_to_torch(monkeypatch):
    x, w = torch.randn(4, 40), torch.randn(50, 40)
    assert gemm.fits(x, w, 4)
    assert not gemm.fits(torch.randn(9, 40), w, 9)  # more rows than its registers hold
    assert not gemm.fits(x, torch.randn(40, 50).t(), 4)  # a transposed weight
    assert not gemm.fits(x.bfloat16(), w.bfloat16(), 4)  # fp32 only
    assert not gemm.fits(x, w, 4, torch.randn(50).double())  # the bias too
    assert gemm.fits(x, w, 4, torch.randn(50))
    assert not gemm.fits(x.requires_grad_(), w, 4)  # no backward: gradients take F.linear
    with torch.no_grad():
        assert gemm.fits(x, w, 4)
    monkeypatch.setattr(gemm, "CPP_GEMM", False)
    assert not gemm.fits(x.detach(), w, 4)


def test_no_compiler_warns_once_and_keeps_torch(monkeypatch):
    import torch.utils.cpp_extension as ext

    def fail(*args, **kwargs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(ext, "load_inline", fail)
    monkeypatch.setattr(gemm, "_BUILT", [])  # as in a fresh process: nothing tried yet
    x, w = torch.randn(4, 40), torch.randn(50, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gemm.warm_up("cpu", torch.float32) is False
        assert not gemm.fits(x, w, 4)
        assert not gemm.fits(x, w, 2)
    assert [str(w.message) for w in caught] == ["skinny CPU GEMM not built (OSError): using torch's matmuls"]


def test_warm_up_only_for_cpu_fp32(monkeypatch):
    assert gemm.warm_up("cpu", torch.float32) is True
    assert gemm.warm_up("cpu", torch.bfloat16) is False
    assert gemm.warm_up("meta", torch.float32) is False
    monkeypatch.setattr(gemm, "CPP_GEMM", False)
    assert gemm.warm_up("cpu", torch.float32) is False


@pytest.fixture(scope="module")
def gemm_switch() -> dict:
    """``CPP_GEMM`` after a fresh import under each value of ``VLKV_CPU_GEMM`` (one torch import for all)."""
    return switch_values("vlkv.plugins.skinny_gemm", "CPP_GEMM", "VLKV_CPU_GEMM", [None, "0", "1", "maybe"])


@pytest.mark.parametrize("env,on", [(None, True), ("0", False), ("1", True), ("maybe", None)])
def test_the_environment_switches_the_kernel(env, on, gemm_switch):
    if on is None:
        got = gemm_switch[env]  # the import refuses the value
        assert got.startswith("raised ") and "VLKV_CPU_GEMM must be 0 or 1, got 'maybe'" in got, got
    else:
        assert gemm_switch[env] == str(on)
