"""Model registry: one name (or a local Hugging Face directory) → model, processor and conventions.

``load_model("tiny-llava")`` builds a seeded tiny model in code; ``load_model("/path/to/dir")`` loads a
saved LLaVA / LLaVA-NeXT / Qwen2-VL checkpoint offline. Heavy or optional builders are imported only
when their name is asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch


class ModelLoadError(ValueError):
    """A model could not be loaded; the message is one line naming the problem and the known names."""


FAMILIES = ("llava", "llava_next", "qwen2_vl")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _llava_prompt(text: str, n_images: int, processor: Any) -> str:
    return "USER: " + f"{processor.image_token}\n" * n_images + f"{text} ASSISTANT:"


def _mistral_prompt(text: str, n_images: int, processor: Any) -> str:
    # LLaVA-1.6-Mistral's convention; the tiny LLaVA-NeXT uses a Mistral LM.
    return "[INST] " + f"{processor.image_token}\n" * n_images + f"{text} [/INST]"


def _qwen2_vl_prompt(text: str, n_images: int, processor: Any) -> str:
    vision = f"<|vision_start|>{processor.image_token}<|vision_end|>" * n_images
    return f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"


def _chat_template_prompt(text: str, n_images: int, processor: Any) -> str:
    # A checkpoint's own chat template is the authority on its prompt format when it ships one.
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


PROMPT_TEMPLATES: dict[str, Callable[[str, int, Any], str]] = {
    "llava": _llava_prompt,
    "llava_next": _mistral_prompt,
    "qwen2_vl": _qwen2_vl_prompt,
    "chat_template": _chat_template_prompt,
}


@dataclass
class LoadedModel:
    """A model in eval mode with its processor and the conventions needed to prompt it.

    ``template`` names an entry of :data:`PROMPT_TEMPLATES`; empty means the family's default.
    """

    model: torch.nn.Module
    processor: Any
    name: str
    family: str  # "llava" | "llava_next" | "qwen2_vl"
    image_token_id: int = -1  # -1: read from model.config.image_token_id
    template: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {list(FAMILIES)}, got {self.family!r}")
        self.template = self.template or self.family
        if self.template not in PROMPT_TEMPLATES:
            raise ValueError(f"template must be one of {list(PROMPT_TEMPLATES)}, got {self.template!r}")
        if self.image_token_id < 0:
            self.image_token_id = int(self.model.config.image_token_id)

    @property
    def image_placeholder(self) -> str:
        """The text placeholder for one image, before the processor expands it (e.g. ``<image>``)."""
        return self.processor.image_token

    def prompt_template(self, text: str, n_images: int = 1) -> str:
        """Format a user turn holding ``n_images`` image placeholders then ``text``, ready for generation."""
        if n_images < 0:
            raise ValueError(f"n_images must be >= 0, got {n_images}")
        return PROMPT_TEMPLATES[self.template](text, n_images, self.processor)


def _known() -> str:
    return f"known names: {', '.join(MODELS)} (or a local directory with a {'/'.join(FAMILIES)} checkpoint)"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _load_tiny(
    name: str, family: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    from vlkv.runtime.models.tiny import TINY_BUILDERS

    model, processor = TINY_BUILDERS[name](dtype=dtype)
    return LoadedModel(model.to(device).eval(), processor, name, family)


def _load_smollm2_llava(
    name: str, projector: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    from vlkv.runtime.models import smollm2_llava

    try:
        model, processor = smollm2_llava.build(dtype=dtype, projector=projector)
    except ValueError as exc:
        # build() names every missing demo package (or a damaged projector file); keep its words only.
        why = str(exc).strip().splitlines()[0]
        raise ModelLoadError(f"cannot build {name!r}: {why}; {_known()}") from exc
    except (ImportError, OSError) as exc:
        raise ModelLoadError(f"cannot build {name!r}: {_first_line(exc)}; {_known()}") from exc
    # Its processor carries a ChatML template with LLaVA-style <image> placeholders.
    return LoadedModel(model.to(device).eval(), processor, name, "llava", template="chat_template")


MODELS: dict[str, Callable[..., LoadedModel]] = {
    "tiny-llava": partial(_load_tiny, "tiny-llava", "llava"),
    "tiny-llava-next": partial(_load_tiny, "tiny-llava-next", "llava_next"),
    "tiny-qwen2-vl": partial(_load_tiny, "tiny-qwen2-vl", "qwen2_vl"),
    # the projector trained on procedural shapes (scripts/train_projector.py), and the seeded random one
    "smollm2-llava": partial(_load_smollm2_llava, "smollm2-llava", "trained"),
    "smollm2-llava-random": partial(_load_smollm2_llava, "smollm2-llava-random", "random"),
}


def _model_type(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no config.json in directory {path}; {_known()}")
    try:
        with open(config_path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"unreadable {config_path} ({_first_line(exc)}); {_known()}") from exc
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {config_path}: vlkv needs a vision-language model "
            f"of type {', '.join(FAMILIES)}; {_known()}"
        )
    return model_type


def _load_dir(path: str, dtype: torch.dtype, device: str) -> LoadedModel:
    family = _model_type(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise ModelLoadError(f"no weight file ({', '.join(WEIGHT_FILES)}) in directory {path}; {_known()}")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlkv.runtime.models.tiny import Qwen2VLImageTextProcessor

    # Qwen2VLProcessor cannot be built without torchvision (see Qwen2VLImageTextProcessor).
    processor_cls = Qwen2VLImageTextProcessor if family == "qwen2_vl" else AutoProcessor
    try:
        processor = processor_cls.from_pretrained(path, local_files_only=True)
        with _quiet_transformers():
            model, info = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype, local_files_only=True, output_loading_info=True
            )
    except Exception as exc:  # any loader failure becomes one readable line
        raise ModelLoadError(
            f"cannot load {family} checkpoint from {path} ({_first_line(exc)}); {_known()}"
        ) from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        # transformers would fill these with random values and run anyway.
        raise ModelLoadError(
            f"checkpoint {path} lacks weights its config.json asks for ({len(missing)} tensors: "
            f"{summarize_keys(missing)}); the config and the weight files do not match"
        )
    template = "chat_template" if getattr(processor, "chat_template", None) else ""
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(model.to(device).eval(), processor, name, family, template=template)


def summarize_keys(keys: list[str], shown: int = 4) -> str:
    """Parameter names folded by layer: ``a.layers.4.x``, ``a.layers.5.y`` → ``a.layers.{4, 5}.*``."""
    groups: dict[str, list[int]] = {}
    for key in keys:
        match = re.match(r"^(.*\.layers)\.(\d+)\.", key)
        prefix, index = (match.group(1), int(match.group(2))) if match else (key, -1)
        groups.setdefault(prefix, [])
        if index >= 0 and index not in groups[prefix]:
            groups[prefix].append(index)
    parts = [
        f"{prefix}.{{{', '.join(map(str, sorted(idx)))}}}.*" if idx else prefix
        for prefix, idx in groups.items()
    ]
    more = f", +{len(parts) - shown} more" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bar or multi-line load report on stderr: vlkv reports loading problems itself."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_model(
    name_or_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    """Load a registered model by name, or a LLaVA / LLaVA-NeXT / Qwen2-VL checkpoint directory.

    Names win over directories of the same name. Raises :class:`ModelLoadError` (one line) for an
    unknown name, a missing directory, a config without a supported ``model_type``, no weights, or
    weights missing for parameters the config asks for (more layers in the config than in the files).
    """
    key = os.fspath(name_or_dir)
    if key in MODELS:
        return MODELS[key](dtype=dtype, device=device)
    if os.path.isdir(key):
        return _load_dir(key, dtype, device)
    if os.sep in key or key.startswith("."):
        raise ModelLoadError(f"model directory not found: {key}; {_known()}")
    raise ModelLoadError(f"unknown model name {key!r}; {_known()}")
