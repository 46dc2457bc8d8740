"""TensorRT plugin registration: a clear error without TensorRT; the QDP callbacks on a contract-checking double."""

# No ``from __future__ import annotations``: the callbacks below are decorated, and tensorrt.plugin (and
# its double) read their annotations as objects.
import builtins
import sys

import pytest

from tests.plugins.qdp_double import (
    FLOAT16,
    FLOAT32,
    INT64,
    AutoTuneCombination,
    KernelLaunchParams,
    Qdp,
    SymIntExprs,
    TensorDesc,
    fake_tensorrt,
)
from tests.plugins.test_ptx import CONSTEXPRS
from vlkv.plugins import trt_plugins
from vlkv.plugins.ptx import SM_ARCHES


def test_register_plugins_without_tensorrt_raises_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_tensorrt(name, *args, **kwargs):
        if name.split(".")[0] == "tensorrt":
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorrt)
    with pytest.raises(trt_plugins.TensorRTUnavailableError, match="^TensorRT is not installed") as info:
        trt_plugins.register_plugins()
    assert "\n" not in str(info.value) and info.value.__cause__ is None and info.value.__suppress_context__


@pytest.fixture
def qdp(monkeypatch):
    """TensorRT replaced by the contract-checking double; the vlkv plugins not yet registered."""
    trt, trtp, qdp = fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(trt_plugins, "_registered", False)
    monkeypatch.setattr(trt_plugins, "_target", {})
    return qdp


def test_plugins_register_and_aot_compile_on_the_qdp_double(qdp):
    pytest.importorskip("triton", reason="triton is not installed")
    ids = trt_plugins.register_plugins(arch="sm_90")
    assert ids == [
        "vlkv::attn_stats",
        "vlkv::lowrank_attention",
        "vlkv::merge_kv",
        "vlkv::paged_attention",
        "vlkv::selected_attention",
    ]
    assert all(qdp.registry[i].autotune and qdp.registry[i].aot_impl for i in ids)

    half, i64 = FLOAT16, INT64
    q, k = TensorDesc((2, 12, 1, 64), half), TensorDesc((2, 4, 100, 64), half)
    rows, lengths, offset = TensorDesc((2, 1), i64), TensorDesc((2,), i64), TensorDesc((2,), i64)
    c = CONSTEXPRS["attn_stats"]
    attrs = {"scale": c["SCALE"], "causal": 1, "threshold": c["THRESHOLD"]}
    inputs = [q, k, rows, lengths, offset]
    outs = qdp.run_register("vlkv::attn_stats", inputs, attrs)
    colsum, below, _ = outs
    assert colsum.shape_expr == (2, 12, 100) and colsum.dtype == FLOAT32 and below.dtype == i64
    (combo,) = qdp.run_autotune("vlkv::attn_stats", inputs, outs, attrs)
    assert combo.layouts == ["LINEAR"]
    name, ptx, launch, extra = qdp.run_aot("vlkv::attn_stats", inputs, outs, attrs)
    assert name == b"attn_stats_aot_kernel" and b".entry attn_stats_aot_kernel" in ptx
    assert b".target sm_90" in ptx
    assert (launch.grid_x, launch.grid_y, launch.block_x) == (24, 1, 128)
    assert [e.value for e in extra.values] == [12, 4, 1, 100, 64]  # H, HKV, Q, S, D

    v, idx, n = TensorDesc((2, 4, 100, 64), half), TensorDesc((2, 4, 30), i64), TensorDesc((2, 4), i64)
    inputs, attrs = [q, k, v, idx, n], {"scale": 0.125}
    outs = qdp.run_register("vlkv::selected_attention", inputs, attrs)
    qdp.run_autotune("vlkv::selected_attention", inputs, outs, attrs)
    name, _, launch, extra = qdp.run_aot("vlkv::selected_attention", inputs, outs, attrs)
    assert name == b"selected_attention_aot_kernel" and (launch.grid_x, launch.grid_y) == (8, 1)
    assert [e.value for e in extra.values] == [12, 4, 1, 100, 64, 30]

    assign, counts = TensorDesc((2, 4, 100), i64), TensorDesc((2, 4, 50), i64)
    inputs = [k, v, assign, counts]
    outs = qdp.run_register("vlkv::merge_kv", inputs, {})
    assert outs[0].shape_expr == (2, 4, 50, 64) and outs[1].dtype == half
    qdp.run_autotune("vlkv::merge_kv", inputs, outs, {})
    name, _, launch, extra = qdp.run_aot("vlkv::merge_kv", inputs, outs, {})
    assert name == b"merge_kv_aot_kernel" and (launch.grid_x, launch.grid_y) == (8, 2)
    assert [e.value for e in extra.values] == [4, 100, 50, 64]

    q1, t = TensorDesc((2, 12, 64), half), 576
    kbar, dk = TensorDesc((2, t, 64), half), TensorDesc((2, 64, 256), half)
    vbar, dv = TensorDesc((2, t, 20), half), TensorDesc((2, 20, 256), half)
    inputs = [q1, kbar, dk, vbar, dv, lengths, k, v, offset]
    attrs = {"scale": 0.125}
    outs = qdp.run_register("vlkv::lowrank_attention", inputs, attrs)
    assert outs[0].shape_expr == (2, 12, 64) and outs[0].dtype == half
    (combo,) = qdp.run_autotune("vlkv::lowrank_attention", inputs, outs, attrs)
    assert combo.layouts == ["LINEAR"]
    name, ptx, launch, extra = qdp.run_aot("vlkv::lowrank_attention", inputs, outs, attrs)
    assert name == b"lowrank_attention_aot_kernel" and b".entry lowrank_attention_aot_kernel" in ptx
    assert (launch.grid_x, launch.grid_y, launch.block_x) == (8, 1, 128)
    assert [e.value for e in extra.values] == [12, 4, t, 100, 64, 64, 20]  # H, HKV, T, S, D, RK, RV

    pool, table, lens = TensorDesc((4, 100, 64), half), TensorDesc((2, 4, 40), i64), TensorDesc((2, 4), i64)
    inputs, attrs = [q, pool, pool, table, lens], {"scale": 0.125}
    outs = qdp.run_register("vlkv::paged_attention", inputs, attrs)
    assert outs[0].shape_expr == (2, 12, 1, 64) and outs[0].dtype == half
    (combo,) = qdp.run_autotune("vlkv::paged_attention", inputs, outs, attrs)
    assert combo.layouts == ["LINEAR"]
    name, ptx, launch, extra = qdp.run_aot("vlkv::paged_attention", inputs, outs, attrs)
    assert name == b"paged_attention_aot_kernel" and b".entry paged_attention_aot_kernel" in ptx
    assert (launch.grid_x, launch.grid_y, launch.block_x) == (8, 1, 128)
    assert [e.value for e in extra.values] == [12, 4, 1, 100, 64, 40]  # H, HKV, Q, S, D, C


