"""The replay's compute dtype: a cast copy of the decoder layers, made once per model.

Scoring only needs a *ranking*, and on CPUs with bf16 matrix units (x86 ``avx512_bf16`` / AMX, Arm
``bf16``) a bf16 matrix product runs several times faster than an fp32 one (4.5× for a
``1024 × 576 × 1536`` product at 1 thread on the 2-core AMD EPYC VM of the benchmarks). So a fp32
model may replay in bf16: the replay rows, the layers' weights and the attention run in bf16; the
cache is read as it is (cast per layer), the scores and KVgrad's ``||W_O v||`` stay float32 from the
model's own weights. The copy is kept per layer list (weakly: it goes with the model) and remade
when a weight of the model changes in place (its version counter moves), so training a projector or
loading weights never leaves a stale copy.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

REPLAY_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# layers -> (dtype, weight versions, cast copy)
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _versions(layers: nn.ModuleList) -> tuple[int, ...]:
    return tuple(p._version for p in layers.parameters())


def replay_layers(layers: nn.ModuleList, dtype: str) -> nn.ModuleList:
    """``layers`` themselves for ``dtype="model"`` or their own dtype; else a cast copy, kept per ``layers``.

    The copy's attention modules keep their ``layer_idx`` and config, so the same attention function
    (and :class:`~vlkv.runtime.replay.ReplayContext`) serves both.
    """
    if dtype == "model":
        return layers
    want = REPLAY_DTYPES[dtype]
    if next(layers.parameters()).dtype == want:
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
