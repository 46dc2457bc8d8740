"""The fused CPU decode kernel as a default: built at engine start, keyed by the CPU, a clean fallback.

What must hold: ``VLKV_CPU_KERNEL`` turns it on or off; where it cannot be built (no compiler) the
build warns once, in one line, and the CPU read runs the matmuls with the reference's result; a CPU
fp32 backend builds (or loads) it when the engine starts, not at its first decode step; another CPU's
flags name another build.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.plugins.paged_cpu_kernel as kernel
import vlkv.plugins.skinny_gemm as skinny_gemm
from tests.conftest import switch_values
from tests.plugins.cases import OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from vlkv.plugins.paged_cpu import paged_attention_cpu
from vlkv.plugins.paged_reference import paged_attention_reference


@pytest.fixture(scope="module")
def kernel_switch() -> dict:
    """``FUSED_KERNEL`` after a fresh import under each value of ``VLKV_CPU_KERNEL`` (one torch import)."""
    return switch_values("vlkv.plugins.paged_cpu", "FUSED_KERNEL", "VLKV_CPU_KERNEL", [None, "0", "1"])


@pytest.mark.parametrize("env,on", [(None, True), ("0", False), ("1", True)], ids=["default", "off", "on"])
def test_the_environment_switches_the_kernel(env, on, kernel_switch):
    assert kernel_switch[env] == str(on)


def test_no_compiler_falls_back_to_the_matmuls_with_one_warning(monkeypatch):
    import torch.utils.cpp_extension as ext

    def fail(*args, **kwargs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(ext, "load_inline", fail)
    monkeypatch.setattr(kernel, "_BUILT", [])  # as in a fresh process: nothing tried yet
    monkeypatch.setattr(skinny_gemm, "_BUILT", [])
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    args = PagedCase(2, 2, 3, 1, 81, 64, layout="holes", runs=2).make(torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert paged_cpu.warm_up("cpu", torch.float32) is False
        got = paged_attention_cpu(**args)
        paged_attention_cpu(**args, inplace_min=1)
    msgs = [str(w.message) for w in caught]
    # each kernel says it once, in one line (warm_up builds the decode layers' GEMM too)
    assert msgs == [
        "skinny CPU GEMM not built (OSError): using torch's matmuls",
        "fused CPU decode kernel not built (OSError): using matmuls",
    ]
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)


def test_a_first_build_says_so_on_stderr_and_a_cached_one_is_silent(monkeypatch, capsys):
    import torch.utils.cpp_extension as ext

    is_cached = kernel._is_cached
    assert is_cached(kernel.build_name() + "_never_built") is False
    monkeypatch.setattr(ext, "load_inline", lambda *a, **k: object())
    for cached, said in ((False, True), (True, False)):
        monkeypatch.setattr(kernel, "_BUILT", [])
        monkeypatch.setattr(kernel, "_is_cached", lambda name, c=cached: c)
        assert kernel.kernel() is not None
        err = capsys.readouterr().err
        assert ("building the fused CPU decode kernel" in err) is said, err


def test_a_cpu_fp32_engine_builds_the_kernel_at_start(engines, monkeypatch):
    from vlkv.runtime.torch_backend import TorchBackend

    calls = []
    monkeypatch.setattr(kernel, "kernel", lambda: calls.append(1) or object())
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    be = engines["tiny-llava"].backend
    fresh = TorchBackend(be.model, be.adapter.family, be.adapter.image_token_id)
    assert fresh.fused_cpu_read and calls == [1]  # the decode append is in the same extension
    assert paged_cpu.warm_up("cpu", torch.bfloat16) is False and calls == [1]  # not for a bf16 model
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    assert paged_cpu.warm_up("cpu", torch.float32) is False and calls == [1]  # off: nothing built


def test_the_read_and_the_decode_append_are_one_build(monkeypatch):
    """One extension exports the read's entry points and the decode append's: one compile (about a
    minute) at first start, not two, and the append's kernel is the read's module."""
    import torch.utils.cpp_extension as ext

    import vlkv.plugins.paged_append as paged_append

    built = []
    monkeypatch.setattr(
        ext, "load_inline", lambda name, **kw: built.append((name, kw["functions"])) or object()
    )
    monkeypatch.setattr(kernel, "_BUILT", [])  # as in a fresh process: nothing tried yet
    mod = paged_append.kernel()
    assert kernel.kernel() is mod and paged_append.kernel() is mod
    assert built == [(kernel.build_name(), ["segments", "table_rows", "table_rows_probs", "append_rows"])]
    monkeypatch.undo()
    real = kernel.kernel()  # the real extension (cached): every entry point is there
    assert real is paged_append.kernel()
    assert all(hasattr(real, f) for f in ("segments", "table_rows", "table_rows_probs", "append_rows"))
