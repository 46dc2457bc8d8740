from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from vlkv.exporter import vision_onnx
from vlkv.exporter.comparison import compare_onnx
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.stages import run_stages
from vlkv.exporter.vision_onnx import VisionCase, export_vision, sample_cases, validate_vision
from vlkv.exporter.vision_tower import (
    max_visual_tokens,
    qwen2_vl_host_inputs,
    qwen2_vl_patch_dim,
    qwen2_vl_position_ids,
    vision_encoder,
)

# float32 end to end: ONNX Runtime's kernels differ from PyTorch's only in summation order.
ATOL = {torch.float32: 1e-5}
RTOL = {torch.float32: 1e-5}


def _assert_close(actual, expected):
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    torch.testing.assert_close(actual, expected, atol=ATOL[expected.dtype], rtol=RTOL[expected.dtype])


def _images(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def _ort(path, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in feeds.items()})[0]


@pytest.fixture(scope="module")
def llava_onnx(tiny_llava, tmp_path_factory):
    path = tmp_path_factory.mktemp("llava") / "vision.onnx"
    encoder = vision_encoder(tiny_llava, "llava")
    export_vision(
        encoder, "llava", VisionCase("b2", {"input": _images(2, 0)}), path, opset=17, dynamic_batch=True
    )
    return path


