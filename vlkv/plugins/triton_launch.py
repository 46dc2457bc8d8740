"""Launch-time choices shared by the Triton launchers; imports neither triton nor (at import) torch."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_in_fp32(dtype) -> bool:
    """Whether a kernel should upcast its tl.dot operands to fp32 and ask for IEEE precision.

    fp32 inputs: yes, otherwise tensor cores silently round them to tf32. bf16 under the interpreter: yes,
    because the interpreter's tl.dot misreads bf16 operands (checked with triton 3.9); the upcast is exact.
    """
    import torch

    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def check_float_dtype(name: str, dtype) -> None:
    """Raise ValueError unless ``dtype`` (a torch dtype) is one the kernels are built for."""
    import torch

    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {dtype}")
