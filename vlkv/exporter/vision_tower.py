"""Export-friendly vision encoders (tower + projector) for LLaVA, LLaVA-NeXT and Qwen2-VL.

I/O names follow TensorRT-LLM's ``build_multimodal_engine`` so that a vision engine built from our
ONNX drops into its ``engine_dir/vision``:

- LLaVA / LLaVA-NeXT: ``input (batch, 3, H, W)`` → ``encoder_output (batch, tokens, hidden)``. For
  LLaVA-NeXT, batch counts anyres crops; unpadding and ``image_newline`` stay on the host.
- Qwen2-VL: ``input (patches, C·T·P·P)``, ``rotary_pos_emb (patches, head_dim / 2)`` float32 and
  ``attention_mask (1, patches, patches)`` additive float32 → ``encoder_output (patches / merge², hidden)``.
  The rotary angles and the block-diagonal mask (one block per image, from ``grid_thw``) are computed
  on the host by :func:`qwen2_vl_host_inputs`: HF's per-image ``cu_seqlens`` split loops over Python
  ints, which a traced graph cannot do, and a mask input lets one graph serve any mix of image sizes.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class LlavaVisionEncoder(nn.Module):
    """CLIP (or any HF vision backbone) feature layer(s) → CLS dropped per strategy → projector.

    Matches ``LlavaModel.get_image_features`` before its per-image split.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.feature_layer = model.config.vision_feature_layer
        self.strategy = model.config.vision_feature_select_strategy

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """input: (batch, 3, H, W) float → (batch, tokens, hidden) float."""
        hidden = self.tower(input, output_hidden_states=True).hidden_states
        if isinstance(self.feature_layer, int):
            features = hidden[self.feature_layer]
        else:
            features = torch.cat([hidden[i] for i in self.feature_layer], dim=-1)
        if self.strategy == "default":
            features = features[:, 1:]
        return self.projector(features)


class Qwen2VLVisionEncoder(nn.Module):
    """Qwen2-VL's ViT + patch merger with masked (block-diagonal) eager attention.

    Uses the HF module's own weights and sub-modules; only the attention is re-expressed so that it
    takes an explicit mask instead of looping over ``cu_seqlens`` (same maths, see module doc).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.visual = model.model.visual

    def forward(
        self, input: torch.Tensor, rotary_pos_emb: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """input: (N, C·T·P·P); rotary_pos_emb: (N, head_dim / 2) fp32; attention_mask: (1, N, N) → (N / merge², hidden)."""
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

        hidden = self.visual.patch_embed(input)
        angles = torch.cat([rotary_pos_emb, rotary_pos_emb], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        mask = attention_mask.to(hidden.dtype)
        for block in self.visual.blocks:
            attn = block.attn
            x = block.norm1(hidden)
            n = x.shape[0]
            q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, N, head_dim)
            scores = torch.matmul(q, k.transpose(1, 2)) * attn.scaling + mask
            # Softmax in float32 as HF's eager path does; the mask's finfo.min then underflows to 0.
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, v).transpose(0, 1).reshape(n, -1)
            hidden = hidden + attn.proj(out)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return self.visual.merger(hidden)


def vision_encoder(model: PreTrainedModel, family: str) -> nn.Module:
    """The export wrapper for ``family`` (explicit map, no guessing from class names)."""
    wrappers: dict[str, type[nn.Module]] = {
        "llava": LlavaVisionEncoder,
        "llava_next": LlavaVisionEncoder,
        "qwen2_vl": Qwen2VLVisionEncoder,
    }
    return wrappers[family](model).eval()


def qwen2_vl_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(images, 3) int grid → (N, 2) int64 (row, col) per patch, in Qwen2-VL's merge-block order."""
    ids = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).unsqueeze(1).expand(h, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, w)
        # Patches are stored merge×merge block by block, so the grids are permuted the same way.
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        ids.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(ids)


def qwen2_vl_host_inputs(model: PreTrainedModel, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Host-side inputs for the Qwen2-VL encoder graph.

    Args:
        grid_thw: (images, 3) int64, the (t, h, w) patch grid of each image.

    Returns:
        ``rotary_pos_emb`` (N, head_dim / 2) float32 and ``attention_mask`` (1, N, N) float32, 0 inside
        an image (each temporal slice of an image is attended as in HF's ``cu_seqlens``) and finfo.min across.
    """
    visual = model.model.visual
    positions = qwen2_vl_position_ids(grid_thw, visual.spatial_merge_size)
    inv_freq = visual.rotary_pos_emb.inv_freq.float()
    freqs = positions[..., None].float() * inv_freq  # (N, 2, head_dim / 4)
    rotary = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    # HF attends within each (image, frame): cu_seqlens repeats h·w once per temporal slice.
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    segment = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    same = segment[:, None] == segment[None, :]
    mask = torch.zeros(same.shape, dtype=torch.float32).masked_fill(~same, torch.finfo(torch.float32).min)
    return {"rotary_pos_emb": rotary, "attention_mask": mask.unsqueeze(0)}


def qwen2_vl_patch_dim(model: PreTrainedModel) -> int:
    """Length of one flattened patch, C · T · P · P."""
    cfg = model.config.vision_config
    return cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size


def llava_tokens_per_image(config: PretrainedConfig) -> int:
    """Visual tokens one LLaVA tile yields: (side / patch)² (+1 when the CLS token is kept)."""
    vc = config.vision_config
    side = vc.image_size // vc.patch_size
    return side * side + (0 if config.vision_feature_select_strategy == "default" else 1)


def max_visual_tokens(config: PretrainedConfig, family: str, max_patches: int) -> int:
    """Upper bound on visual tokens of one image, used for TensorRT-LLM's ``max_multimodal_len``.

    LLaVA: one tile. LLaVA-NeXT: base tile + the largest anyres grid (before unpadding) + one newline
    per feature row. Qwen2-VL: ``max_patches / merge²``.
    """
    if family == "qwen2_vl":
        merge = config.vision_config.spatial_merge_size
        return max_patches // (merge * merge)
    per_tile = llava_tokens_per_image(config)
    if family == "llava":
        return per_tile
    tile = config.vision_config.image_size
    side = tile // config.vision_config.patch_size
    grids = [(ph // tile, pw // tile) for ph, pw in config.image_grid_pinpoints]
    most_tiles = max(h * w for h, w in grids)
    most_rows = max(h for h, _ in grids) * side
    return per_tile + most_tiles * side * side + most_rows