def test_llava_encoder_matches_hf(tiny_llava):
    images = _images(3, 1)
    with torch.no_grad():
        ours = vision_encoder(tiny_llava, "llava")(images)
        hf = torch.stack(tiny_llava.model.get_image_features(pixel_values=images).pooler_output)
    assert ours.shape == (3, 16, 64)
    torch.testing.assert_close(ours, hf, atol=0, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_llava_onnx_matches_pytorch_for_any_batch(tiny_llava, llava_onnx, batch):
    images = _images(batch, 10 + batch)
    with torch.no_grad():
        hf = torch.stack(tiny_llava.model.get_image_features(pixel_values=images).pooler_output)
    _assert_close(_ort(llava_onnx, {"input": images}), hf)


def test_llava_onnx_batch_is_dynamic(llava_onnx):
    graph = onnx.load(str(llava_onnx)).graph
    assert [i.name for i in graph.input] == ["input"] and [o.name for o in graph.output] == ["encoder_output"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_llava_next_encoder_then_host_packing_matches_hf(tiny_llava_next):
    # 2x2 grid: base tile + 4 crops per image; HF packs (unpads, adds newlines) after the projector.
    pixels = torch.randn(1, 5, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    sizes = torch.tensor([[112, 112]])
    inner = tiny_llava_next.model
    with torch.no_grad():
        hf = inner.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output
        crops = vision_encoder(tiny_llava_next, "llava_next")(pixels[0])
        ours, _ = inner.pack_image_features(
            [crops], sizes, vision_feature_select_strategy="default", image_newline=inner.image_newline
        )
    (ours,), (hf,) = ours, hf  # one image each
    torch.testing.assert_close(ours, hf, atol=0, rtol=0)
    assert ours.shape[0] <= max_visual_tokens(tiny_llava_next.config, "llava_next", 0) == 16 + 64 + 8


def _qwen_hf(model, grid, seed):
    patches = torch.randn(
        int(grid.prod(-1).sum()), qwen2_vl_patch_dim(model), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        hf = model.model.visual(patches, grid_thw=grid).pooler_output
    return patches, hf


GRIDS = [[[1, 4, 4]], [[1, 4, 4], [1, 2, 6]], [[2, 4, 4]], [[1, 6, 8], [2, 2, 2], [1, 2, 4]]]


def test_qwen2_vl_position_ids_match_hf():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import get_vision_position_ids

    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    assert torch.equal(qwen2_vl_position_ids(grid, 2), get_vision_position_ids(grid, 2))


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_qwen2_vl_encoder_matches_hf(tiny_qwen2_vl, grid):
    grid = torch.tensor(grid)
    patches, hf = _qwen_hf(tiny_qwen2_vl, grid, 0)
    with torch.no_grad():
        ours = vision_encoder(tiny_qwen2_vl, "qwen2_vl")(patches, **qwen2_vl_host_inputs(tiny_qwen2_vl, grid))
    assert ours.shape == (int(grid.prod(-1).sum()) // 4, 64)
    _assert_close(ours, hf)


def test_qwen2_vl_onnx_matches_hf_on_unseen_grids(tiny_qwen2_vl, tmp_path):
    path = tmp_path / "vision.onnx"
    example_grid = torch.tensor([[1, 4, 4]])
    patches, _ = _qwen_hf(tiny_qwen2_vl, example_grid, 1)
    example = VisionCase("x", {"input": patches, **qwen2_vl_host_inputs(tiny_qwen2_vl, example_grid)})
    export_vision(
        vision_encoder(tiny_qwen2_vl, "qwen2_vl"), "qwen2_vl", example, path, opset=17, dynamic_batch=True
    )
    for k, grid in enumerate(GRIDS):
        grid = torch.tensor(grid)
        patches, hf = _qwen_hf(tiny_qwen2_vl, grid, 20 + k)
        _assert_close(_ort(path, {"input": patches, **qwen2_vl_host_inputs(tiny_qwen2_vl, grid)}), hf)


def test_polygraphy_comparison_passes_and_catches_errors(tiny_llava, llava_onnx):
    encoder = vision_encoder(tiny_llava, "llava")
    cases = [VisionCase("b1", {"input": _images(1, 3)}), VisionCase("b4", {"input": _images(4, 4)})]
    good = validate_vision(encoder, llava_onnx, cases, atol=1e-4)
    assert good.passed and good.polygraphy_passed and good.max_abs_err < 1e-4
    assert len(good.per_case) == 2

    feeds = [{"input": c.feeds["input"].numpy()} for c in cases]
    with torch.no_grad():
        wrong = [{"encoder_output": encoder(c.feeds["input"]).numpy() + 0.1} for c in cases]
    bad = compare_onnx(llava_onnx, feeds, wrong, atol=1e-3, rtol=1e-3)
    assert not bad.passed and not bad.polygraphy_passed
    np.testing.assert_allclose(bad.max_abs_err, 0.1, atol=1e-4)


def test_sample_cases_cover_the_profile(tiny_llava, tiny_qwen2_vl):
    recipe = load_recipe(None, ["vision.min_batch=1", "vision.opt_batch=2", "vision.max_batch=3"])
    assert [c.label for c in sample_cases(tiny_llava, "llava", recipe.vision)] == [
        "batch=1",
        "batch=2",
        "batch=3",
    ]
    cases = sample_cases(
        tiny_qwen2_vl, "qwen2_vl", load_recipe(None, ["vision.sample_grid_thw=[1,4,4]"]).vision
    )
    assert [c.feeds["attention_mask"].shape for c in cases] == [(1, 16, 16), (1, 32, 32)]


def test_vision_stage_writes_artifacts_and_metrics(tiny_llava_dir, tmp_path):
    recipe = load_recipe(
        None, [f"model.name_or_path={tiny_llava_dir}", "stages=[vision_onnx]", "vision.max_batch=2"]
    )
    assert recipe.model.family == "llava"
    report = run_stages(recipe, tmp_path, progress=False)
    assert report.ran == ["vision_onnx"], report.results
    out = tmp_path / "vision_onnx"
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {"vision.onnx", "vision_config.json", "metrics.json"}
    assert manifest["metrics"]["passed"] and manifest["metrics"]["polygraphy_passed"]
    assert 0 <= manifest["metrics"]["max_abs_err"] < 1e-4
    config = json.loads((out / "vision_config.json").read_text())
    assert config["max_visual_tokens"] == 16 and config["inputs"] == ["input"]
    # Rerun: up to date. Touch the graph: rebuilt.
    assert run_stages(recipe, tmp_path, progress=False).skipped == ["vision_onnx"]
    with open(out / "vision.onnx", "ab") as handle:
        handle.write(b"\0")
    again = run_stages(recipe, tmp_path, progress=False)
    assert again.ran == ["vision_onnx"] and "vision.onnx changed on disk" in again.results[0].detail


def test_vision_stage_fails_above_tolerance(tiny_llava_dir, tmp_path, monkeypatch):
    from vlkv.exporter.comparison import Comparison

    monkeypatch.setattr(vision_onnx, "export_vision", lambda *a, **k: None)
    monkeypatch.setattr(
        vision_onnx, "validate_vision", lambda *a, **k: Comparison(0.5, 1e-4, 1e-4, False, False, [0.5])
    )
    recipe = load_recipe(None, [f"model.name_or_path={tiny_llava_dir}", "stages=[vision_onnx]"])
    (result,) = run_stages(recipe, tmp_path, progress=False).results
    assert result.status == "failed"
    assert (
        result.detail
        == "vision.onnx differs from PyTorch: max abs err 0.5 > tolerance 0.0001 (polygraphy failed)"
    )


def test_qwen2_vl_sample_grid_must_fit_the_merge(tiny_qwen2_vl):
    from vlkv.exporter.errors import StageError

    section = load_recipe(None, ["vision.sample_grid_thw=[1, 5, 4]"]).vision
    with pytest.raises(
        StageError, match=r"vision.sample_grid_thw: h and w must be multiples of spatial_merge_size=2"
    ):
        sample_cases(tiny_qwen2_vl, "qwen2_vl", section)