def test_plugins_compile_for_the_architecture_asked_for(qdp):
    pytest.importorskip("triton", reason="triton is not installed")
    trt_plugins.register_plugins(arch="sm_80")
    k, v = TensorDesc((1, 2, 9, 16), FLOAT16), TensorDesc((1, 2, 9, 16), FLOAT16)
    inputs = [k, v, TensorDesc((1, 2, 9), INT64), TensorDesc((1, 2, 4), INT64)]
    outs = qdp.run_register("vlkv::merge_kv", inputs, {})
    assert b".target sm_80" in qdp.run_aot("vlkv::merge_kv", inputs, outs, {})[1]


def test_unsupported_or_unknown_architecture_is_one_line(qdp, monkeypatch):
    with pytest.raises(ValueError) as info:
        trt_plugins.register_plugins(arch="sm_75")
    assert str(info.value) == f"trt.ptx_arch: must be one of {', '.join(SM_ARCHES)}, got 'sm_75'"
    monkeypatch.setattr(trt_plugins, "device_arch", lambda: None)
    with pytest.raises(
        ValueError, match=r"^trt.ptx_arch: no CUDA device is visible .*set it to one of sm_80"
    ):
        trt_plugins.register_plugins()
    monkeypatch.setattr(trt_plugins, "device_arch", lambda: 120)
    trt_plugins.register_plugins()
    assert trt_plugins._target["arch"] == 120


# Callbacks TensorRT rejects when they are decorated; the double must reject them as well.
def _desc(x: TensorDesc, scale: float) -> TensorDesc:
    return x.like()


def _aot_without_return_annotation(x, scale: float, outputs, tactic):
    return "k", "ptx", KernelLaunchParams(), SymIntExprs()


def _aot_without_tactic(x, outputs) -> tuple[str, bytes, KernelLaunchParams, SymIntExprs]:
    return "k", b"ptx", KernelLaunchParams(), SymIntExprs()


def _aot_bad_return(x, outputs, tactic) -> tuple[str, bytes, KernelLaunchParams, int]:
    return "k", b"ptx", KernelLaunchParams(), 0


def _tune_attrs_out_of_order(x, outputs, scale: float):
    return []


def _tune_wrong_attr_type(x, scale: int, outputs):
    return []


@pytest.mark.parametrize(
    "kind,fn,message",
    [
        ("aot_impl", _aot_without_return_annotation, "No return annotation found for aot_impl function"),
        ("aot_impl", _aot_without_tactic, "does not match"),
        ("aot_impl", _aot_bad_return, "index 3"),
        ("autotune", _tune_attrs_out_of_order, "does not match"),
        ("autotune", _tune_wrong_attr_type, "type annotation different"),
    ],
)
def test_the_double_rejects_what_tensorrt_rejects(kind, fn, message):
    qdp = Qdp()
    qdp.register("t::op")(_desc)
    with pytest.raises(ValueError, match=message):
        getattr(qdp, kind)("t::op")(fn)


def _unannotated(x, scale: float) -> TensorDesc:
    return x


def _no_return(x: TensorDesc, scale: float):
    return x


def _default(x: TensorDesc, scale: float = 1.0) -> TensorDesc:
    return x


def _list_attr(x: TensorDesc, sizes: list) -> TensorDesc:
    return x


def _reserved_name(x: TensorDesc, tactic: int) -> TensorDesc:
    return x


@pytest.mark.parametrize(
    "fn,message",
    [
        (_unannotated, "does not have a type annotation"),
        (_no_return, "No return annotation found for register function"),
        (_default, "default value"),
        (_list_attr, "not serializable"),
        (_reserved_name, "not allowed as a plugin attribute name"),
    ],
)
def test_the_double_rejects_bad_registrations(fn, message):
    with pytest.raises(ValueError, match=message):
        Qdp().register("t::op")(fn)


def test_the_double_checks_autotune_type_strings():
    with pytest.raises(ValueError, match="unknown type"):
        AutoTuneCombination("FP32, INT65")
    with pytest.raises(ValueError, match="illegal dependent lengths"):
        AutoTuneCombination("FP32|FP16, FP32|FP16|BF16")
