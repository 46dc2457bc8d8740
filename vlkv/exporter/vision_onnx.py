"""Stage ``vision_onnx``: vision tower + projector → ``vision.onnx``, checked against PyTorch.

The graph is always float32, whatever ``model.dtype`` is: ONNX Runtime's CPU kernels for fp16/bf16
are incomplete, and TensorRT lowers precision itself (``trt.fp16``). It is exported with the legacy
TorchScript exporter (``dynamo=False``): 0.2 s instead of 3.5 s for the same graph (toolchain.md A7).

Outputs in ``out_dir``: ``vision.onnx``, ``vision_config.json`` (I/O names, dynamic dims, token
counts), ``metrics.json`` (max abs error vs PyTorch, Polygraphy verdict) and, for LLaVA-NeXT,
``image_newlines.safetensors`` (the host-side newline embedding, named as TensorRT-LLM expects).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from vlkv.exporter.comparison import Comparison, compare_onnx
from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe import Recipe, VisionSection
from vlkv.exporter.source import load_source_model
from vlkv.exporter.vision_tower import (
    max_visual_tokens,
    qwen2_vl_host_inputs,
    qwen2_vl_patch_dim,
    vision_encoder,
)

VISION_ONNX = "vision.onnx"
DEFAULT_ATOL = 1e-4


@dataclass(frozen=True)
class VisionCase:
    """One validation input: named float32 feeds for the graph."""

    label: str
    feeds: dict[str, torch.Tensor]


def sample_cases(
    model: PreTrainedModel, family: str, section: VisionSection, seed: int = 0
) -> list[VisionCase]:
    """Seeded inputs covering the profile: batches {min, opt, max} (LLaVA) or 1 and 2 images (Qwen2-VL)."""
    gen = torch.Generator().manual_seed(seed)
    if family == "qwen2_vl":
        merge = model.config.vision_config.spatial_merge_size
        _, h, w = section.sample_grid_thw
        if h % merge or w % merge:
            raise StageError(
                f"vision.sample_grid_thw: h and w must be multiples of spatial_merge_size={merge}, got {section.sample_grid_thw}"
            )
        cases = []
        for images in (1, 2):
            grid = torch.tensor([section.sample_grid_thw] * images)
            patches = int(grid.prod(-1).sum())
            feeds = {"input": torch.randn(patches, qwen2_vl_patch_dim(model), generator=gen)}
            feeds |= qwen2_vl_host_inputs(model, grid)
            cases.append(VisionCase(f"images={images}", feeds))
        return cases
    side = model.config.vision_config.image_size
    batches = (
        sorted({section.min_batch, section.opt_batch, section.max_batch})
        if section.dynamic_batch
        else [section.max_batch]
    )
    return [
        VisionCase(f"batch={b}", {"input": torch.randn(b, 3, side, side, generator=gen)}) for b in batches
    ]


def _io(family: str, dynamic_batch: bool) -> tuple[list[str], dict[str, dict[int, str]]]:
    if family == "qwen2_vl":
        dims = {
            "input": {0: "num_patches"},
            "rotary_pos_emb": {0: "num_patches"},
            "attention_mask": {1: "num_patches", 2: "num_patches"},
            "encoder_output": {0: "num_tokens"},
        }
        return ["input", "rotary_pos_emb", "attention_mask"], dims
    dims = {"input": {0: "batch"}, "encoder_output": {0: "batch"}} if dynamic_batch else {}
    return ["input"], dims


def export_vision(
    encoder: nn.Module, family: str, example: VisionCase, path: Path, opset: int, dynamic_batch: bool
) -> None:
    """Trace ``encoder`` on ``example`` and write ``path`` (float32, dims from :func:`_io`)."""
    names, dynamic = _io(family, dynamic_batch)
    args = tuple(example.feeds[n] for n in names)
    with warnings.catch_warnings(), torch.no_grad():
        # The legacy exporter's deprecation and tracer warnings are expected noise here.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            encoder,
            args,
            str(path),
            input_names=names,
            output_names=["encoder_output"],
            dynamic_axes=dynamic,
            opset_version=opset,
            dynamo=False,
        )


def validate_vision(encoder: nn.Module, path: Path, cases: list[VisionCase], atol: float) -> Comparison:
    """ONNX Runtime (and Polygraphy) vs the PyTorch encoder on every case; atol = rtol = ``atol``."""
    feeds, reference = [], []
    with torch.no_grad():
        for case in cases:
            out = encoder(*case.feeds.values())
            feeds.append({k: v.numpy() for k, v in case.feeds.items()})
            reference.append({"encoder_output": out.numpy()})
    return compare_onnx(path, feeds, reference, atol=atol, rtol=atol)


def run(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    """Stage entry point: export, validate (fails above tolerance), write metrics and config."""
    family = recipe.model.family
    model = load_source_model(recipe.model)
    # A float32 copy of the encoder only: the language model is never duplicated.
    encoder = _float32_encoder(model, family)
    cases = sample_cases(model, family, recipe.vision)
    path = out_dir / VISION_ONNX
    start = time.perf_counter()
    export_vision(encoder, family, cases[0], path, recipe.vision.opset, recipe.vision.dynamic_batch)
    export_s = time.perf_counter() - start
    atol = recipe.vision.tolerance or DEFAULT_ATOL
    result = validate_vision(encoder, path, cases, atol)
    metrics = result.as_metrics() | {"export_seconds": round(export_s, 3), "cases": [c.label for c in cases]}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if not (result.passed and result.polygraphy_passed):
        raise StageError(
            f"vision.onnx differs from PyTorch: max abs err {result.max_abs_err:.3g} > tolerance {atol:g} "
            f"(polygraphy {'passed' if result.polygraphy_passed else 'failed'})"
        )
    _write_config(model, family, recipe.vision, out_dir)
    return out_dir


def _float32_encoder(model: PreTrainedModel, family: str) -> nn.Module:
    import copy

    encoder = vision_encoder(model, family)
    if next(encoder.parameters()).dtype == torch.float32:
        return encoder
    return copy.deepcopy(encoder).float()


def _write_config(model: PreTrainedModel, family: str, section: VisionSection, out_dir: Path) -> None:
    names, dynamic = _io(family, section.dynamic_batch)
    config = {
        "family": family,
        "dtype": "float32",
        "inputs": names,
        "outputs": ["encoder_output"],
        "dynamic_axes": {k: {str(a): d for a, d in v.items()} for k, v in dynamic.items()},
        "max_visual_tokens": max_visual_tokens(model.config, family, section.max_patches),
        "hidden_size": model.config.text_config.hidden_size,
    }
    if family == "qwen2_vl":
        vc = model.config.vision_config
        config |= {"patch_dim": qwen2_vl_patch_dim(model), "spatial_merge_size": vc.spatial_merge_size}
    else:
        config |= {"image_size": model.config.vision_config.image_size}
    if family == "llava_next":
        from safetensors.torch import save_file

        newline = model.model.image_newline.detach().float().contiguous()
        save_file({"image_newline": newline}, str(out_dir / "image_newlines.safetensors"))
    (out_dir / "vision_config.json").write_text(json.dumps(config, indent=2) + "\n")
