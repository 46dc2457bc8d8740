"""Ahead-of-time PTX for the TensorRT plugins: Triton -> PTX without a GPU (toolchain.md A5).

``compile_ptx`` is pure (no TensorRT, no CUDA) so CI can check that every plugin kernel compiles and that
its launch parameters are what ``trt_plugins.py`` hands to TensorRT.

The AOT entry kernels take their arguments in the QDP order: input pointers, int32 scalars, output
pointers. Triton >= 3.3 appends hidden pointer parameters (global / profile scratch) to every kernel;
TensorRT does not pass them, which is harmless only while the kernel needs no scratch, so the artifact
records ``scratch_bytes`` and ``hidden_params`` for the caller to check.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlkv.plugins.triton_launch import interpreting

# GPU architectures the AOT kernels are compiled for (Ampere sm_80 ... Blackwell sm_120); each one was
# checked to compile with triton 3.9 (sm_100 and newer come out as the arch-specific "a" targets).
SM_ARCHES: tuple[str, ...] = (
    "sm_80",
    "sm_86",
    "sm_87",
    "sm_89",
    "sm_90",
    "sm_100",
    "sm_103",
    "sm_110",
    "sm_120",
)
# Only for compiling without a target in mind (tests, CI): a TensorRT build always names its arch.
CI_ARCH = 90
_TRITON_TYPES: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# Spellings of torch ("torch.float16"), TensorRT ("DataType.HALF", "DataType.FLOAT") and Triton ("fp16").
_DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
}


def _int_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AotKernelSpec:
    """How to compile one plugin kernel: where it lives, its ABI, its grid and default constexprs.

    grid: (dims, constexprs, cdiv) -> (gx, gy, gz); dims holds ints or TensorRT shape expressions,
    so the same function feeds the tests and ``KernelLaunchParams``.
    """

    module: str
    kernel: str
    float_inputs: tuple[str, ...]
    int_inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]  # (name, "float" = input dtype, or "fp32" / "i64")
    grid: Callable[[Mapping[str, Any], Mapping[str, Any], Callable], tuple]
    required: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    # the op's input order where float and int inputs interleave (TensorRT passes inputs in op order)
    input_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.input_order and sorted(self.input_order) != sorted((*self.float_inputs, *self.int_inputs)):
            raise ValueError(f"{self.kernel}: input_order must name every float and int input once")

    @property
    def abi(self) -> tuple[str, ...]:
        """Kernel parameter names in launch order (inputs, scalars, outputs)."""
        inputs = self.input_order or (*self.float_inputs, *self.int_inputs)
        return (*inputs, *self.scalars, *(name for name, _ in self.outputs))


AOT_KERNELS: dict[str, AotKernelSpec] = {
    "attn_stats": AotKernelSpec(
        module="vlkv.plugins.attn_stats_kernels",
        kernel="attn_stats_aot_kernel",
        float_inputs=("q_ptr", "k_ptr"),
        int_inputs=("rows_ptr", "klen_ptr", "qoff_ptr"),
        scalars=("H", "HKV", "Q", "S", "D"),
        outputs=(("colsum_ptr", "fp32"), ("below_ptr", "i64"), ("vis_ptr", "i64")),
        grid=lambda d, c, cdiv: (d["B"] * d["H"], 1, 1),
        required=("SCALE",),
        defaults={"THRESHOLD": 0.0, "CAUSAL": True, "HAS_THRESHOLD": True, "BLOCK_M": 16, "BLOCK_N": 64},
    ),
    "selected_attention": AotKernelSpec(
        module="vlkv.plugins.selected_attention_kernels",
        kernel="selected_attention_aot_kernel",
        float_inputs=("q_ptr", "k_ptr", "v_ptr"),
        int_inputs=("idx_ptr", "len_ptr"),
        scalars=("H", "HKV", "Q", "S", "D", "K_SEL"),
        outputs=(("out_ptr", "float"),),
        grid=lambda d, c, cdiv: (d["B"] * d["HKV"], cdiv(d["H"] // d["HKV"] * d["Q"], c["BLOCK_M"]), 1),
        required=("SCALE",),
        defaults={"BLOCK_M": 16, "BLOCK_N": 64},
    ),
    "paged_attention": AotKernelSpec(
        module="vlkv.plugins.paged_attention_kernels",
        kernel="paged_attention_aot_kernel",
        float_inputs=("q_ptr", "k_ptr", "v_ptr"),
        int_inputs=("tab_ptr", "len_ptr"),
        scalars=("H", "HKV", "Q", "S", "D", "C"),
        outputs=(("out_ptr", "float"),),
        grid=lambda d, c, cdiv: (d["B"] * d["HKV"], cdiv(d["H"] // d["HKV"] * d["Q"], c["BLOCK_M"]), 1),
        required=("SCALE",),
        defaults={"BLOCK_M": 16, "BLOCK_N": 64},
    ),
    "merge_kv": AotKernelSpec(
        module="vlkv.plugins.merge_kv_kernels",
        kernel="merge_kv_aot_kernel",
        float_inputs=("k_ptr", "v_ptr"),
        int_inputs=("assign_ptr", "counts_ptr"),
        scalars=("HKV", "S", "S_OUT", "D"),
        outputs=(("k_out_ptr", "float"), ("v_out_ptr", "float")),
        grid=lambda d, c, cdiv: (d["B"] * d["HKV"], cdiv(d["S_OUT"], c["BLOCK_T"]), 1),
        defaults={"BLOCK_T": 32, "BLOCK_S": 32},
    ),
    "lowrank_attention": AotKernelSpec(
        module="vlkv.plugins.lowrank_attention_kernels",
        kernel="lowrank_attention_aot_kernel",
        float_inputs=("q_ptr", "kbar_ptr", "dk_ptr", "vbar_ptr", "dv_ptr", "k_ptr", "v_ptr"),
        int_inputs=("rows_ptr", "dlen_ptr"),
        input_order=(
            "q_ptr",
            "kbar_ptr",
            "dk_ptr",
            "vbar_ptr",
            "dv_ptr",
            "rows_ptr",
            "k_ptr",
            "v_ptr",
            "dlen_ptr",
        ),
        scalars=("H", "HKV", "T", "S", "D", "RK", "RV"),
        outputs=(("out_ptr", "float"),),
        grid=lambda d, c, cdiv: (d["B"] * d["HKV"], cdiv(d["H"] // d["HKV"], c["BLOCK_M"]), 1),
        required=("SCALE", "BLOCK_RK", "BLOCK_RV"),
        defaults={"BLOCK_M": 16, "BLOCK_N": 32},
    ),
}


@dataclass(frozen=True)
class PtxArtifact:
    """A compiled plugin kernel: what ``@trtp.aot_impl`` returns, minus the TensorRT types.

    ptx: PTX text. block_x = num_warps * 32 threads. scalar_args: int32 extra arguments in ABI order.
    ptx_params: parameters in the PTX entry; hidden_params = ptx_params - len(abi).
    """

    op_name: str
    kernel_name: str
    ptx: str
    num_warps: int
    shared_mem: int
    scratch_bytes: int
    arch: int
    abi: tuple[str, ...]
    scalar_args: tuple[str, ...]
    constexprs: dict[str, Any]
    ptx_params: int

    @property
    def block_x(self) -> int:
        return self.num_warps * 32

    @property
    def hidden_params(self) -> int:
        return self.ptx_params - len(self.abi)

    def grid(self, dims: Mapping[str, Any], cdiv: Callable = _int_cdiv) -> tuple:
        """(grid_x, grid_y, grid_z) for dims "B", "H", "HKV", "Q", "S", "D", "K_SEL", "S_OUT" as needed."""
        return AOT_KERNELS[self.op_name].grid(dims, self.constexprs, cdiv)

    def launch_params(self, dims: Mapping[str, Any], cdiv: Callable = _int_cdiv) -> dict[str, Any]:
        """grid_x/y/z, block_x and shared_mem, the fields of ``trtp.KernelLaunchParams``."""
        gx, gy, gz = self.grid(dims, cdiv)
        return {
            "grid_x": gx,
            "grid_y": gy,
            "grid_z": gz,
            "block_x": self.block_x,
            "shared_mem": self.shared_mem,
        }


def normalize_dtype(dtype: Any) -> str:
    """ "float16" / "bfloat16" / "float32" from a string alias, a torch dtype or a TensorRT dtype."""
    name = str(dtype).rsplit(".", 1)[-1].lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _TRITON_TYPES:
        raise ValueError(f"dtype must be one of {sorted(_TRITON_TYPES)} (or fp16/bf16/fp32), got {dtype!r}")
    return name


def parse_arch(value: int | str, what: str = "arch") -> int:
    """``"sm_90"``, ``"90"`` or ``90`` -> 90; anything outside :data:`SM_ARCHES` is a one-line ValueError."""
    text = str(value).strip().lower()
    name = text if text.startswith("sm_") else f"sm_{text}"
    if name not in SM_ARCHES:
        raise ValueError(f"{what}: must be one of {', '.join(SM_ARCHES)}, got {value!r}")
    return int(name[3:])


def device_arch() -> int | None:
    """The compute capability of the visible CUDA device as an int (``(9, 0)`` -> 90), or None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def compile_ptx(
    op_name: str,
    dtype: Any,
    *,
    head_dim: int,
    arch: int | str | None = None,
    num_warps: int = 4,
    **constexprs,
):
    """Compile the AOT kernel of ``op_name`` for ``dtype`` to PTX for ``arch``; returns a PtxArtifact.

    arch: one of :data:`SM_ARCHES` (``"sm_90"`` or ``90``); None = the visible GPU, else :data:`CI_ARCH`
    (TensorRT builds always pass it: see ``trt_plugins.register_plugins``). head_dim: D, which fixes
    BLOCK_D. constexprs: SCALE (attn_stats, selected_attention, lowrank_attention, paged_attention), THRESHOLD, CAUSAL,
    HAS_THRESHOLD, BLOCK_RK / BLOCK_RV (lowrank_attention: the ranks, padded to a power of two >= 16),
    BLOCK_* overrides. Results are cached per argument set.
    """
    if arch is None:
        arch = device_arch() or CI_ARCH
    arch = parse_arch(arch)
    if op_name not in AOT_KERNELS:
        raise ValueError(f"unknown plugin kernel {op_name!r}; known: {sorted(AOT_KERNELS)}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    spec = AOT_KERNELS[op_name]
    missing = [name for name in spec.required if name not in constexprs]
    if missing:
        raise ValueError(f"{op_name} needs constexpr(s) {missing}")
    frozen = tuple(sorted(constexprs.items()))
    return _compile(op_name, normalize_dtype(dtype), head_dim, arch, num_warps, frozen)


@functools.lru_cache(maxsize=64)
def _compile(
    op_name: str, dtype: str, head_dim: int, arch: int, num_warps: int, frozen: tuple
) -> PtxArtifact:
    # Under TRITON_INTERPRET=1 every @triton.jit in the process (triton.language's own helpers too) is an
    # interpreted function that cannot be lowered, so the compile runs in a child without the interpreter.
    request = {"op_name": op_name, "dtype": dtype, "head_dim": head_dim, "arch": arch, "num_warps": num_warps}
    request["constexprs"] = dict(frozen)
    fields = _compile_in_child(request) if interpreting() else _compile_here(**request)
    spec = AOT_KERNELS[op_name]
    return PtxArtifact(op_name=op_name, arch=arch, abi=spec.abi, scalar_args=spec.scalars, **fields)


def _compile_here(
    op_name: str, dtype: str, head_dim: int, arch: int, num_warps: int, constexprs: dict
) -> dict:
    """Compile in this process; returns the PtxArtifact fields that depend on the compiler."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        raise RuntimeError(f"triton is not installed ({error}): pip install 'vlkv[triton]'") from None

    spec = AOT_KERNELS[op_name]
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    block_d = max(16, triton.next_power_of_2(head_dim))
    consts = {**spec.defaults, "BLOCK_D": block_d, "IEEE": dtype == "float32", **constexprs}
    unknown = set(consts) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{op_name} kernel has no constexpr(s) {sorted(unknown)}")
    ftype = _TRITON_TYPES[dtype]
    out_types = {"float": f"*{ftype}", "fp32": "*fp32", "i64": "*i64"}
    signature = {name: f"*{ftype}" for name in spec.float_inputs}
    signature |= {name: "*i64" for name in spec.int_inputs}
    signature |= {name: "i32" for name in spec.scalars}
    signature |= {name: out_types[kind] for name, kind in spec.outputs}
    signature |= {name: "constexpr" for name in consts}
    source = ASTSource(fn, signature=signature, constexprs=consts)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = kernel.asm["ptx"]
    name = kernel.metadata.name
    entry = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    return {
        "kernel_name": name,
        "ptx": ptx,
        "num_warps": kernel.metadata.num_warps,
        "shared_mem": kernel.metadata.shared,
        "scratch_bytes": getattr(kernel.metadata, "global_scratch_size", 0) or 0,
        "constexprs": consts,
        "ptx_params": len(re.findall(r"\.param\s", entry.group(1))) if entry else 0,
    }


def _compile_in_child(request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child must import this checkout of vlkv even when it is not installed.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "vlkv.plugins.ptx"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"PTX compile of {request['op_name']} failed in the child process: {last}")
    return json.loads(done.stdout)


if __name__ == "__main__":
    # Child side of _compile_in_child: one JSON request on stdin, the artifact fields on stdout.
    print(json.dumps(_compile_here(**json.load(sys.stdin))))
