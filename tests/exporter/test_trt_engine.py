from __future__ import annotations

import json
import sys
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from vlkv.exporter import trt_engine
from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.trt_profiles import engine_profiles, eval_dim, onnx_inputs, profile_shapes


def _identity_graph(path, dims_by_input: dict[str, list]) -> None:
    """A tiny ONNX graph whose inputs have the given (symbolic) dims; each input is echoed."""
    inputs, outputs, nodes = [], [], []
    for name, dims in dims_by_input.items():
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        outputs.append(helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, dims))
        nodes.append(helper.make_node("Identity", [name], [f"{name}_out"]))
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def test_eval_dim():
    values = {"past_sequence_length": 5, "sequence_length": 3}
    assert eval_dim(7, values) == 7
    assert eval_dim("past_sequence_length + sequence_length", values) == 8
    assert eval_dim("past_sequence_length - 1", values) == 4
    assert eval_dim("past_sequence_length_4", values) == 5  # per-layer axis falls back to the shared name
    assert eval_dim("past_sequence_length_4", values | {"past_sequence_length_4": 9}) == 9
    with pytest.raises(KeyError):
        eval_dim("logits_rows", values)


def test_decoder_profile_shapes(tmp_path):
    path = tmp_path / "decoder.onnx"
    _identity_graph(
        path,
        {
            "inputs_embeds": ["batch_size", "sequence_length", 64],
            "past_key_values.1.key": ["batch_size", 2, "past_sequence_length_1", 16],
            "attention_mask": ["batch_size", "past_sequence_length + sequence_length"],
        },
    )
    recipe = load_recipe(None, ["decoder.max_batch=2", "decoder.max_seq=64"])
    profiles = engine_profiles(path, [(p.name, p.dims) for p in recipe.decoder.profiles])
    assert profiles["prefill"]["inputs_embeds"] == ((1, 1, 64), (1, 32, 64), (2, 64, 64))
    assert profiles["prefill"]["past_key_values.1.key"] == ((1, 2, 0, 16), (1, 2, 0, 16), (2, 2, 0, 16))
    assert profiles["decode"]["past_key_values.1.key"] == ((1, 2, 1, 16), (1, 2, 32, 16), (2, 2, 63, 16))
    assert profiles["decode"]["attention_mask"] == ((1, 2), (1, 33), (2, 64))


def test_profile_missing_symbol_is_one_line(tmp_path):
    inputs = [("logits_index", ["batch_size", "logits_rows"])]
    with pytest.raises(StageError) as info:
        profile_shapes(inputs, {"batch_size": [1, 1, 1]}, "decode")
    assert (
        str(info.value)
        == "profile decode: input logits_index has dims ['batch_size', 'logits_rows'] but the profile gives only ['batch_size']"
    )


def _vision_build(tmp_path, recipe_overrides=("stages=[vision_onnx, trt_engine]",)):
    recipe = load_recipe(None, list(recipe_overrides))
    _identity_graph(tmp_path / "vision_onnx" / "vision.onnx", {"input": ["batch", 3, 56, 56]})
    out = tmp_path / "trt_engine"
    out.mkdir()
    return recipe, out


def test_without_tensorrt_the_stage_is_skipped_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # make `import tensorrt` fail even where it exists
    recipe, out = _vision_build(tmp_path)
    with pytest.raises(StageSkipped) as info:
        trt_engine.run(recipe, tmp_path, out)
    assert (
        str(info.value) == f"TensorRT is not installed; skipped trt_engine (ONNX artifacts are in {tmp_path})"
    )
    # Profiles are still derived from the graph and written.
    profiles = json.loads((out / "profiles.json").read_text())
    assert profiles["vision"]["vision"]["input"] == [[1, 3, 56, 56], [1, 3, 56, 56], [4, 3, 56, 56]]


def test_missing_decoder_graph_is_named(tmp_path):
    recipe, out = _vision_build(tmp_path, ["stages=[vision_onnx, decoder_onnx, trt_engine]"])
    with pytest.raises(StageError, match=r"decoder graph .*decoder_onnx/decoder.onnx is missing"):
        trt_engine.run(recipe, tmp_path, out)


