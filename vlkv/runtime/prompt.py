"""Prompts: validation, batch files (JSON / JSON lines) → prompts, and prompts → token ids, positions,
modality codes and modality spans, batched right-padded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from PIL import Image
from torch import Tensor

from vlkv.runtime.cache import Modality
from vlkv.runtime.models.adapter import FamilyAdapter


class PromptError(ValueError):
    """A prompt that cannot be run (one-line message)."""


@dataclass
class Prompt:
    """One request: text plus images (PIL images or paths / ``builtin:`` specs).

    ``raw=False`` wraps ``text`` in the model's chat template with one placeholder per image;
    ``raw=True`` takes ``text`` as already formatted (its placeholders must match the images).
    """

    text: str
    images: list = field(default_factory=list)
    raw: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise PromptError(f"prompt text must be a string, got {type(self.text).__name__}")
        check_utf8(self.text, "prompt text")
        if not isinstance(self.images, (list, tuple)):
            raise PromptError(f"prompt images must be a list, got {_shown(self.images)}")
        self.images = list(self.images)
        for i, image in enumerate(self.images):
            # A path may hold any bytes the file system allows, so paths are not UTF-8 checked.
            if not isinstance(image, (str, os.PathLike, Image.Image)):
                raise PromptError(
                    f"image {i + 1} must be a path, a builtin:NAME spec or a PIL image, got {_shown(image)}"
                )
        if not isinstance(self.raw, bool):
            raise PromptError(f"prompt raw must be true or false, got {_shown(self.raw)}")


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def check_utf8(text: str, what: str) -> None:
    """Raise :class:`PromptError` when ``text`` holds characters UTF-8 cannot encode.

    Undecodable bytes reach Python as lone surrogates (``\\udcff`` for byte 0xff, from a bytes
    ``argv`` or a ``surrogateescape`` read); a tokenizer fails on them deep inside.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        code = ord(bad)
        shown = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise PromptError(f"{what} is not valid UTF-8 ({shown} at character {err.start})") from None


# ---------------------------------------------------------------- batch files
BATCH_KEYS = ("prompt", "images", "raw")


def read_batch_file(path: str | os.PathLike) -> list[Prompt]:
    """Prompts from a batch file: a JSON list, or JSON lines, of ``{"prompt": str, "images": [str], "raw": bool}``.

    ``images`` and ``raw`` are optional; blank lines are skipped. Raises :class:`PromptError` (one
    line, naming the file and the line or entry) for an unreadable, empty or malformed file, a value
    of the wrong JSON type, an unknown key, text that is not UTF-8 or an image file that is missing.
    """
    prompts = []
    for where, item in _batch_entries(os.fspath(path)):
        try:
            prompt = Prompt(*_batch_fields(where, item))
        except PromptError as err:
            raise PromptError(f"{where}: {err}") from None
        for image in prompt.images:
            if not image.startswith("builtin:") and not os.path.isfile(image):
                raise PromptError(f"{where}: image file not found: {image}")
        prompts.append(prompt)
    return prompts


