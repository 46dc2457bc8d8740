"""A LLaVA projector that emits its image tokens in another order than the vision tower's patch raster.

The vision tower's patches come row by row (row-major 16x16), so a left and a right object's
patches interleave: every row of the image alternates between them, and which object is where
reaches the language model only through each token's index modulo 16. In column-major order
(:func:`column_major`) each object's patches form one contiguous run, the left object's before the
right one's: the order in which the captions name them ("red star and white diamond").

:class:`OrderedProjector` applies the permutation inside the projector module, so every path that
calls it (prefill, linking records, the ONNX vision export) sees the same order. A projector file
holding :data:`ORDER_KEY` installs it (:func:`vlkv.runtime.models.projector_position.install`);
a file without it loads the plain MLP exactly as before.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

ORDER_KEY = "token_order"
ORDERS = ("raster", "columns")  # raster: the tower's own row-major order, i.e. no reordering


def column_major(num_patches: int) -> Tensor:
    """``(num_patches,)`` int64: output token ``j`` takes patch ``order[j]``, column by column.

    For a ``side x side`` raster (patch ``p = row * side + col``), token ``col * side + row`` is
    patch ``row * side + col``: the first ``side`` tokens are the leftmost column, top to bottom.
    """
    side = math.isqrt(num_patches)
    if num_patches < 1 or side * side != num_patches:
        raise ValueError(f"column order needs a square patch raster, got {num_patches} patches")
    return torch.arange(num_patches).view(side, side).t().reshape(-1)


def order_for(kind: str, num_patches: int) -> Tensor | None:
    """The permutation ``kind`` (:data:`ORDERS`) names, or None for the raster's own order."""
    if kind not in ORDERS:
        raise ValueError(f"token order must be one of {list(ORDERS)}, got {kind!r}")
    return None if kind == "raster" else column_major(num_patches)


def check_order(order: Tensor, num_patches: int) -> None:
    """One line naming the problem unless ``order`` is a permutation of ``range(num_patches)``."""
    if order.dtype not in (torch.int32, torch.int64) or order.dim() != 1:
        raise ValueError(f"{ORDER_KEY} must be a 1-d integer tensor, got {order.dtype} {tuple(order.shape)}")
    if order.numel() != num_patches or not torch.equal(order.sort().values, torch.arange(num_patches)):
        raise ValueError(f"{ORDER_KEY} is not a permutation of the {num_patches} image patches")


class OrderedProjector(LlavaMultiModalProjector):
    """The HF MLP (same tensor names) whose output tokens come in ``token_order`` ``(patches,)``.

    ``forward``: ``image_features`` ``(images, patches, vision_hidden)`` → ``(images, patches, hidden)``,
    token ``j`` of each image being the MLP of patch ``token_order[j]``. The MLP is per token, so
    reordering its input or its output is the same; the input is reordered (a gather the ONNX export
    keeps as one node).
    """

    def __init__(self, config, order: Tensor):
        check_order(order, order.numel())
        # the parent draws random Linear weights that install() replaces: keep the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            super().__init__(config)
        self.register_buffer(ORDER_KEY, order.to(torch.int64).clone(), persistent=True)

    def forward(self, image_features: Tensor) -> Tensor:
        if image_features.shape[-2] != self.token_order.shape[0]:
            raise ValueError(
                f"ordered projector holds {self.token_order.shape[0]} patches, got {image_features.shape[-2]}"
            )
        return super().forward(image_features.index_select(-2, self.token_order))