def _fake_trt(parse_ok=True):
    """A stand-in ``tensorrt`` module recording the builder calls (API as documented for TensorRT 10)."""
    calls = []
    rec = lambda name: lambda *a, **k: calls.append((name, a))  # noqa: E731

    class Profile:
        def set_shape(self, name, lo, opt, hi):
            calls.append(("set_shape", (name, lo, opt, hi)))

    class Config:
        builder_optimization_level = None
        set_memory_pool_limit = staticmethod(rec("set_memory_pool_limit"))
        set_flag = staticmethod(rec("set_flag"))
        add_optimization_profile = staticmethod(rec("add_optimization_profile"))

    config = Config()

    class Builder:
        def __init__(self, logger):
            calls.append(("Builder", ()))

        def create_network(self, flags):
            calls.append(("create_network", (flags,)))
            return "network"

        def create_builder_config(self):
            return config

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, cfg):
            return b"ENGINE"

    class Parser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            calls.append(("parse_from_file", (path,)))
            return parse_ok

        def get_error(self, i):
            return "Unsupported operator MergeKV"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    trt = types.SimpleNamespace(
        __version__="10.9.0",
        Logger=Logger,
        Builder=Builder,
        OnnxParser=Parser,
        init_libnvinfer_plugins=rec("init_libnvinfer_plugins"),
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="WORKSPACE"),
        BuilderFlag=types.SimpleNamespace(FP16="FP16"),
        NetworkDefinitionCreationFlag=types.SimpleNamespace(EXPLICIT_BATCH=0),
    )
    return trt, calls, config


def test_build_engine_sets_profiles_precision_and_workspace(tmp_path):
    trt, calls, config = _fake_trt()
    recipe = load_recipe(None, ["trt.workspace_gb=2", "trt.builder_opt_level=4"])
    onnx_path = tmp_path / "vision.onnx"
    shapes = {"input": ((1, 3, 56, 56), (2, 3, 56, 56), (4, 3, 56, 56))}
    trt_engine.build_engine(trt, onnx_path, tmp_path / "vision.engine", [shapes, shapes], recipe.trt)
    assert (tmp_path / "vision.engine").read_bytes() == b"ENGINE"
    assert ("create_network", (0,)) in calls  # TensorRT 10: explicit batch is implicit
    assert ("parse_from_file", (str(onnx_path),)) in calls
    assert ("set_memory_pool_limit", ("WORKSPACE", 2 << 30)) in calls
    assert ("set_flag", ("FP16",)) in calls
    assert config.builder_optimization_level == 4
    assert calls.count(("set_shape", ("input", (1, 3, 56, 56), (2, 3, 56, 56), (4, 3, 56, 56)))) == 2
    assert sum(c[0] == "add_optimization_profile" for c in calls) == 2


def test_build_engine_parse_error_and_static_graph(tmp_path):
    trt, calls, _ = _fake_trt(parse_ok=False)
    recipe = load_recipe(None, ["trt.fp16=false"])
    with pytest.raises(StageError, match="TensorRT cannot parse decoder.onnx: Unsupported operator MergeKV"):
        trt_engine.build_engine(trt, tmp_path / "decoder.onnx", tmp_path / "d.engine", [], recipe.trt)
    trt, calls, _ = _fake_trt()
    static = {"input": ((1, 3, 56, 56),) * 3}
    trt_engine.build_engine(trt, tmp_path / "v.onnx", tmp_path / "v.engine", [static], recipe.trt)
    assert not any(c[0] in ("set_flag", "add_optimization_profile") for c in calls)


def test_plugins_are_registered_only_when_named(monkeypatch):
    trt_engine.register_plugins([])  # nothing to do, nothing imported
    monkeypatch.setitem(sys.modules, "vlkv.plugins.trt_plugins", None)
    with pytest.raises(StageError, match=r"recipe plugins \['AttnStats'\] need vlkv.plugins.trt_plugins"):
        trt_engine.register_plugins(["AttnStats"])
    registered = []
    fake = types.ModuleType("vlkv.plugins.trt_plugins")
    fake.register_plugins = lambda arch=None: registered.append(arch)
    monkeypatch.setitem(sys.modules, "vlkv.plugins.trt_plugins", fake)
    import vlkv.plugins

    monkeypatch.setattr(vlkv.plugins, "trt_plugins", fake, raising=False)
    trt_engine.register_plugins(["AttnStats"], "sm_89")
    assert registered == ["sm_89"]


