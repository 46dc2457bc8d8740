"""TensorRT plugin registration: a clear error without TensorRT, and the QDP callbacks on a fake trtp."""

from __future__ import annotations

import builtins
import sys
import types

import pytest

from tests.plugins.test_ptx import CONSTEXPRS
from vlkv.plugins import trt_plugins


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


class FakeDesc:
    """A TensorDesc whose shape expressions are plain ints."""

    def __init__(self, shape, dtype):
        self.shape_expr, self.dtype = tuple(shape), dtype

    def like(self):
        return FakeDesc(self.shape_expr, self.dtype)


def fake_tensorrt() -> tuple[types.ModuleType, types.ModuleType, dict]:
    seen: dict[str, dict] = {}

    def decorator(kind):
        def outer(plugin_id):
            def inner(fn):
                seen.setdefault(plugin_id, {})[kind] = fn
                return fn

            return inner

        return outer

    class KernelLaunchParams:
        grid_x = grid_y = grid_z = block_x = shared_mem = None

    trtp = types.ModuleType("tensorrt.plugin")
    trtp.register, trtp.autotune, trtp.aot_impl = (
        decorator("register"),
        decorator("autotune"),
        decorator("aot"),
    )
    trtp.TensorDesc = FakeDesc
    trtp.from_shape_expr = lambda shape, dtype: FakeDesc(shape, dtype)
    trtp.AutoTuneCombination = lambda types_, layout="LINEAR": (types_, layout)
    trtp.KernelLaunchParams = KernelLaunchParams
    trtp.SymInt32 = int
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.cdiv = lambda a, b: -(-a // b)
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.int64, trt.float16 = "DataType.FLOAT", "DataType.INT64", "DataType.HALF"
    trt.plugin = trtp
    return trt, trtp, seen


def test_plugins_register_and_aot_compile_on_fake_tensorrt(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    trt, trtp, seen = fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(trt_plugins, "_registered", False)
    ids = trt_plugins.register_plugins()
    assert ids == ["vlkv::attn_stats", "vlkv::merge_kv", "vlkv::selected_attention"]
    assert all(set(seen[i]) == {"register", "autotune", "aot"} for i in ids)

    half, i64 = trt.float16, trt.int64
    q, k = FakeDesc((2, 12, 1, 64), half), FakeDesc((2, 4, 100, 64), half)
    rows, lengths, offset = FakeDesc((2, 1), i64), FakeDesc((2,), i64), FakeDesc((2,), i64)
    colsum, below, visible = seen["vlkv::attn_stats"]["register"](q, k, rows, lengths, offset, 0.125, 1, 0.01)
    assert colsum.shape_expr == (2, 12, 100) and colsum.dtype == trt.float32 and below.dtype == i64
    (combo,) = seen["vlkv::attn_stats"]["autotune"](q, k, rows, lengths, offset, (colsum, below, visible))
    assert len(combo[0].split(",")) == 8 and combo[1] == "LINEAR"

    c = CONSTEXPRS["attn_stats"]
    name, ptx, launch, extra = seen["vlkv::attn_stats"]["aot"](
        q, k, rows, lengths, offset, c["SCALE"], 1, c["THRESHOLD"], (colsum, below, visible), 0
    )
    assert (
        name == b"attn_stats_aot_kernel" and ptx.startswith(b"//") and b".entry attn_stats_aot_kernel" in ptx
    )
    assert (launch.grid_x, launch.grid_y, launch.block_x) == (24, 1, 128)
    assert extra == (12, 4, 1, 100, 64)  # H, HKV, Q, S, D

    v, idx, n = FakeDesc((2, 4, 100, 64), half), FakeDesc((2, 4, 30), i64), FakeDesc((2, 4), i64)
    out = seen["vlkv::selected_attention"]["register"](q, k, v, idx, n, 0.125)
    name, _, launch, extra = seen["vlkv::selected_attention"]["aot"](q, k, v, idx, n, 0.125, (out,), 0)
    assert name == b"selected_attention_aot_kernel" and (launch.grid_x, launch.grid_y) == (8, 1)
    assert extra == (12, 4, 1, 100, 64, 30)

    assign, counts = FakeDesc((2, 4, 100), i64), FakeDesc((2, 4, 50), i64)
    k_out, v_out = seen["vlkv::merge_kv"]["register"](k, v, assign, counts)
    assert k_out.shape_expr == (2, 4, 50, 64) and v_out.dtype == half
    name, _, launch, extra = seen["vlkv::merge_kv"]["aot"](k, v, assign, counts, (k_out, v_out), 0)
    assert (
        name == b"merge_kv_aot_kernel"
        and (launch.grid_x, launch.grid_y) == (8, 2)
        and extra == (4, 100, 50, 64)
    )
