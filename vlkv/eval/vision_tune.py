"""The vision tower's last blocks before the layer the projector reads, trained with it.

``smollm2-llava`` reads DINOv2's hidden state ``vision_feature_layer`` (8): the output of encoder
blocks ``0 .. 7``. ``blocks = n`` trains the last ``n`` of those (``8 - n .. 7``); later blocks never
reach the projector. Their tensors travel under :data:`PREFIX` + the tower's own parameter names
(DINOv2's ``vision_tower.encoder.layer.7.mlp.fc1.weight``), in a training checkpoint's ``vision`` entry and in
an exported projector file beside the projector's tensors: a file's vision tensors replace the
tower's, whole. A vision tower run on its own (no LLaVA wrapper) reads its ``hidden_states`` index
the same way, so this needs only the tower and the read layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

PREFIX = "vision_tower."


def _blocks(tower) -> tuple[str, torch.nn.ModuleList]:
    """The tower's encoder blocks and their name inside it (DINOv2 ``encoder.layer``, CLIP's
    ``vision_model.encoder.layers``)."""
    for name, module in tower.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith(("encoder.layer", "encoder.layers")):
            return name, module
    raise ValueError(f"no encoder blocks found in the vision tower {type(tower).__name__}")


def read_layer(model) -> int:
    """The hidden-state index the projector reads (``config.vision_feature_layer``, one int >= 1)."""
    layer = model.config.vision_feature_layer
    blocks = len(_blocks(model.model.vision_tower)[1])
    if not isinstance(layer, int):
        raise ValueError(f"vision tuning needs one vision_feature_layer, got {layer!r}")
    return layer % (blocks + 1) if layer < 0 else layer


def tuned_blocks(model, blocks: int) -> range:
    """Indices of the ``blocks`` encoder blocks just before the read layer; one line if too many."""
    layer = read_layer(model)
    if not 0 <= blocks <= layer:
        raise ValueError(f"vision blocks must be in 0..{layer} (the read layer's blocks), got {blocks}")
    return range(layer - blocks, layer)


def named_params(model, blocks: int) -> dict[str, torch.nn.Parameter]:
    """The trained blocks' parameters by their file names (:data:`PREFIX` + the tower's names), in
    the tower's order."""
    tower = model.model.vision_tower
    where = _blocks(tower)[0]
    keep = tuple(f"{where}.{i}." for i in tuned_blocks(model, blocks))
    return {PREFIX + name: p for name, p in tower.named_parameters() if name.startswith(keep)}


def state(model, blocks: int) -> dict[str, Tensor]:
    """Detached copies of the trained blocks' tensors (a checkpoint's ``vision`` entry)."""
    return {k: p.detach().clone() for k, p in named_params(model, blocks).items()}


def split(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(everything else, the vision tensors)`` of a projector file's or checkpoint's tensors."""
    vision = {k: v for k, v in tensors.items() if k.startswith(PREFIX)}
    return {k: v for k, v in tensors.items() if k not in vision}, vision


@torch.no_grad()
def load(model, tensors: dict[str, Tensor]) -> None:
    """Put vision tensors (:data:`PREFIX` names) into ``model``'s tower, cast to its dtype; one line
    naming the first unknown or misshapen one. New tensors are assigned, never written in place (the
    tower's weights may be memory-mapped from the model cache)."""
    tower = model.model.vision_tower
    params = dict(tower.named_parameters())
    for key, value in tensors.items():
        name = key.removeprefix(PREFIX)
        if not key.startswith(PREFIX) or name not in params:
            raise ValueError(f"{key} is not a vision tower parameter")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}, the tower's is {tuple(params[name].shape)}"
            )
        module_name, _, leaf = name.rpartition(".")
        module = tower.get_submodule(module_name)
        old = getattr(module, leaf)
        setattr(
            module, leaf, torch.nn.Parameter(value.to(old.dtype).clone(), requires_grad=old.requires_grad)
        )
