"""Compile Triton kernels for a GPU target on a machine without one: what the interpreter cannot check.

The CPU tests run every kernel under Triton's interpreter (``TRITON_INTERPRET=1``), which executes the
kernel's Python and never runs Triton's compiler. The compiler's passes can reject a kernel the
interpreter runs: on the H200 (run 7, Triton 3.6) the low-rank paged kernel's rotary variants failed
sm_90's layout passes (``'tt.load' op failed to verify that mask type matches ptr type``), which no CPU
test could see. :func:`compile_only` makes each launch inside it compile for a CUDA target and return
without running, so the CPU machine runs Triton's whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin with
the ``ptxas`` Triton ships) for every variant a wrapper launches. The outputs of the wrappers run inside
it are never written: only whether each launch compiled is checked.

Triton internals (its runtime driver and ``JITFunction.run``) are replaced for the block's duration and
restored after; the interpreter must be off (``TRITON_INTERPRET=0`` before ``triton`` is imported: the
kernels are then ``JITFunction`` s).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class _TargetDriver:
    """Triton's active driver as the compile path reads it: a CUDA target, device 0, stream 0."""

    def __init__(self, arch: int, warp_size: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextmanager
def compile_only(arch: int = 90, warp_size: int = 32) -> Iterator[list[str]]:
    """Inside: every Triton launch compiles for ``sm_{arch}`` and returns without running; yields the
    list of compiled kernels' names (one per launch, in order). A compile error propagates (Triton's
    message, which names the kernel's source line). Process-wide while it lasts (Triton's driver and
    ``JITFunction.run`` are global): another thread's launches would compile and not run, so it is for a
    process of its own (the tests run it in a child)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            "compile_only needs the kernels compiled, not interpreted: set TRITON_INTERPRET=0 before triton "
            "is imported"
        )
    import triton
    from triton.runtime import jit

    compiled: list[str] = []
    touched: list = []  # the kernels whose device-0 cache now holds the target's binaries: emptied after
    real = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        touched.append(self)
        kernel = real(self, *args, grid=grid, warmup=True, **kwargs)  # warmup: compile, never launch
        compiled.append(self.fn.__name__)
        return kernel

    config = triton.runtime.driver
    before = config._active  # restored as it was: reset_active() would look for a GPU driver, absent here
    config.set_active(_TargetDriver(arch, warp_size))
    jit.JITFunction.run = run
    try:
        yield compiled
    finally:
        jit.JITFunction.run = real
        config._active = before
        for fn in touched:  # a later real launch on device 0 compiles for its own GPU, not this target
            fn.device_caches.pop(0, None)
