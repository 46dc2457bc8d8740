"""A LLaVA projector with a learned per-patch additive term: the image tokens' own position signal.

In a row-major 16x16 patch raster the patches of a left and a right object interleave row by row,
so which object is where reaches the language model only through each image token's index modulo
16 (and whatever position the frozen vision features still carry). :class:`PositionBiasedProjector`
adds ``position_bias[p]`` to patch ``p``'s output, so a token can say "left" in the LM's own
embedding space *on top of* what it says about the object, without sharing the object's words'
budget (``docs/benchmarks/2026-11-26-vqa6-cpu-x86_64``).

A projector file holding :data:`POSITION_KEY` installs this module in place of the plain MLP
(:func:`install`); a file without it leaves (or puts back) the plain ``LlavaMultiModalProjector``,
so such files load exactly as before.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from vlkv.runtime.models.projector_order import ORDER_KEY, OrderedProjector
from vlkv.runtime.models.projector_pool import POOL_KEY, PooledProjector

POSITION_KEY = "position_bias"


class PositionBiasedProjector(LlavaMultiModalProjector):
    """``mlp(x) + position_bias``: the HF MLP (same tensor names) plus ``position_bias`` ``(patches, hidden)``.

    ``forward``: ``image_features`` ``(images, patches, vision_hidden)`` → ``(images, patches, hidden)``.
    """

    def __init__(self, config, num_patches: int):
        if num_patches < 1:
            raise ValueError(f"num_patches must be >= 1, got {num_patches}")
        # the parent draws random Linear weights that install() replaces: keep the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            super().__init__(config)
        self.position_bias = torch.nn.Parameter(torch.zeros(num_patches, config.text_config.hidden_size))

    def forward(self, image_features: Tensor) -> Tensor:
        out = super().forward(image_features)
        if out.shape[-2] != self.position_bias.shape[0]:
            raise ValueError(
                f"position-biased projector holds {self.position_bias.shape[0]} patches, got {out.shape[-2]}"
            )
        return out + self.position_bias.to(out.dtype)


def install(model, state: dict[str, Tensor]) -> torch.nn.Module:
    """Make ``model.model.multi_modal_projector`` the module ``state`` needs and load ``state`` into it.

    ``state`` holding :data:`POSITION_KEY` → a :class:`PositionBiasedProjector`; holding
    :data:`~vlkv.runtime.models.projector_order.ORDER_KEY` → an
    :class:`~vlkv.runtime.models.projector_order.OrderedProjector`; holding
    :data:`~vlkv.runtime.models.projector_pool.POOL_KEY` → a
    :class:`~vlkv.runtime.models.projector_pool.PooledProjector` (at most one of the three: a bias
    is indexed by patch, an order moves patches, pooling merges them); none → the plain MLP (the current one when it is plain, so
    nothing else changes). Tensors are assigned, not copied, floating ones cast to the projector's
    dtype (the current ones may be memory-mapped from a cache that is never written in place).
    Returns the installed projector.
    """
    current = model.model.multi_modal_projector
    dtype = current.linear_1.weight.dtype
    if sum(key in state for key in (POSITION_KEY, ORDER_KEY, POOL_KEY)) > 1:
        raise ValueError(f"a projector holds one of {POSITION_KEY}, {ORDER_KEY}, {POOL_KEY}, not several")
    if POSITION_KEY in state:
        proj = PositionBiasedProjector(model.config, state[POSITION_KEY].shape[0]).to(dtype)
    elif ORDER_KEY in state:
        proj = OrderedProjector(model.config, state[ORDER_KEY]).to(dtype)
    elif POOL_KEY in state:
        proj = PooledProjector(model.config, int(state[POOL_KEY])).to(dtype)
    elif type(current) is not LlavaMultiModalProjector:
        with torch.random.fork_rng(devices=[]):
            proj = LlavaMultiModalProjector(model.config).to(dtype)
    else:
        proj = current
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    proj.load_state_dict(cast, strict=True, assign=True)
    model.model.multi_modal_projector = proj
    return proj
