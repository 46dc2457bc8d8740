"""AOT PTX for the plugin kernels compiles without a GPU and names its kernel and launch parameters."""

from __future__ import annotations

import re

import pytest

from vlkv.plugins.ptx import AOT_KERNELS, compile_ptx, normalize_dtype

pytest.importorskip("triton", reason="triton is not installed")

# The same arguments as the fake-TensorRT aot_impl test, so the compiled kernels are shared (lru_cache).
CONSTEXPRS = {
    "attn_stats": {"SCALE": 0.125, "THRESHOLD": 0.01, "CAUSAL": True, "HAS_THRESHOLD": True},
    "selected_attention": {"SCALE": 0.125},
    "merge_kv": {},
    "lowrank_attention": {"SCALE": 0.125, "BLOCK_RK": 64, "BLOCK_RV": 32},
    "paged_attention": {"SCALE": 0.125},
}
DIMS = {"B": 2, "H": 12, "HKV": 4, "Q": 1, "S": 100, "D": 64, "K_SEL": 30, "S_OUT": 50, "T": 576}
DIMS |= {"RK": 64, "RV": 32, "C": 40}
GRIDS = {
    "attn_stats": (24, 1, 1),
    "selected_attention": (8, 1, 1),
    "merge_kv": (8, 2, 1),
    "lowrank_attention": (8, 1, 1),
    "paged_attention": (8, 1, 1),
}


@pytest.mark.parametrize("op_name", sorted(AOT_KERNELS))
def test_compile_ptx_names_kernel_and_launch(op_name):
    art = compile_ptx(op_name, "float16", head_dim=64, **CONSTEXPRS[op_name])
    assert art.kernel_name == AOT_KERNELS[op_name].kernel
    assert re.search(rf"\.visible \.entry {art.kernel_name}\(", art.ptx)
    assert ".target sm_90" in art.ptx
    assert art.num_warps == 4 and art.block_x == 128 and art.shared_mem >= 0
    # Every ABI argument is a kernel parameter; Triton's hidden scratch pointers follow and stay unused.
    assert art.ptx_params >= len(art.abi) and art.scratch_bytes == 0
    assert art.constexprs["BLOCK_D"] == 64 and art.constexprs["IEEE"] is False
    params = art.launch_params(DIMS)
    assert (params["grid_x"], params["grid_y"], params["grid_z"]) == GRIDS[op_name]
    assert params["block_x"] == 128 and params["shared_mem"] == art.shared_mem


def test_compile_ptx_validates_arguments():
    with pytest.raises(ValueError, match="unknown plugin kernel"):
        compile_ptx("softmax", "float16", head_dim=64)
    with pytest.raises(ValueError, match="SCALE"):
        compile_ptx("attn_stats", "float16", head_dim=64)
    with pytest.raises(ValueError, match="dtype"):
        compile_ptx("merge_kv", "int8", head_dim=64)
    with pytest.raises(ValueError, match="BLOCK_RK"):
        compile_ptx("lowrank_attention", "float16", head_dim=64, SCALE=0.1)


def test_lowrank_abi_follows_the_op_input_order():
    """TensorRT passes inputs in the op's order, where float and int64 inputs interleave."""
    from vlkv.plugins.onnx_ops import OPS

    abi = AOT_KERNELS["lowrank_attention"].abi
    ports = [p.name for p in OPS["LowRankAttention"].inputs]
    renamed = {"dense_len": "dlen"}
    assert abi[: len(ports)] == tuple(f"{renamed.get(n, n)}_ptr" for n in ports)
    assert abi[len(ports) :] == ("H", "HKV", "T", "S", "D", "RK", "RV", "out_ptr")


@pytest.mark.parametrize(
    "alias,name",
    [
        ("fp16", "float16"),
        ("torch.bfloat16", "bfloat16"),
        ("DataType.HALF", "float16"),
        ("DataType.FLOAT", "float32"),
    ],
)
def test_normalize_dtype(alias, name):
    assert normalize_dtype(alias) == name
