"""Request bodies of the OpenAI-compatible routes (pydantic, strict: no silent type coercion).

Unknown fields are refused with their name, and OpenAI fields vlkv does not implement are accepted
only at their neutral value (``n=1``, no ``stop``, no penalties, no logprobs), so a client never
gets an answer to a different question than the one it asked.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

# a tenant name (vLLM's ``cache_salt``): it scopes stored records, so it may not smuggle a path
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# an image identity (``uuid`` of a content part): printable, no separators that could name a path
IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Strict):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """``{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}``; ``uuid`` names the image for
    the context store (kept on the request until the store lands)."""

    type: Literal["image_url"]
    image_url: ImageURL
    uuid: StrictStr | None = None

    @model_validator(mode="after")
    def _identity(self):
        if self.uuid is not None and not IDENTITY.fullmatch(self.uuid):
            raise ValueError(f"uuid must match {IDENTITY.pattern}, got {self.uuid[:40]!r}")
        return self


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


SettingValue = StrictBool | StrictInt | StrictFloat | StrictStr | None


class VlkvOptions(_Strict):
    """The ``vlkv`` body field (the OpenAI client's ``extra_body={"vlkv": {...}}``)."""

    policy: StrictStr | None = None
    budget: StrictFloat | StrictInt | None = None
    settings: dict[str, SettingValue] = Field(default_factory=dict)
    top_k: StrictInt = Field(default=0, ge=0)
    link: StrictStr | None = None  # none, prefix, full-reuse, cacheblend or mpic (default: the server's)
    link_k: StrictInt | None = Field(default=None, ge=0)
    link_pick: StrictStr | None = None  # MPIC's recomputed tokens: first or ramp (LinkSpec checks it)
    link_r: StrictFloat | StrictInt | None = None  # CacheBlend's recomputed fraction (LinkSpec checks it)
    link_deviation: StrictStr | None = None  # CacheBlend's check: k or v
    store_budget: StrictFloat | StrictInt | None = None  # share of entries the records it writes keep
    store_scorer: StrictStr | None = None  # how a compressed record picks them
    store_rank: StrictInt | None = None  # rank of the factors the records it writes are stored as


class _Sampling(_Strict):
    """Fields shared by both routes."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None
    vlkv: VlkvOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extra parameter: run to max_tokens
    # accepted at their neutral values only
    n: Literal[1] = 1
    stop: None | Annotated[list[StrictStr], Field(max_length=0)] = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _tenant(self):
        if self.cache_salt is not None and not TENANT.fullmatch(self.cache_salt):
            raise ValueError(
                f"cache_salt must be a tenant name matching {TENANT.pattern}, got {self.cache_salt[:40]!r}"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: StrictStr
    echo: Literal[False] = False
    suffix: None = None

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_tokens
