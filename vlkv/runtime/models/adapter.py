"""Family adapters: what the runtime must know about a LLaVA / LLaVA-Next / Qwen2-VL model.

An adapter exposes the language model's pieces (layers, norm, rotary, head), its KV layout
(GQA), its rotary kind (1-D or 3-D M-RoPE) and how a prompt's image features and positions
are produced. Everything else in the runtime is family-agnostic.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vlkv.runtime.models import device_layer
from vlkv.runtime.models.skinny_layer import layer_forward, linear, skinny_from_env, supports


@dataclass(frozen=True)
class LayerLayout:
    """KV layout shared by every decoder layer."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pos_dims: int  # 1 for 1-D RoPE, 3 for M-RoPE


class FamilyAdapter:
    """Base adapter for HF ``*ForConditionalGeneration`` VLMs whose LM lives at ``model.model.language_model``."""

    family = "base"
    pos_dims = 1
    # processor outputs that are not vision-tower inputs
    _text_keys = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")

    def __init__(self, model: nn.Module, image_token_id: int):
        self.model = model
        self.image_token_id = image_token_id
        self.lm = model.model.language_model
        self.text_config = self.lm.config
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layout = LayerLayout(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            pos_dims=self.pos_dims,
        )
        # no-grad steps' few-row GEMMs as (W @ xᵀ)ᵀ (skinny_layer; VLKV_SKINNY_GEMM=0: the HF layers)
        self.skinny = skinny_from_env()
        # the Triton device path's decode layer (device_layer), set by the backend once it fused the weights
        self.device_layer = False

    # -- pieces the backend drives
    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.layers

    @property
    def norm(self) -> nn.Module:
        return self.lm.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def run_layer(
        self, layer: nn.Module, hidden: Tensor, ctx, cos_sin: tuple[Tensor, Tensor], fast: bool = False
    ) -> Tensor:
        """One decoder layer over ``hidden (B, q, hidden)`` with ``ctx`` as its cache and mask.

        ``fast``: with ``self.skinny`` and a layer class in ``skinny_layer.SKINNY_LAYERS``, the layer
        runs as ``skinny_layer.layer_forward`` (the HF layer's modules and order, few-row GEMMs as
        ``(W @ xᵀ)ᵀ``). Only no-grad steps ask for it (replay's gradients go through the HF layers). transformers renamed the layers' cache argument
        (``past_key_values`` → ``cache``, 5.2x; the old name warns and goes in 5.40), so the name is
        read off the layer's signature once.
        """
        if fast and self.device_layer:
            fused = device_layer.prepared(layer, hidden, cos_sin[0])
            if fused is not None:
                return device_layer.forward(fused, layer, hidden, ctx, cos_sin)
        if fast and self.skinny and supports(layer):
            return layer_forward(layer, hidden, ctx, cos_sin)
        name = self._cache_arg
        if name is None:
            params = inspect.signature(type(layer).forward).parameters
            name = self._cache_arg = "cache" if "cache" in params else "past_key_values"
        return layer(hidden, attention_mask=ctx, position_embeddings=cos_sin, **{name: ctx})

    _cache_arg: str | None = None

    def head(self, hidden: Tensor, fast: bool = False) -> Tensor:
        """``(..., hidden)`` → ``(..., vocab)`` logits; ``fast`` with ``self.skinny``: a decode step's few
        rows in the skinny form (the output head is a fifth of a small model's weights)."""
        head = self.lm_head
        if fast and self.skinny and type(head) is nn.Linear:
            return linear(hidden, head.weight, head.bias)
        return head(hidden)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """``(B, q)`` ids → ``(B, q, hidden)`` embeddings."""
        return self.model.model.get_input_embeddings()(ids)

    def rotary(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin for ``positions (B, q, P)`` as the family's attention expects them."""
        return self.lm.rotary_emb(hidden, positions[..., 0])

    # -- prompt encoding
    def vision_inputs(self, processed: dict) -> dict[str, Tensor]:
        return {k: v for k, v in processed.items() if k not in self._text_keys and v is not None}

    @torch.no_grad()
    def image_features(self, vision: dict[str, Tensor]) -> Tensor:
        """``(n_image_tokens, hidden)`` projected features of one prompt's images, in prompt order."""
        if not vision:
            return torch.zeros(0, self.text_config.hidden_size, dtype=self.model.dtype)
        out = self.model.model.get_image_features(**vision, return_dict=True)
        feats = out.pooler_output
        feats = feats if isinstance(feats, (list, tuple)) else [feats]
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats], dim=0)

    def positions(self, input_ids: Tensor, processed: dict) -> Tensor:
        """``(n, P)`` int64 RoPE positions of one prompt's tokens (``input_ids (n,)``)."""
        return torch.arange(input_ids.shape[0], dtype=torch.long)[:, None]

    def select_images(self, vision: dict[str, Tensor], keep: list[bool]) -> dict[str, Tensor]:
        """One prompt's vision inputs for the images where ``keep`` is True (the linker computes only
        the images it has no record of). Every per-image tensor here has the images on dim 0."""
        idx = [i for i, k in enumerate(keep) if k]
        if not idx:
            return {}
        return {name: t[torch.tensor(idx, dtype=torch.long, device=t.device)] for name, t in vision.items()}


class LlavaAdapter(FamilyAdapter):
    """LLaVA-1.5 (CLIP tower + projector) and LLaVA-1.6 (anyres, newline tokens count as image)."""

    family = "llava"


class LlavaNextAdapter(LlavaAdapter):
    family = "llava_next"


class Qwen2VLAdapter(FamilyAdapter):
    """Qwen2-VL: 3-D M-RoPE positions (temporal, height, width) from ``get_rope_index``."""

    family = "qwen2_vl"
    pos_dims = 3

    def rotary(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.lm.rotary_emb(hidden, positions.permute(2, 0, 1))

    def select_images(self, vision: dict[str, Tensor], keep: list[bool]) -> dict[str, Tensor]:
        """Qwen2-VL flattens every image's patches into one ``pixel_values``: cut by each grid's size."""
        if not any(keep):
            return {}
        grid = vision["image_grid_thw"]
        sizes = grid.prod(-1).tolist()
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        pix = vision["pixel_values"]
        rows = [torch.arange(s, s + n, device=pix.device) for s, n, k in zip(starts, sizes, keep) if k]
        sel = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long, device=grid.device)
        out = {name: t for name, t in vision.items() if name not in ("pixel_values", "image_grid_thw")}
        out["pixel_values"] = pix[torch.cat(rows)]
        out["image_grid_thw"] = grid[sel]
        return out

    def positions(self, input_ids: Tensor, processed: dict) -> Tensor:
        grid = processed.get("image_grid_thw")
        if grid is None:
            return torch.arange(input_ids.shape[0], dtype=torch.long)[:, None].expand(-1, 3).contiguous()
        ids = input_ids[None]
        types = processed.get("mm_token_type_ids")
        if types is None:
            types = (ids == self.image_token_id).int()
        pos, _ = self.model.model.get_rope_index(
            ids, mm_token_type_ids=types.reshape(ids.shape), image_grid_thw=grid
        )
        return pos[:, 0].T.contiguous()  # (n, 3)


ADAPTERS: dict[str, type[FamilyAdapter]] = {
    "llava": LlavaAdapter,
    "llava_next": LlavaNextAdapter,
    "qwen2_vl": Qwen2VLAdapter,
}


def make_adapter(family: str, model: nn.Module, image_token_id: int) -> FamilyAdapter:
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[family](model, image_token_id)
