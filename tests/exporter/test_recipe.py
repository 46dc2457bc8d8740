from __future__ import annotations

from pathlib import Path

import pytest

from vlkv.exporter.recipe import STAGE_NAMES, Recipe, RecipeError
from vlkv.exporter.recipe_loader import load_recipe, parse_override, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def _error(path=None, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_valid_and_resolved():
    recipe = load_recipe()
    assert recipe.model.family == "llava"
    assert recipe.stages == list(STAGE_NAMES)
    assert [p.name for p in recipe.decoder.profiles] == ["prefill", "decode"]
    assert recipe.decoder.profiles[1].dims["past_sequence_length"] == [1, 1024, 2047]


def test_demo_recipe_loads():
    recipe = load_recipe(RECIPES / "demo.yaml")
    assert recipe.model.name_or_path == "tiny-llava"
    assert recipe.policy.name == "elastic" and recipe.policy.budget == 0.5
    assert recipe.decoder.profiles[0].dims["sequence_length"] == [1, 128, 256]


@pytest.mark.parametrize("name", ["llava-1.5-7b", "llava-v1.6-mistral-7b", "qwen2-vl-2b", "qwen2-vl-7b"])
def test_model_recipes_name_missing_checkpoints(name):
    # The checkpoints are not in the repo: the error is one line naming the path.
    message = _error(RECIPES / f"{name}.yaml")
    assert message.startswith("model.name_or_path: checkpoint path 'checkpoints/")
    assert "does not exist" in message and "tiny-llava" in message


@pytest.mark.parametrize(
    ("name", "family"),
    [("llava-1.5-7b", "llava"), ("llava-v1.6-mistral-7b", "llava_next"), ("qwen2-vl-2b", "qwen2_vl")],
)
def test_model_recipes_are_otherwise_valid(name, family, tmp_path):
    # A directory with a config.json of the right model_type stands in for the checkpoint.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(f'{{"model_type": "{family}"}}')
    recipe = load_recipe(RECIPES / f"{name}.yaml", [f"model.name_or_path={ckpt}"])
    assert recipe.model.family == family
    assert recipe.model.dtype in ("float16", "bfloat16")
    assert recipe.plugins == ["AttnStats"]


def test_overrides_parse_yaml_values():
    recipe = load_recipe(
        None,
        [
            "policy.name=snapkv",
            "policy.budget=0.25",
            "trt.fp16=false",
            "vision.sample_grid_thw=[1, 4, 4]",
            "policy.options.window=32",
            "trt.workspace_gb=2",
            "stages=[trtllm_checkpoint, vision_onnx]",
        ],
    )
    assert recipe.policy.budget == 0.25
    assert recipe.trt.fp16 is False
    assert recipe.vision.sample_grid_thw == [1, 4, 4]
    assert recipe.policy.options == {"window": 32}
    assert recipe.trt.workspace_gb == 2.0 and isinstance(recipe.trt.workspace_gb, float)
    assert recipe.stages == ["vision_onnx", "trtllm_checkpoint"]  # registry order


def test_override_beats_yaml_and_yaml_beats_defaults(tmp_path):
    path = _write(tmp_path, "policy: {budget: 0.4}\ndecoder: {max_seq: 64}\n")
    assert load_recipe(path).policy.budget == 0.4
    recipe = load_recipe(path, ["policy.budget=0.7"])
    assert recipe.policy.budget == 0.7
    assert recipe.decoder.profiles[0].dims["sequence_length"] == [1, 32, 64]  # derived after merging


def test_override_indexes_lists(tmp_path):
    path = _write(tmp_path, "decoder:\n  profiles:\n    - name: p\n      dims: {batch_size: [1, 1, 1]}\n")
    recipe = load_recipe(path, ["decoder.profiles.0.dims.batch_size=[1, 1, 1]", "decoder.profiles.0.name=q"])
    assert recipe.decoder.profiles[0].name == "q"
    assert "decoder.profiles.3: index must be in [0, 1)" in _error(path, ["decoder.profiles.3.name=x"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["vision.opsett=17"], "vision.opsett: unknown key (did you mean vision.opset?)"),
        (["modle.dtype=float16"], "modle: unknown key (did you mean model?)"),
        (["trt.fp16_mode=true"], "trt.fp16_mode: unknown key (did you mean trt.fp16?)"),
        (["decoder.profiles=[{name: a, dimz: {}}]"], "decoder.profiles.0.dimz: unknown key"),
    ],
)
def test_unknown_keys_name_the_dotted_key(overrides, expected):
    assert _error(None, overrides).startswith(expected)


