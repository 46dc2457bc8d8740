"""Language models at real checkpoint shapes with random weights, for speed and memory measurements.

A decode step's cost depends on the decoder's shape (layers, heads, KV heads, head dim, MLP width,
vocabulary), not on what the weights have learnt, so a GPU benchmark can run at LLaVA-1.5-7B's or
Qwen2-VL-7B's shape without any checkpoint travelling or downloading. The vision tower stays the
tiny one (16 image tokens per image): it runs once per image and is not what these measure.

Weights are created directly on ``device`` in ``dtype`` (a 7B model is ~14 GB in bf16 and would take
minutes to draw in float32 on a CPU first) and drawn from the model's own initialiser (std 0.02).
Nothing here is meant to produce sensible text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vlkv.runtime.models.registry import LoadedModel


@dataclass(frozen=True, kw_only=True)
class RealShape:
    """A decoder's shape; ``family`` picks the architecture (``llava`` = Llama LM, ``qwen2_vl`` = M-RoPE).

    ``max_position_embeddings`` is raised to 40,960 for every shape so 32k-token contexts fit: the
    benchmark measures the shape, not the checkpoint's trained context length.
    """

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        if self.family not in ("llava", "qwen2_vl"):
            raise ValueError(f"family must be 'llava' or 'qwen2_vl', got {self.family!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must divide hidden_size and num_kv_heads num_heads, got "
                f"{self.hidden_size}/{self.num_heads}/{self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K + V bytes of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


SHAPES: dict[str, RealShape] = {
    # llava-hf/llava-1.5-7b-hf's text_config (Vicuna-7B): 32 layers, MHA 32 heads of 128
    "llava-1.5-7b": RealShape(
        family="llava",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        vocab_size=32064,
    ),
    # Qwen/Qwen2-VL-7B-Instruct: 28 layers, GQA 28/4 heads of 128, M-RoPE sections [16, 24, 24]
    "qwen2-vl-7b": RealShape(
        family="qwen2_vl",
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    # toy versions of both, for the CPU dry run of the GPU check
    "toy-llava": RealShape(
        family="llava",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        vocab_size=1024,
    ),
    "toy-qwen2-vl": RealShape(
        family="qwen2_vl",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=1024,
    ),
}


def load_real_shape(
    name: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> LoadedModel:
    """A random-weight model of shape ``SHAPES[name]`` on ``device``, with the tiny model's processor."""
    from vlkv.runtime.models import tiny

    if name not in SHAPES:
        raise ValueError(f"unknown real shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    spec = tiny.TinySpec(
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        initializer_range=0.02,
        max_position_embeddings=shape.max_position_embeddings,
    )
    spec = replace(spec, vocab_size=shape.vocab_size)
    build = tiny.build_tiny_llava if shape.family == "llava" else tiny.build_tiny_qwen2_vl
    previous = torch.get_default_dtype()
    try:
        # drawn where they live, in the dtype they are used in
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model, processor = build(spec, seed=seed, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), processor, name, shape.family)
