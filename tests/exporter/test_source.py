from __future__ import annotations

import pytest
import torch

from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe import BUILTIN_MODELS
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.source import load_source_config, load_source_model


def test_builtin_names_match_the_runtime_registry():
    from vlkv.runtime.models.registry import MODELS

    assert set(BUILTIN_MODELS) == set(MODELS)


def test_builtin_resolves_through_the_registry():
    model = load_source_model(load_recipe(None, ["model.name_or_path=tiny-qwen2-vl"]).model)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and not model.training


def test_checkpoint_directory_loads_in_the_recipe_dtype(tiny_llava, tiny_llava_dir):
    section = load_recipe(None, [f"model.name_or_path={tiny_llava_dir}", "model.dtype=float16"]).model
    model = load_source_model(section)
    assert next(model.parameters()).dtype == torch.float16
    weight = model.model.multi_modal_projector.linear_1.weight
    torch.testing.assert_close(
        weight, tiny_llava.model.multi_modal_projector.linear_1.weight.half(), atol=0, rtol=0
    )
    assert load_source_config(section).model_type == "llava"


def test_checkpoint_without_weights_fails_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(open_config())
    section = load_recipe(None, [f"model.name_or_path={tmp_path}"]).model
    with pytest.raises(StageError) as info:
        load_source_model(section)
    assert str(info.value).startswith(f"cannot load llava checkpoint '{tmp_path}': ")
    assert "\n" not in str(info.value)


def open_config() -> str:
    from transformers import LlavaConfig

    return LlavaConfig().to_json_string()