def test_unknown_key_in_yaml(tmp_path):
    path = _write(tmp_path, "model:\n  name_or_path: tiny-llava\n  dtyp: float16\n")
    assert _error(path).startswith("model.dtyp: unknown key (did you mean model.dtype?)")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.dtype=fp8", "model.dtype: must be one of float32, float16, bfloat16, got 'fp8'"),
        ("policy.budget=0", "policy.budget: must be in (0, 1], got 0.0"),
        ("policy.budget=1.5", "policy.budget: must be in (0, 1], got 1.5"),
        ("vision.min_batch=-1", "vision.min_batch: must be >= 1, got -1"),
        ("vision.opt_batch=9", "vision.opt_batch: must be in [min_batch, max_batch] = [1, 4], got 9"),
        ("decoder.max_seq=-5", "decoder.max_seq: must be >= 2, got -5"),
        ("trtllm.max_input_len=0", "trtllm.max_input_len: must be >= 1, got 0"),
        ("trtllm.max_multimodal_len=-1", "trtllm.max_multimodal_len: must be >= 0, got -1"),
        ("trt.builder_opt_level=9", "trt.builder_opt_level: must be in [0, 5], got 9"),
        ("stages=[vision_onnx, bogus]", "stages.1: unknown stage 'bogus'; known: vision_onnx,"),
        ("trt.fp16=3", "trt.fp16: expected true or false, got 3"),
        ("policy.budget=half", "policy.budget: expected a number, got 'half'"),
        ("vision.opset=13", "vision.opset: must be in [14, 20]"),
        ("model.family=gpt", "model.family: must be one of auto, llava, llava_next, qwen2_vl"),
        ("model.family=qwen2_vl", "model.family: tiny-llava is a llava model, not qwen2_vl"),
        ("policy.name=nonsense", "policy.name: unknown policy 'nonsense'; known: full"),
    ],
)
def test_invalid_values_name_key_and_range(override, expected):
    assert _error(None, [override]).startswith(expected)


def test_profile_ranges_are_checked():
    bad = "decoder.profiles=[{name: p, dims: {sequence_length: [4, 2, 8]}}]"
    assert (
        _error(None, [bad])
        == "decoder.profiles.0.dims.sequence_length: need min <= opt <= max, got [4, 2, 8]"
    )
    over = "decoder.profiles=[{name: p, dims: {batch_size: [1, 1, 9]}}]"
    assert _error(None, [over]) == "decoder.profiles.0.dims.batch_size: max exceeds max_batch=1"


def test_missing_checkpoint_path_is_named():
    message = _error(None, ["model.name_or_path=checkpoints/nowhere"])
    assert message.startswith("model.name_or_path: checkpoint path 'checkpoints/nowhere' does not exist")


def test_builtin_names_are_not_paths():
    for name, family in [
        ("tiny-llava-next", "llava_next"),
        ("tiny-qwen2-vl", "qwen2_vl"),
        ("smollm2-llava", "llava"),
    ]:
        assert load_recipe(None, [f"model.name_or_path={name}"]).model.family == family


def test_file_errors(tmp_path):
    assert _error(tmp_path / "none.yaml") == f"recipe file '{tmp_path / 'none.yaml'}' does not exist"
    assert "invalid YAML at line 3: mapping values are not allowed here" in _error(
        _write(tmp_path, "model:\n  a: b\n   c: d\n")
    )
    assert "top level must be a mapping" in _error(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        parse_override("policy.budget")


def test_to_yaml_round_trips(tmp_path):
    recipe = load_recipe(RECIPES / "demo.yaml", ["policy.options.distance=8"])
    path = tmp_path / "resolved.yaml"
    recipe.to_yaml(path)
    again = load_recipe(path)
    assert again == recipe
    assert again.config_hash() == recipe.config_hash()


def test_config_hash_is_stable_and_sectioned():
    a, b = load_recipe(), load_recipe()
    assert a.config_hash() == b.config_hash() and len(a.config_hash()) == 64
    changed = load_recipe(None, ["policy.name=h2o", "policy.budget=0.5"])
    assert changed.config_hash() != a.config_hash()
    assert changed.config_hash(("model", "vision")) == a.config_hash(("model", "vision"))
    assert changed.config_hash(("policy",)) != a.config_hash(("policy",))


def test_recipe_from_dict_rejects_non_mapping():
    with pytest.raises(RecipeError, match="top level must be a mapping"):
        recipe_from_dict([1, 2])
    assert isinstance(recipe_from_dict({}), Recipe)
