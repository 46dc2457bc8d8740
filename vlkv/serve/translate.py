"""OpenAI request bodies → the runtime's :class:`Prompt`, policy and :class:`Sampler`.

A single user message becomes ``Prompt(text, images)`` under the model's own prompt template, which
is exactly what ``vlkv generate --prompt TEXT --image ...`` runs (images first, then the text parts
joined by newlines). Longer conversations need the checkpoint's chat template; a model without one
(the built-in tiny models) refuses them instead of inventing a format. ``/v1/completions`` takes the
prompt as raw text, like ``vlkv generate --raw``.
"""

from __future__ import annotations

import asyncio
import json
import secrets

from vlkv.runtime.models.images import ImageLimits, image_limits
from vlkv.runtime.prompt import Prompt
from vlkv.serve.config import ServeConfig
from vlkv.serve.errors import ApiError
from vlkv.serve.media import MediaError, load_part
from vlkv.serve.schemas import ChatRequest, CompletionRequest, ImagePart, TextPart

SETTINGS = "vlkv.settings."  # how a request names a policy setting in messages


def _parts(content) -> list:
    return [TextPart(type="text", text=content)] if isinstance(content, str) else content


async def chat_prompt(req: ChatRequest, loaded, cfg: ServeConfig) -> tuple[Prompt, list[str | None]]:
    """The prompt of a chat request and each image's ``uuid`` (None where the part has none)."""
    images = [
        (f"messages[{i}].content[{j}]", part)
        for i, m in enumerate(req.messages)
        for j, part in enumerate(_parts(m.content))
        if isinstance(part, ImagePart)
    ]
    if len(images) > cfg.max_images:
        raise ApiError(
            400,
            f"{len(images)} images in one request; this server takes at most {cfg.max_images}",
            param="messages",
        )
    pictures = await asyncio.to_thread(_load_images, images, cfg, image_limits(loaded.processor))
    uuids = [part.uuid for _, part in images]
    single = len(req.messages) == 1 and req.messages[0].role == "user"
    if single:
        text = "\n".join(p.text for p in _parts(req.messages[0].content) if isinstance(p, TextPart))
        return Prompt(text, pictures), uuids
    if loaded.template != "chat_template":
        raise ApiError(
            400,
            f"model {loaded.name} has no chat template: send one user message (its text and images), "
            "or use /v1/completions with the formatted prompt",
            param="messages",
        )
    return Prompt(_apply_template(req, loaded), pictures, raw=True), uuids


def encode(engine, prompt: Prompt, param: str, encoder=None):
    """Tokenize ``prompt`` and preprocess its images from the calling thread (a handler's worker
    thread, never the engine thread, whose running streams would wait on it); a refusal is a 400.

    ``encoder`` (an :class:`~vlkv.runtime.encoder_pool.EncoderPool`) runs the processor call in its
    worker process, so this thread waits without the GIL; a worker that died or hung is a 503.
    """
    from vlkv.runtime.encoder_pool import EncoderUnavailable

    try:
        return engine.encode([prompt], process=None if encoder is None else encoder.process)
    except EncoderUnavailable as err:
        raise ApiError(503, f"encoding failed: {err}", "server_error", headers={"Retry-After": "1"}) from None
    except Exception as err:  # a prompt the processor refuses (placeholders, image sizes, text)
        raise ApiError(400, str(err) or type(err).__name__, param=param) from None


def _load_images(images: list[tuple[str, ImagePart]], cfg: ServeConfig, limits: ImageLimits) -> list:
    try:
        return [
            load_part(p.image_url.url, where, cfg.allowed_media_dir, cfg.max_image_bytes, limits)
            for where, p in images
        ]
    except MediaError as err:
        raise ApiError(400, str(err), param="messages") from None


def _apply_template(req: ChatRequest, loaded) -> str:
    messages = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        content = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in _parts(m.content)
        ]
        messages.append({"role": role, "content": content})
    try:
        return loaded.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # a template that raises on this conversation (e.g. roles out of order)
        raise ApiError(
            400, f"the model's chat template refused these messages: {err}", param="messages"
        ) from None


