"""A LLaVA projector that average-pools the vision tower's patch raster before its MLP: fewer image tokens.

With ``token_pool = 2`` the 16x16 patch raster becomes 8x8 = 64 image tokens, each the MLP of the
mean of a 2x2 block of patches. An object covers a few dense tokens instead of many sparse ones, and
the language model's prompt (hence a training step) is ~190 tokens shorter per image.

:class:`PooledProjector` pools inside the projector module, so every path that calls it (prefill,
linking records, the ONNX vision export) sees the same tokens. A projector file holding
:data:`POOL_KEY` installs it (:func:`vlkv.runtime.models.projector_position.install`); a file without
it loads the plain MLP exactly as before. The processor must expand each ``<image>`` placeholder to
the pooled count: :func:`processor_patch_size` gives the patch size that makes it count so.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

POOL_KEY = "token_pool"
POOLS = (1, 2)  # 1: no pooling (the plain MLP); 2: 2x2 blocks


def check_pool(pool: Tensor | int, num_patches: int) -> int:
    """The pool factor as an int; one line naming the problem unless it is in :data:`POOLS` and
    divides the side of a square raster of ``num_patches``."""
    if isinstance(pool, Tensor):
        if pool.dtype not in (torch.int32, torch.int64) or pool.numel() != 1:
            raise ValueError(f"{POOL_KEY} must be one integer, got {pool.dtype} {tuple(pool.shape)}")
        pool = int(pool.item())
    side = math.isqrt(num_patches)
    if pool not in POOLS:
        raise ValueError(f"{POOL_KEY} must be one of {list(POOLS)}, got {pool}")
    if num_patches < 1 or side * side != num_patches or side % pool:
        raise ValueError(
            f"{POOL_KEY} {pool} needs a square raster of side divisible by it, got {num_patches} patches"
        )
    return pool


def pool_patches(features: Tensor, pool: int) -> Tensor:
    """``(images, side², d)`` row-major patches → ``(images, (side / pool)², d)``, each the mean of a
    ``pool x pool`` block, row-major again."""
    images, patches, dim = features.shape
    side = math.isqrt(patches)
    if side * side != patches or side % pool:
        raise ValueError(
            f"pooling by {pool} needs a square raster of side divisible by it, got {patches} patches"
        )
    grid = features.reshape(images, side // pool, pool, side // pool, pool, dim)
    return grid.mean(dim=(2, 4)).reshape(images, (side // pool) ** 2, dim)


def processor_patch_size(patch_size: int, pool: int) -> int:
    """The patch size a LLaVA processor must count with so each image expands to the pooled tokens."""
    return patch_size * pool


class PooledProjector(LlavaMultiModalProjector):
    """The HF MLP (same tensor names) applied to ``token_pool x token_pool`` block means of the patches.

    ``forward``: ``image_features`` ``(images, side², vision_hidden)`` →
    ``(images, (side / token_pool)², hidden)``; token ``j`` is the MLP of block ``j``'s mean patch.
    """

    def __init__(self, config, pool: int):
        if pool not in POOLS:
            raise ValueError(f"{POOL_KEY} must be one of {list(POOLS)}, got {pool}")
        # the parent draws random Linear weights that install() replaces: keep the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            super().__init__(config)
        self.register_buffer(POOL_KEY, torch.tensor(pool, dtype=torch.int64), persistent=True)
        self.pool_factor = pool  # a Python int: the reshape must not depend on a tensor (ONNX export)

    def pool(self, image_features: Tensor) -> Tensor:
        """The MLP's input: ``(images, side², d)`` → ``(images, (side / pool)², d)``."""
        return pool_patches(image_features, self.pool_factor)

    def forward(self, image_features: Tensor) -> Tensor:
        return super().forward(self.pool(image_features))


def match_processor(processor, model) -> None:
    """Make ``processor`` expand each ``<image>`` to as many tokens as ``model``'s projector emits
    (the processor counts ``(side / its patch size)²`` tokens; the tower's patch is the config's)."""
    pool = getattr(model.model.multi_modal_projector, "pool_factor", 1)
    processor.patch_size = processor_patch_size(model.config.vision_config.patch_size, pool)
