"""Tiny, seeded LLaVA / LLaVA-NeXT / Qwen2-VL models with matching processors, built in code.

They exist so that every runtime path (prefill with images, decode, KV compression, export) can be
exercised on CPU in milliseconds without downloading anything. The same ``seed`` always gives the
same weights, whatever ``dtype`` is asked for (weights are drawn in float32, then cast).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)

# The "Pil" image processors: the default ("fast") ones need torchvision, which vlkv does not require.
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlkv.runtime.models.tokenizer import build_tokenizer


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for images and text only.

    The stock class cannot be constructed without torchvision, even with ``video_processor=None``:
    its argument check looks up the video processor base class, which transformers only exports
    when torchvision is installed. Dropping the argument from ``__init__`` drops it from
    ``get_attributes()``, so nothing video-related is checked, saved or loaded. Everything else,
    including the ``<|image_pad|>`` expansion, is the stock implementation.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs
        )

    def to_dict(self) -> dict:
        # Saved directories name the stock class so that AutoProcessor (with torchvision) loads them.
        return super().to_dict() | {"processor_class": "Qwen2VLProcessor"}


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny model; the defaults give 4 decoder layers of 4 query / 2 KV heads of dim 16.

    ``initializer_range`` is the std of the language model's Linear and embedding weights.
    ``image_size`` is the CLIP tower's input side (one tile) for LLaVA(-NeXT). LLaVA-NeXT's largest
    anyres grid and Qwen2-VL's ``max_pixels`` both allow up to a ``2 * image_size`` square.
    """

    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vision_hidden_size: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 56
    patch_size: int = 14
    # 10x HF's usual 0.02: at 0.02 a 64-wide LM has uniform attention (normalised entropy 1.000)
    # and near-identity layers, which leaves attention-score KV policies nothing to rank. At 0.2 the
    # last-row entropy is 0.4-0.7 and hidden states grow over depth as in trained models.
    initializer_range: float = 0.2
    max_position_embeddings: int = 4096
    # None: exactly the tokenizer's size. Larger only for speed measurements at a real model's shape
    # (the output head is part of every decode step's weight read); never for generating text.
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("vision_hidden_size", "vision_layers", "vision_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size must be a multiple of num_heads={self.num_heads}, got {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        if self.head_dim % 8:
            # Qwen2-VL's M-RoPE splits head_dim / 2 rotary pairs into 3 sections; see mrope_section.
            raise ValueError(f"hidden_size / num_heads must be a multiple of 8, got {self.head_dim}")
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError(
                f"vision_hidden_size must be a multiple of vision_heads={self.vision_heads}, "
                f"got {self.vision_hidden_size}"
            )
        if self.patch_size < 1 or self.image_size % (2 * self.patch_size):
            raise ValueError(
                f"image_size must be a positive multiple of 2 * patch_size={2 * self.patch_size}, "
                f"got {self.image_size}"
            )
        if not 0.0 < self.initializer_range <= 1.0:
            raise ValueError(f"initializer_range must be in (0, 1], got {self.initializer_range}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mrope_section(self) -> list[int]:
        """Temporal / height / width split of the head_dim / 2 rotary pairs, in Qwen2-VL's 2:3:3 ratio."""
        half = self.head_dim // 2
        t = half // 4
        h = (half - t) // 2
        return [t, h, half - t - h]


def _text_kwargs(spec: TinySpec, tok: PreTrainedTokenizerFast) -> dict:
    return {
        # Exactly the tokenizer's size, not padded: a randomly initialised LM head would happily
        # generate ids that the tokenizer cannot decode.
        "vocab_size": max(spec.vocab_size or 0, len(tok)),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
    }


def _clip_config(spec: TinySpec) -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=2 * spec.vision_hidden_size,
        projection_dim=spec.vision_hidden_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
    )


def _clip_image_processor(spec: TinySpec) -> CLIPImageProcessorPil:
    side = spec.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _seeded(
    seed: int, dtype: torch.dtype, tok: PreTrainedTokenizerFast, make: Callable[[], PreTrainedModel]
) -> PreTrainedModel:
    # fork_rng keeps the caller's global RNG stream untouched by model construction.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    return model.to(dtype).eval()


def build_tiny_llava(
    spec: TinySpec | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """LLaVA-1.5 layout: CLIP tower (CLS dropped) → 2-layer MLP projector → Llama with GQA.

    With the default spec an image becomes (56 / 14)**2 = 16 ``<image>`` tokens.
    """
    spec = spec or TinySpec()
    tokenizer = build_tokenizer("llava")
    config = LlavaConfig(
        vision_config=_clip_config(spec),
        text_config=LlamaConfig(**_text_kwargs(spec, tokenizer)),
        image_token_id=tokenizer.image_token_id,
        image_seq_length=(spec.image_size // spec.patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = _seeded(seed, dtype, tokenizer, lambda: LlavaForConditionalGeneration(config))
    processor = LlavaProcessor(
        image_processor=_clip_image_processor(spec),
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which the "default" strategy then drops
    )
    return model, processor


def build_tiny_llava_next(
    spec: TinySpec | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlavaNextForConditionalGeneration, LlavaNextProcessor]:
    """LLaVA-1.6 layout: anyres tiling over grids of 1x2, 2x1 and 2x2 tiles, Mistral LM with GQA.

    The token count depends on the image's size: a square image larger than one tile takes the 2x2
    grid, i.e. 16 base tokens + 8 * 8 tile tokens + 8 row-newline tokens = 88 ``<image>`` tokens.
    """
    spec = spec or TinySpec()
    tokenizer = build_tokenizer("llava_next")
    side = spec.image_size
    pinpoints = [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    config = LlavaNextConfig(
        vision_config=_clip_config(spec),
        text_config=MistralConfig(sliding_window=None, **_text_kwargs(spec, tokenizer)),
        image_token_id=tokenizer.image_token_id,
        image_grid_pinpoints=pinpoints,
        image_seq_length=(side // spec.patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = _seeded(seed, dtype, tokenizer, lambda: LlavaNextForConditionalGeneration(config))
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        image_grid_pinpoints=pinpoints,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return model, processor


def build_tiny_qwen2_vl(
    spec: TinySpec | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Qwen2VLForConditionalGeneration, Qwen2VLImageTextProcessor]:
    """Qwen2-VL layout: ViT with 2x2 patch merging, Qwen2 LM with GQA and M-RoPE.

    Images are resized to multiples of 28 px with at most ``(2 * image_size)**2`` pixels (default
    112x112), so a square image of 112 px or more gives (112 / 28)**2 = 16 ``<|image_pad|>`` tokens.
    """
    spec = spec or TinySpec()
    tokenizer = build_tokenizer("qwen2_vl")
    text = _text_kwargs(spec, tokenizer)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": spec.mrope_section}
    ids = tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": spec.vision_layers,
            "embed_dim": spec.vision_hidden_size,
            "hidden_size": spec.hidden_size,  # the patch merger projects straight into the LM width
            "num_heads": spec.vision_heads,
            "mlp_ratio": 2,
            "patch_size": spec.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
        tie_word_embeddings=False,
    )
    model = _seeded(seed, dtype, tokenizer, lambda: Qwen2VLForConditionalGeneration(config))
    factor = 2 * spec.patch_size
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=factor * factor,
        max_pixels=(2 * spec.image_size) ** 2,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )
    processor = Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return model, processor


TINY_BUILDERS: dict[str, Callable[..., tuple[PreTrainedModel, ProcessorMixin]]] = {
    "tiny-llava": build_tiny_llava,
    "tiny-llava-next": build_tiny_llava_next,
    "tiny-qwen2-vl": build_tiny_qwen2_vl,
}