def _batch_entries(path: str) -> list[tuple[str, object]]:
    """``(where, entry)`` pairs, ``where`` naming the file and line (JSON lines) or entry (JSON list)."""
    if not os.path.isfile(path):
        raise PromptError(f"batch file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise PromptError(f"cannot read batch file {path}: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise PromptError(
            f"batch file {path} line {line} is not valid UTF-8 (byte 0x{data[err.start]:02x})"
        ) from None
    if not text.strip():
        raise PromptError(f'batch file {path} is empty: it needs one {{"prompt": ...}} object per line')
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptError(f"batch file {path} line {e.lineno} is not valid JSON: {e.msg}") from None
        if not isinstance(items, list) or not items:
            raise PromptError(f"batch file {path} holds an empty list: it needs at least one prompt")
        return [(f"batch file {path} entry {i + 1}", item) for i, item in enumerate(items)]
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append((f"batch file {path} line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise PromptError(f"batch file {path} line {number} is not valid JSON: {e.msg}") from None
    return entries


def _batch_fields(where: str, item) -> tuple[str, list[str], bool]:
    """One entry → ``(text, images, raw)``: JSON types checked (no coercion), unknown keys refused."""

    def shown(value) -> str:
        return json.dumps(value)[:40]

    if not isinstance(item, dict):
        raise PromptError(f'{where} must be an object like {{"prompt": "..."}}, got {shown(item)}')
    unknown = sorted(set(item) - set(BATCH_KEYS))
    if unknown:
        raise PromptError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(BATCH_KEYS)}")
    text, images, raw = item.get("prompt"), item.get("images", []), item.get("raw", False)
    if not isinstance(text, str):
        raise PromptError(f"{where} needs a string 'prompt', got {shown(text)}")
    if not (isinstance(images, list) and all(isinstance(im, str) for im in images)):
        raise PromptError(f"{where}: 'images' must be a list of image paths, got {shown(images)}")
    if not isinstance(raw, bool):
        raise PromptError(f"{where}: 'raw' must be true or false, got {shown(raw)}")
    return text, images, raw


# ---------------------------------------------------------------- encoding
@dataclass
class Spans:
    """Modality spans of one prompt (token indices after image-token expansion).

    ``image_spans`` are half-open ``(start, end)`` runs of image tokens; ``post_vision`` is the
    first index after the last image token (``n`` when the image is last; 0 with no image).
    """

    length: int
    image_spans: list[tuple[int, int]]

    @property
    def first_image(self) -> int | None:
        return self.image_spans[0][0] if self.image_spans else None

    @property
    def post_vision(self) -> int:
        return self.image_spans[-1][1] if self.image_spans else 0

    @property
    def num_image_tokens(self) -> int:
        return sum(e - s for s, e in self.image_spans)


@dataclass
class EncodedPrompt:
    """One prompt, tokenized.

    Attributes:
        input_ids: ``(n,)`` int64.
        positions: ``(n, P)`` int64 RoPE positions.
        modality: ``(n,)`` int8 :class:`Modality` codes.
        vision: vision-tower inputs from the processor (empty without images).
        spans: modality spans.
    """

    input_ids: Tensor
    positions: Tensor
    modality: Tensor
    vision: dict[str, Tensor]
    spans: Spans


@dataclass
class PromptBatch:
    """Right-padded batch: ``input_ids (B, T)``, ``positions (B, T, P)``, ``modality (B, T)``, ``lengths (B,)``."""

    prompts: list[EncodedPrompt]
    input_ids: Tensor
    positions: Tensor
    modality: Tensor
    lengths: Tensor

    @property
    def spans(self) -> list[Spans]:
        return [p.spans for p in self.prompts]


def _image_spans(is_image: Tensor) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, flag in enumerate(is_image.tolist()):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(is_image)))
    return spans


def encode_prompt(
    prompt: Prompt, processor, adapter: FamilyAdapter, template, placeholder: str, process=None
) -> EncodedPrompt:
    """Tokenize one prompt with the model's HF processor and derive positions, modality and spans.

    ``process``, when given, replaces the call ``processor(**kwargs)`` (tokenizing and image
    preprocessing, the heavy half) and returns its outputs as a dict of tensors, e.g.
    :meth:`vlkv.runtime.encoder_pool.EncoderPool.process` runs it in another process; the size checks
    before it and the cheap rest after it (modality, spans, positions) stay in the calling thread.
    """
    from vlkv.runtime.models.images import image_limits, load_image

    # Sizes are checked on the header (files) or the size (PIL images) before the processor resizes.
    limits = image_limits(processor)
    images = []
    for i, im in enumerate(prompt.images):
        if isinstance(im, Image.Image):
            limits.check(*im.size, f"image {i + 1}")
            images.append(im)  # as given: the processor converts it as it always has
        else:
            images.append(load_image(im, limits))
    text = prompt.text if prompt.raw else template(prompt.text, len(images))
    n_slots = text.count(placeholder)
    if n_slots != len(images):
        raise PromptError(
            f"prompt has {n_slots} image placeholder(s) ({placeholder}) but {len(images)} image(s) given"
        )
    kwargs = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    processed = dict(processor(**kwargs) if process is None else process(**kwargs))
    ids = processed["input_ids"][0].to(torch.long)
    is_image = ids == adapter.image_token_id
    spans = _image_spans(is_image)
    modality = torch.full(ids.shape, int(Modality.TEXT), dtype=torch.int8)
    if spans:
        modality[spans[0][0] :] = int(Modality.POST_TEXT)
    modality[is_image] = int(Modality.IMAGE)
    positions = adapter.positions(ids, processed)
    return EncodedPrompt(ids, positions, modality, adapter.vision_inputs(processed), Spans(len(ids), spans))


def collate(prompts: list[EncodedPrompt], pad_id: int) -> PromptBatch:
    """Right-pad encoded prompts into one batch (padding rows are never attended by real rows)."""
    b, t = len(prompts), max(p.input_ids.shape[0] for p in prompts)
    pdims = prompts[0].positions.shape[-1]
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    pos = torch.zeros(b, t, pdims, dtype=torch.long)
    mod = torch.zeros(b, t, dtype=torch.int8)
    for i, p in enumerate(prompts):
        n = p.input_ids.shape[0]
        ids[i, :n], pos[i, :n], mod[i, :n] = p.input_ids, p.positions, p.modality
    lengths = torch.tensor([p.input_ids.shape[0] for p in prompts], dtype=torch.long)
    return PromptBatch(prompts, ids, pos, mod, lengths)
