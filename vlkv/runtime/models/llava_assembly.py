"""Joining a GGUF language model and a vision tower into a Hugging Face LLaVA: the plain text config,
the embedding rows padded for added tokens, and a seeded projector scaled to the text embeddings.

Used by :mod:`vlkv.runtime.models.smollm2_llava` when it assembles its first build.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LlamaConfig, LlavaForConditionalGeneration


def padded_vocab(n: int, multiple: int = 64) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (the embedding rows the model is built with)."""
    return -(-n // multiple) * multiple


def plain_text_config(gguf_config: LlamaConfig, vocab_size: int) -> LlamaConfig:
    """The GGUF model's config as a plain one (no quantization_config, so it can be saved)."""
    fields = gguf_config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "dtype",
        "transformers_version",
    ):
        fields.pop(key, None)
    fields["vocab_size"] = vocab_size
    return LlamaConfig(**fields)


def pad_embedding_rows(embed: Tensor, rows: int) -> Tensor:
    """``(vocab, hidden)`` -> ``(rows, hidden)``; new rows are the mean embedding.

    The rows are tied to lm_head, so the mean keeps the new tokens' logits ordinary instead of
    random (and it is deterministic).
    """
    extra = embed.mean(dim=0, keepdim=True).expand(rows - embed.shape[0], -1)
    return torch.cat([embed, extra], dim=0)


@torch.no_grad()
def seeded_projector(model: LlavaForConditionalGeneration, seed: int, image_size: int) -> None:
    """Seeded nn.Linear-style init, then rescale so image tokens have text embeddings' mean RMS.

    Unscaled, image embeddings are ~3x larger than text embeddings; real LLaVA projectors are
    trained, so matching the text scale is the neutral choice for KV statistics. The scale is
    measured on seeded noise pixels so it depends on nothing but the weights.
    """
    gen = torch.Generator().manual_seed(seed)
    projector = model.model.multi_modal_projector
    for linear in (projector.linear_1, projector.linear_2):
        bound = linear.in_features**-0.5
        for param in (linear.weight, linear.bias):
            param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) * bound)
    pixels = torch.randn(2, 3, image_size, image_size, generator=gen)
    features = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    image_rms = features.float().pow(2).mean(-1).sqrt().mean()
    embed = model.model.language_model.embed_tokens.weight
    text_rms = embed.float().pow(2).mean(-1).sqrt().mean()
    scale = (text_rms / image_rms).item()
    projector.linear_2.weight.mul_(scale)
    projector.linear_2.bias.mul_(scale)
