from __future__ import annotations

import json
import shlex
import sys

import pytest

from vlkv.exporter import trtllm_engine
from vlkv.exporter.errors import StageSkipped
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.vision_tower import max_visual_tokens


def test_visual_token_bounds(tiny_llava, tiny_llava_next, tiny_qwen2_vl):
    assert max_visual_tokens(tiny_llava.config, "llava", 0) == 16  # (56 / 14)^2, CLS dropped
    assert max_visual_tokens(tiny_llava_next.config, "llava_next", 0) == 16 + 4 * 16 + 8
    assert max_visual_tokens(tiny_qwen2_vl.config, "qwen2_vl", 1296) == 324  # 504x504 -> 36x36 patches / 4


def test_build_command(tmp_path, tiny_llava_dir):
    recipe = load_recipe(None, [f"model.name_or_path={tiny_llava_dir}", "trtllm.max_batch_size=3"])
    mm = trtllm_engine.multimodal_len(recipe)
    assert mm == 3 * 16
    command = trtllm_engine.build_command(recipe, tmp_path / "ckpt", tmp_path / "llm", mm)
    assert command[0] == "trtllm-build"
    args = dict(zip(command[1::2], command[2::2]))
    assert args == {
        "--checkpoint_dir": str(tmp_path / "ckpt"),
        "--output_dir": str(tmp_path / "llm"),
        "--gemm_plugin": "auto",
        "--workers": "1",
        "--max_batch_size": "3",
        "--max_input_len": "2048",
        "--max_seq_len": "2560",
        "--max_multimodal_len": "48",
    }
    explicit = load_recipe(None, [f"model.name_or_path={tiny_llava_dir}", "trtllm.max_multimodal_len=576"])
    assert trtllm_engine.multimodal_len(explicit) == 576


def test_without_tensorrt_llm_the_layout_and_command_are_written(tmp_path, tiny_llava_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    recipe = load_recipe(None, [f"model.name_or_path={tiny_llava_dir}"])
    (tmp_path / "trt_engine").mkdir()
    (tmp_path / "trt_engine" / "vision.engine").write_bytes(b"ENGINE")
    out = tmp_path / "trtllm_engine"
    out.mkdir()
    with pytest.raises(StageSkipped) as info:
        trtllm_engine.run(recipe, tmp_path, out)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("TensorRT-LLM is not installed; skipped trtllm_engine (checkpoint is in ")
    assert (out / "vision" / "model.engine").read_bytes() == b"ENGINE"
    assert json.loads((out / "vision" / "config.json").read_text())["builder_config"]["model_type"] == "llava"
    assert (out / "llm").is_dir()
    script = (out / "build_command.sh").read_text().splitlines()[-1]
    assert shlex.split(script) == json.loads((out / "build_command.json").read_text())
    assert shlex.split(script)[-2:] == ["--max_multimodal_len", "16"]


def _vision_graph(path, elem_type) -> None:
    import onnx
    from onnx import helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["encoder_output"])],
        "v",
        [value("input", elem_type, ["batch", 3, 56, 56])],
        [value("encoder_output", elem_type, ["batch", 3, 56, 56])],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(path))


@pytest.mark.parametrize("fp16", [True, False])
def test_vision_precision_is_the_vision_graph_dtype_not_the_fp16_flag(tmp_path, fp16):
    from onnx import TensorProto

    recipe = load_recipe(None, [f"trt.fp16={str(fp16).lower()}"])
    assert trtllm_engine.vision_precision(tmp_path) == "float32"  # nothing built: vision_onnx's only dtype
    _vision_graph(tmp_path / "vision_onnx" / "vision.onnx", TensorProto.FLOAT)
    trtllm_engine.layout_vision(recipe, tmp_path, tmp_path / "vision")
    config = json.loads((tmp_path / "vision" / "config.json").read_text())
    assert config["builder_config"]["precision"] == "float32"
    _vision_graph(tmp_path / "vision_onnx" / "vision.onnx", TensorProto.FLOAT16)
    assert trtllm_engine.vision_precision(tmp_path) == "float16"