def completion_prompt(req: CompletionRequest) -> Prompt:
    return Prompt(req.prompt, [], raw=True)


def max_new_tokens(req: ChatRequest | CompletionRequest, cfg: ServeConfig, default: int) -> int:
    wanted = req.wanted_tokens
    if wanted is None:
        return min(default, cfg.max_tokens)
    if wanted > cfg.max_tokens:
        raise ApiError(
            400, f"max_tokens {wanted} is above this server's limit of {cfg.max_tokens}", param="max_tokens"
        )
    return wanted


def make_sampler(req: ChatRequest | CompletionRequest):
    """temperature 0 → greedy (what ``vlkv generate`` does by default); otherwise seeded sampling,
    temperature defaulting to 1 as in the OpenAI API, a random seed when the request names none."""
    from vlkv.runtime.sampling import Sampler

    temperature = 1.0 if req.temperature is None else float(req.temperature)
    top_k = req.vlkv.top_k if req.vlkv is not None else 0
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if temperature == 0:
        return Sampler()
    seed = secrets.randbits(63) if req.seed is None else req.seed
    try:
        return Sampler(True, temperature, top_k, top_p, seed)
    except ValueError as err:
        raise ApiError(400, str(err), param="seed" if "seed" in str(err) else None) from None


def make_request_policy(
    req: ChatRequest | CompletionRequest, cfg: ServeConfig, limit: int | None, model: str
):
    """The ``vlkv`` field's policy, budget and settings (the server's ``--policy`` when it names none),
    validated as ``vlkv generate`` validates ``--policy/--budget/--set``."""
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.policies.settings import (
        SettingError,
        check_setting_sizes,
        check_setting_types,
        default_budget,
    )

    opts = req.vlkv
    name = opts.policy if opts is not None and opts.policy is not None else cfg.policy
    settings = dict(opts.settings) if opts is not None else {}
    if "budget" in settings:
        raise ApiError(
            400, "set the budget with vlkv.budget, not vlkv.settings.budget", param="vlkv.settings"
        )
    if opts is not None and opts.budget is not None:
        budget = {"budget": float(opts.budget)}
    elif name == cfg.policy and cfg.budget is not None:
        budget = {"budget": cfg.budget}
    else:
        budget = default_budget(name, settings)
    try:
        check_setting_types(name, settings, SETTINGS)
        check_setting_sizes(settings, limit, model, SETTINGS)
        return make_policy(name, **budget, **settings)
    except SettingError as err:
        raise ApiError(400, str(err), param="vlkv.settings") from None
    except (ValueError, TypeError) as err:
        param = "vlkv.budget" if "budget" in str(err) else "vlkv.policy" if "policy" in str(err) else "vlkv"
        raise ApiError(400, f"{err}", param=param) from None


def check_request_compresses(req: ChatRequest | CompletionRequest, policy, batch) -> None:
    """Refuse ``vlkv.settings`` that would keep this prompt's whole cache at budget < 1 (a 400)."""
    from vlkv.runtime.policies.settings import SettingError, check_compresses

    settings = dict(req.vlkv.settings) if req.vlkv is not None else {}
    try:
        check_compresses(policy, settings, int(batch.lengths[0]), SETTINGS)
    except SettingError as err:
        raise ApiError(400, str(err), param="vlkv.settings") from None


MAX_JSON_DEPTH = 32  # an OpenAI body nests about 6 deep; Python's JSON decoder recurses per level


def parse_json(body: bytes):
    """Bytes → JSON value; NaN and Infinity are refused (they are not JSON), and so is a body that nests
    deeper than :data:`MAX_JSON_DEPTH` (thousands of ``[`` would exhaust the decoder's recursion)."""

    def constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(body, parse_constant=constant)
    except json.JSONDecodeError as err:
        raise ApiError(
            400, f"request body is not valid JSON: {err.msg} (line {err.lineno} column {err.colno})"
        ) from None
    except RecursionError:
        raise ApiError(400, f"request body nests too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise ApiError(400, f"request body is not valid JSON: {err}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def _depth(value) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest
