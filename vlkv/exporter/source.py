"""Load the Hugging Face model a recipe names: a built-in (``tiny-llava``, ...) or a local checkpoint.

Built-ins come from the runtime's model registry (``vlkv.runtime.models.registry.load_model``).
Checkpoint directories are loaded here with eager attention and need only ``config.json`` + weights
(the registry also wants the processor files, which an export does not use). Nothing is ever
downloaded: checkpoints must be local directories.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe import ModelSection

# family → transformers class name; resolved lazily so that importing this module stays cheap.
FAMILY_CLASSES: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# One model at a time: stages of one build share it, and a 7B model must not be held twice.
_CACHE: dict[tuple[str, str, str], PreTrainedModel] = {}


def load_source_model(section: ModelSection) -> PreTrainedModel:
    """The model in eval mode and ``section.dtype``; built-ins resolve by name, paths load from disk.

    Raises:
        StageError: one line when the checkpoint cannot be loaded.
    """
    key = (section.name_or_path, section.family, section.dtype)
    if key not in _CACHE:
        _CACHE.clear()
        dtype = TORCH_DTYPES[section.dtype]
        if section.is_builtin:
            model = _load_builtin(section.name_or_path, dtype)
        else:
            model = _load_checkpoint(Path(section.name_or_path), section.family, dtype)
        _CACHE[key] = model.eval()
    return _CACHE[key]


def _load_builtin(name: str, dtype: torch.dtype) -> PreTrainedModel:
    from vlkv.runtime.models.registry import load_model

    try:
        return load_model(name, dtype=dtype).model
    except ValueError as exc:  # ModelLoadError: already one line
        raise StageError(str(exc)) from None


def _load_checkpoint(path: Path, family: str, dtype: torch.dtype) -> PreTrainedModel:
    import transformers

    from vlkv.runtime.models.registry import _quiet_transformers, summarize_keys

    cls = getattr(transformers, FAMILY_CLASSES[family])
    try:
        # Eager attention exports to plain MatMul/Softmax, which every ONNX/TensorRT path accepts.
        with _quiet_transformers():
            model, info = cls.from_pretrained(
                path,
                dtype=dtype,
                attn_implementation="eager",
                local_files_only=True,
                output_loading_info=True,
            )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"cannot load {family} checkpoint '{path}': {first}") from None
    missing = sorted(info.get("missing_keys") or ())
    if (
        missing
    ):  # transformers fills them with random values: an export of random layers (as vlkv generate refuses)
        raise StageError(
            f"checkpoint {path} lacks weights its config.json asks for ({len(missing)} tensors: "
            f"{summarize_keys(missing)}); the config and the weight files do not match"
        )
    return model


def load_source_config(section: ModelSection):
    """The model's ``PretrainedConfig`` without loading weights from disk (built-ins are built, they are tiny)."""
    if section.is_builtin:
        return load_source_model(section).config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(section.name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"cannot read the config of '{section.name_or_path}': {first}") from None
