"""Stage ``trtllm_engine``: lay out ``engine_dir/{vision,llm}`` and run ``trtllm-build`` when it exists.

TensorRT-LLM's multimodal runner reads ``vision/model.engine`` + ``vision/config.json`` and the
``llm/`` engine built from our checkpoint (toolchain.md B1). The ``trtllm-build`` command line is
always written to ``build_command.sh`` / ``build_command.json``; it is executed only when
``tensorrt_llm`` imports and ``trtllm-build`` is on PATH, otherwise the stage raises
:class:`StageSkipped` with one line (CLI exit code 3).

``max_multimodal_len`` = ``trtllm.max_batch_size`` × the largest visual-token count of one image
(LLaVA-1.5 at 336 px: 576; Qwen2-VL at 504×504: 324), unless the recipe sets it. The vision
``config.json``'s ``precision`` is the vision engine's I/O dtype, read off the vision ONNX graph
(float32), whatever ``trt.fp16`` says about the arithmetic inside the engine.

That is the TensorRT-LLM ≤ 1.2 flow (``trtllm.flow: build``). With ``trtllm.flow: serve`` (releases
that load Hugging Face checkpoints directly) the stage writes ``serve_command.sh`` instead:
``trtllm-serve <hf_dir> --tp_size N --pp_size M ...``, skipped with one line when ``trtllm-serve`` is
not installed.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.recipe import Recipe
from vlkv.exporter.source import load_source_config
from vlkv.exporter.vision_tower import max_visual_tokens


def multimodal_len(recipe: Recipe, src_dir: Path | None = None) -> int:
    """``max_multimodal_len`` for ``trtllm-build`` (recipe value, or max_batch_size × visual tokens).

    The token count comes from ``vision_onnx/vision_config.json`` when that stage ran in this build
    (no model load), else from the model's config.
    """
    if recipe.trtllm.max_multimodal_len:
        return recipe.trtllm.max_multimodal_len
    # Only a vision_onnx of this build is current (it is then one of this stage's inputs).
    built = src_dir is not None and "vision_onnx" in recipe.stages
    vision_config = src_dir / "vision_onnx" / "vision_config.json" if built else None
    if vision_config is not None and vision_config.is_file():
        tokens = json.loads(vision_config.read_text())["max_visual_tokens"]
    else:
        config = load_source_config(recipe.model)
        tokens = max_visual_tokens(config, recipe.model.family, recipe.vision.max_patches)
    return recipe.trtllm.max_batch_size * tokens


def build_command(recipe: Recipe, checkpoint_dir: Path, llm_dir: Path, max_multimodal_len: int) -> list[str]:
    """The ``trtllm-build`` argv for the language model (gemm plugin follows the checkpoint dtype)."""
    t = recipe.trtllm
    return [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(llm_dir),
        "--gemm_plugin", "auto",
        "--workers", str(t.tp_size * t.pp_size),  # one engine per rank of the sharded checkpoint
        "--max_batch_size", str(t.max_batch_size),
        "--max_input_len", str(t.max_input_len),
        "--max_seq_len", str(t.max_seq_len),
        "--max_multimodal_len", str(max_multimodal_len),
    ]  # fmt: skip


def import_tensorrt_llm():
    """The ``tensorrt_llm`` module, or None when it cannot be imported."""
    try:
        import tensorrt_llm
    except (ImportError, OSError):
        return None
    return tensorrt_llm


def layout_vision(recipe: Recipe, src_dir: Path, vision_dir: Path) -> bool:
    """Copy the vision engine (if trt_engine built one) and write TensorRT-LLM's vision ``config.json``."""
    vision_dir.mkdir(parents=True, exist_ok=True)
    engine = src_dir / "trt_engine" / "vision.engine"
    if engine.is_file():
        shutil.copyfile(engine, vision_dir / "model.engine")
    newline = src_dir / "vision_onnx" / "image_newlines.safetensors"
    if newline.is_file():
        shutil.copyfile(newline, vision_dir / "image_newlines.safetensors")
    precision = vision_precision(src_dir)
    config = {
        "builder_config": {
            "model_type": recipe.model.family,
            "precision": precision,
            "max_batch_size": recipe.vision.max_batch,
        }
    }
    (vision_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return engine.is_file()


# ONNX TensorProto element types → the dtype names TensorRT-LLM's runner reads.
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16"}


def vision_precision(src_dir: Path) -> str:
    """The dtype of the vision engine's input: that of ``vision_onnx/vision.onnx``'s first input.

    TensorRT-LLM's multimodal runner casts the image tensor to the config's ``precision`` before it
    calls the vision engine, so the value must be the engine's I/O dtype. ``trt.fp16`` lets TensorRT
    compute in float16 inside the engine, but the graph's inputs and outputs keep the ONNX dtype,
    which the vision export always writes as float32.
    """
    graph = src_dir / "vision_onnx" / "vision.onnx"
    if graph.is_file():
        import onnx

        model = onnx.load(str(graph), load_external_data=False)
        elem = model.graph.input[0].type.tensor_type.elem_type
        if elem not in _ONNX_DTYPES:
            raise StageError(
                f"{graph}: input {model.graph.input[0].name} has unsupported element type {elem}"
            )
        return _ONNX_DTYPES[elem]
    config = src_dir / "vision_onnx" / "vision_config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("dtype", "float32")
    return "float32"  # the only dtype vision_onnx exports


def serve_command(recipe: Recipe, hf_dir: str, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The ``trtllm-serve`` argv for TensorRT-LLM releases without the legacy flow (PyTorch backend)."""
    t = recipe.trtllm
    return [
        "trtllm-serve", hf_dir,
        "--tp_size", str(t.tp_size),
        "--pp_size", str(t.pp_size),
        "--max_batch_size", str(t.max_batch_size),
        "--max_seq_len", str(t.max_seq_len),
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip


def run_serve(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    """``trtllm.flow: serve``: write ``serve_command.sh``/``.json``; nothing is built ahead of time."""
    info = src_dir / "trtllm_checkpoint" / "hf_checkpoint.json"
    if not info.is_file():
        raise StageError(f"{info} is missing: run the trtllm_checkpoint stage with trtllm.flow: serve first")
    command = serve_command(recipe, json.loads(info.read_text())["hf_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_command.sh").write_text("#!/bin/sh\nset -e\nexec " + shlex.join(command) + "\n")
    (out_dir / "serve_command.json").write_text(json.dumps(command, indent=2) + "\n")
    if shutil.which("trtllm-serve") is None:
        raise StageSkipped(
            f"trtllm-serve is not installed; skipped trtllm_engine (command in {out_dir / 'serve_command.sh'})"
        )
    metrics = {"flow": "serve", "tp_size": recipe.trtllm.tp_size, "pp_size": recipe.trtllm.pp_size}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return out_dir


def run(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    """Stage entry point (see module doc)."""
    if recipe.trtllm.flow == "serve":
        return run_serve(recipe, src_dir, out_dir)
    checkpoint_dir = (src_dir / "trtllm_checkpoint").resolve()
    llm_dir = (out_dir / "llm").resolve()
    llm_dir.mkdir(parents=True, exist_ok=True)
    has_vision_engine = layout_vision(recipe, src_dir, out_dir / "vision")
    command = build_command(recipe, checkpoint_dir, llm_dir, multimodal_len(recipe, src_dir))
    (out_dir / "build_command.sh").write_text("#!/bin/sh\nset -e\n" + shlex.join(command) + "\n")
    (out_dir / "build_command.json").write_text(json.dumps(command, indent=2) + "\n")
    if import_tensorrt_llm() is None or shutil.which("trtllm-build") is None:
        raise StageSkipped(
            f"TensorRT-LLM is not installed; skipped trtllm_engine (checkpoint is in {checkpoint_dir}; "
            f"command in {out_dir / 'build_command.sh'})"
        )
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()
        raise StageError(f"trtllm-build exited with {done.returncode}: {tail[-1] if tail else 'no output'}")
    metrics = {"vision_engine": has_vision_engine, "max_multimodal_len": multimodal_len(recipe, src_dir)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return out_dir