def test_plugin_architecture_problems_are_one_stage_error(monkeypatch):
    from vlkv.plugins import trt_plugins

    monkeypatch.setattr(trt_plugins, "_import_tensorrt", lambda: (None, None))
    monkeypatch.setattr(trt_plugins, "device_arch", lambda: 75)  # a Turing GPU: no AOT kernels for it
    with pytest.raises(StageError) as info:
        trt_engine.register_plugins(["AttnStats"], None)
    assert str(info.value).startswith("trt.ptx_arch (from the visible GPU): must be one of sm_80, ")
    monkeypatch.setattr(trt_plugins, "device_arch", lambda: None)
    with pytest.raises(StageError, match="^trt.ptx_arch: no CUDA device is visible"):
        trt_engine.register_plugins(["AttnStats"], None)


def test_decoder_feeds_follow_the_vlkv_contract_in_graph_dtypes():
    opt = lambda *shape: (shape, shape, shape)  # noqa: E731
    shapes = {
        "inputs_embeds": opt(3, 4, 8),
        "position_ids": opt(3, 3, 4),  # M-RoPE layout
        "past_lengths": opt(2, 3),
        "new_lengths": opt(3),
        "logits_index": opt(3, 1),
        "stats_rows": opt(3, 4),
        "stats_threshold": opt(1),
        "past_key_values.0.key": opt(3, 2, 5, 16),
        "past_key_values.1.key": opt(3, 2, 1, 16),
    }
    dtypes = {n: np.dtype(np.int64) for n in ("position_ids", "past_lengths", "new_lengths", "logits_index")}
    dtypes |= {"stats_rows": np.dtype(np.int64), "inputs_embeds": np.dtype(np.float16)}
    feeds = trt_engine.sample_feeds(shapes, dtypes)
    assert {n: feeds[n].dtype for n in dtypes} == dtypes
    assert feeds["stats_threshold"].dtype == np.float32 and feeds["past_key_values.1.key"].dtype == np.float32
    assert feeds["past_lengths"].tolist() == [[5, 4, 3], [1, 0, 0]]
    assert feeds["new_lengths"].tolist() == [4, 3, 2]
    assert feeds["logits_index"].tolist() == [[3], [2], [1]]  # each sample's last valid row
    assert feeds["position_ids"].shape == (3, 3, 4) and feeds["position_ids"][0, 1].tolist() == [4, 5, 6, 7]


def test_sample_feeds_follow_decoder_conventions():
    shapes = {
        "input_ids": ((1, 1), (2, 3), (2, 8)),
        "attention_mask": ((1, 1), (2, 7), (2, 16)),
        "position_ids": ((1, 1), (2, 3), (2, 8)),
        "past_key_values.0.key": ((1, 2, 0, 16), (2, 2, 4, 16), (2, 2, 8, 16)),
    }
    feeds = trt_engine.sample_feeds(shapes)
    assert feeds["input_ids"].shape == (2, 3) and feeds["input_ids"].max() < 100
    assert feeds["attention_mask"].sum() == 14
    assert feeds["position_ids"].tolist() == [[4, 5, 6], [4, 5, 6]]
    assert feeds["past_key_values.0.key"].shape == (2, 2, 4, 16)


@pytest.mark.tensorrt
def test_real_tensorrt_build_matches_onnxruntime(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (toolchain.md A1)")
    recipe, out = _vision_build(tmp_path, ["stages=[vision_onnx, trt_engine]", "trt.fp16=false"])
    trt_engine.run(recipe, tmp_path, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["vision"]["passed"] and metrics["vision"]["max_abs_err"] == 0.0
    assert onnx_inputs(tmp_path / "vision_onnx" / "vision.onnx")[0][0] == "input"
