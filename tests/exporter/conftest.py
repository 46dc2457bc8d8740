"""Tiny seeded models for the exporter tests, built from configs in code (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

VOCAB = 128
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _seeded(make, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().eval()


def _clip() -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
    )


@pytest.fixture(scope="session")
def tiny_llava() -> LlavaForConditionalGeneration:
    """CLIP 56 px / patch 14 (16 tokens per image, CLS dropped) + 2-layer Llama LM with GQA."""
    config = LlavaConfig(
        vision_config=_clip(),
        text_config=LlamaConfig(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        image_token_id=VOCAB - 1,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return _seeded(lambda: LlavaForConditionalGeneration(config))


@pytest.fixture(scope="session")
def tiny_llava_next() -> LlavaNextForConditionalGeneration:
    """LLaVA-NeXT layout: anyres grids of 1x2, 2x1, 2x2 tiles of 56 px, Mistral LM."""
    config = LlavaNextConfig(
        vision_config=_clip(),
        text_config=MistralConfig(**TEXT, sliding_window=None),
        image_token_id=VOCAB - 1,
        image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return _seeded(lambda: LlavaNextForConditionalGeneration(config))


@pytest.fixture(scope="session")
def tiny_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    """2-block ViT (embed 32, 4 heads, 2x2 merger) + 2-layer Qwen2 LM with M-RoPE sections [2, 3, 3]."""
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
        ),
        image_token_id=VOCAB - 3,
        video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 1,
    )
    return _seeded(lambda: Qwen2VLForConditionalGeneration(config))


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return _seeded(lambda: LlamaForCausalLM(config), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = _seeded(lambda: Qwen2ForCausalLM(config), seed=2)
    with torch.no_grad():  # HF initialises biases to 0; non-zero biases make the qkv.bias mapping observable
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return model


@pytest.fixture(scope="session")
def tiny_llava_dir(tiny_llava, tmp_path_factory):
    """``tiny_llava`` saved as a local checkpoint directory (the path form of model.name_or_path)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llava-hf"
    tiny_llava.save_pretrained(path)
    return path
