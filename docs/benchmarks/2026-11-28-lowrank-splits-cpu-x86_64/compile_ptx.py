"""Compile ``paged_lowrank_kernel`` for sm_90 (PTX, then ``ptxas`` to a cubin) on a machine without a GPU:
the cut's device code (the span's splits, the virtual column order, the ``if holds`` branch) builds with
the compiler, not only under the interpreter. Two variants: Qwen2-VL-7B batch 1's decode (20 splits,
M-RoPE table form, statistics form) and one split with 1-D RoPE, the plain form. bf16, D 128, rank tile 64.
Run without ``TRITON_INTERPRET`` (an interpreted function cannot be lowered)."""

from __future__ import annotations

import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vlkv.plugins.paged_lowrank_kernels import paged_lowrank_kernel

INTS = {"tab_ptr", "len_ptr", "rot_ptr", "sec_ptr", "frow_ptr", "rk_ptr", "rv_ptr"}
FP32 = {"part_m_ptr", "part_l_ptr", "part_acc_ptr", "logit_ptr", "cos_ptr", "sin_ptr"}
VARIANTS = (
    dict(NUM_SPLITS=20, HAS_ROPE=True, MROPE=True, LOGITS=True),
    dict(NUM_SPLITS=1, HAS_ROPE=True, MROPE=False, LOGITS=False),
)


def signature(consts: dict) -> dict:
    """Every argument's Triton type: the kernel's pointers, int32 strides and sizes, the constexprs."""
    sig = {}
    for name in paged_lowrank_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("span_ptr", "post_ptr"):  # int32 tables (post: path (b) per request)
            sig[name] = "*i32"
        elif name in INTS:
            sig[name] = "*i64"
        elif name in FP32:
            sig[name] = "*fp32"
        else:
            sig[name] = "*bf16" if name.endswith("_ptr") else "i32"
    return sig


def main() -> None:
    for variant in VARIANTS:
        consts = dict(SCALE=0.088, IEEE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128, BLOCK_R=64)
        consts |= variant
        start = time.perf_counter()
        source = ASTSource(paged_lowrank_kernel, signature=signature(consts), constexprs=consts)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        seconds = time.perf_counter() - start
        print(
            f"{variant}: PTX {len(kernel.asm['ptx'])} chars, cubin {'cubin' in kernel.asm}, {seconds:.1f} s"
        )


if __name__ == "__main__":
    main()
