"""The replay's compute dtype: a cast copy of the decoder layers, made once per model.

Scoring only needs a *ranking*, and on CPUs with bf16 matrix units (x86 ``avx512_bf16`` / AMX, Arm
``bf16``) a bf16 matrix product runs several times faster than an fp32 one (4.5× for a
``1024 × 576 × 1536`` product at 1 thread on the 2-core AMD EPYC VM of the benchmarks). So a fp32
model may replay in bf16: the replay rows, the layers' weights and the attention run in bf16; the
cache is read as it is (cast per layer), the scores and KVgrad's ``||W_O v||`` stay float32 from the
model's own weights. The copy is kept per layer list (weakly: it goes with the model) and remade
when a weight of the model changes in place (its version counter moves), so training a projector or
loading weights never leaves a stale copy.

``"auto"`` (the policies' default since 0.3.0) picks bf16 for a float32 model on hardware that runs
bf16 products natively (:func:`bf16_is_fast`: a CUDA device with bf16 support, an x86 CPU with
``avx512_bf16`` or AMX, an Arm CPU with ``bf16``) and the model's own dtype everywhere else: without
bf16 units a bf16 product is emulated and no faster than fp32 (docs/policies.md has the numbers).
"""

from __future__ import annotations

import copy
import functools
import platform
import weakref

import torch
from torch import nn

REPLAY_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

AUTO = "auto"  # bf16 where the hardware runs it natively, else the model's dtype (resolve_dtype)

# layers -> (dtype, weight versions, cast copy)
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _versions(layers: nn.ModuleList) -> tuple[int, ...]:
    return tuple(p._version for p in layers.parameters())


@functools.cache
def _cpu_has_bf16() -> bool:
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:  # Arm: the kernel lists the BF16 extension as "bf16" among the CPU's features
            return " bf16" in open("/proc/cpuinfo").read()
        except OSError:
            return False
    if not torch.backends.mkldnn.is_available():  # x86 bf16 products run through oneDNN, or emulated
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence getattr
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def bf16_is_fast(device: torch.device | str) -> bool:
    """Whether ``device`` runs bf16 matrix products natively (not emulated through fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and _cpu_has_bf16()


def resolve_dtype(dtype: str, model_dtype: torch.dtype, device: torch.device | str) -> str:
    """``dtype`` itself unless it is ``"auto"``: then ``"bfloat16"`` for a float32 model on a device
    where :func:`bf16_is_fast`, else ``"model"`` (a half-precision model replays in its own dtype)."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if model_dtype == torch.float32 and bf16_is_fast(device) else "model"


def replay_layers(layers: nn.ModuleList, dtype: str) -> nn.ModuleList:
    """``layers`` themselves for ``dtype="model"`` or their own dtype; else a cast copy, kept per ``layers``.

    ``dtype="auto"`` is first resolved for the layers' dtype and device (:func:`resolve_dtype`). The
    copy's attention modules keep their ``layer_idx`` and config, so the same attention function
    (and :class:`~vlkv.runtime.replay.ReplayContext`) serves both.
    """
    first = next(layers.parameters())
    dtype = resolve_dtype(dtype, first.dtype, first.device)
    if dtype == "model":
        return layers
    want = REPLAY_DTYPES[dtype]
    if first.dtype == want:
        return layers
    versions = _versions(layers)
    held = _COPIES.get(layers)
    if held is not None and held[0] == want and held[1] == versions:
        return held[2]
    cast = copy.deepcopy(layers).to(want)
    for p in cast.parameters():
        p.requires_grad_(False)
    _COPIES[layers] = (want, versions, cast)
    return cast
