"""Record identity: what a stored span's K/V depends on, folded into one opaque SHA-256 key.

A record's K/V is a function of the model (config + weights), the processor settings that turned
the image into tokens, the image itself (its bytes, or a uuid the client vouches for), the record
layout and — by construction, not by convention — the tenant. :func:`record_key` hashes a
canonical, length-prefixed encoding of exactly those fields: never Python's per-process ``hash()``
(LMCache issue 2979) and never the placeholder tokens, which are the same for every image (690).

Keys are 64 lowercase hex digits, so a key never carries a path component into a tier.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

# Bumped whenever the byte layout of a record or the meaning of its tensors changes; a record of
# another layout is stale (a miss), never read.
LAYOUT_VERSION = 1

# The dynamic library's records (operator-curated, readable by every tenant) live under this name.
# Tenant names starting with "_" are reserved for the operator, so no user tenant can take it.
SHARED_TENANT = "_shared"

_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[0-9a-f]{64}")
_DOMAIN = b"vlkv.record-key\x00"


def validate_tenant(name: object, *, allow_reserved: bool = False) -> str:
    """``name`` if it is a valid tenant name, else a one-line ``ValueError`` naming it.

    Valid: 1-64 characters of ``[A-Za-z0-9._-]``, not made of dots only (``.``, ``..``), not
    starting with ``_`` (reserved: :data:`SHARED_TENANT`) unless ``allow_reserved``.
    """
    if not isinstance(name, str) or not _TENANT.fullmatch(name) or not name.strip("."):
        raise ValueError(
            f"invalid tenant name {name!r}: use 1-64 characters of [A-Za-z0-9._-], no path separators"
        )
    if name.startswith("_") and not allow_reserved:
        raise ValueError(
            f"invalid tenant name {name!r}: names starting with '_' are reserved for the operator"
        )
    return name


def validate_key(key: object) -> str:
    """``key`` if it is a record id (64 lowercase hex digits), else a one-line ``ValueError``."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"invalid record id {key!r}: expected 64 lowercase hex digits")
    return key


def canonical_json(value: Any) -> bytes:
    """Sorted-key, whitespace-free, ASCII JSON; a value JSON cannot hold exactly is a ``ValueError``."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"processor settings must be plain JSON (str keys, no NaN): {exc}") from None


def content_id(content: bytes | None = None, uuid: str | None = None) -> str:
    """``"sha256:<hex>"`` of the content bytes, or ``"uuid:<uuid>"``; exactly one must be given.

    The two kinds never collide: a uuid equal to some image's digest still names a different record.
    """
    if (content is None) == (uuid is None):
        raise ValueError("give exactly one of content (bytes) or uuid (str)")
    if uuid is not None:
        if not isinstance(uuid, str) or not uuid or len(uuid) > 256:
            raise ValueError(f"uuid must be a non-empty string of at most 256 characters, got {uuid!r}")
        return f"uuid:{uuid}"
    if not isinstance(content, (bytes, bytearray, memoryview)):
        raise ValueError(f"content must be bytes, got {type(content).__name__}")
    return "sha256:" + hashlib.sha256(content).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Everything a record's K/V depends on except the tenant; :meth:`key` adds the tenant.

    Attributes:
        model_fingerprint: :func:`model_fingerprint` of the model that computed the K/V.
        processor_settings: plain-JSON dict (image processor settings, span kind, ...).
        content_id: :func:`content_id` of the image bytes or the client's uuid.
        layout_version: the record layout (:data:`LAYOUT_VERSION`).
    """

    model_fingerprint: str
    processor_settings: dict = field(default_factory=dict)
    content_id: str
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        validate_key(self.model_fingerprint)
        canonical_json(self.processor_settings)
        if not self.content_id.startswith(("sha256:", "uuid:")):
            raise ValueError(f"content_id must start with 'sha256:' or 'uuid:', got {self.content_id!r}")
        if not isinstance(self.layout_version, int) or self.layout_version < 1:
            raise ValueError(f"layout_version must be an int >= 1, got {self.layout_version!r}")

    @classmethod
    def of(
        cls,
        model_fingerprint: str,
        processor_settings: dict,
        content: bytes | None = None,
        uuid: str | None = None,
        layout_version: int = LAYOUT_VERSION,
    ) -> Identity:
        return cls(
            model_fingerprint=model_fingerprint,
            processor_settings=processor_settings,
            content_id=content_id(content, uuid),
            layout_version=layout_version,
        )

    def key(self, tenant: str) -> str:
        """SHA-256 hex over the length-prefixed fields, the tenant last."""
        validate_tenant(tenant, allow_reserved=True)
        h = hashlib.sha256(_DOMAIN)
        for part in (
            self.model_fingerprint.encode(),
            canonical_json(self.processor_settings),
            self.content_id.encode(),
            str(self.layout_version).encode(),
            tenant.encode(),
        ):
            h.update(struct.pack("<Q", len(part)))
            h.update(part)
        return h.hexdigest()


def record_key(
    model_fingerprint: str,
    processor_settings: dict,
    content: bytes | None = None,
    uuid: str | None = None,
    layout_version: int = LAYOUT_VERSION,
    tenant: str = "",
) -> str:
    """The record id of a span: SHA-256 hex over (fingerprint, settings, content or uuid, layout, tenant)."""
    return Identity.of(model_fingerprint, processor_settings, content, uuid, layout_version).key(tenant)


def image_content(image) -> bytes:
    """Canonical bytes of a PIL image (mode, size, pixels): equal pixels give equal bytes.

    Use the file's own bytes when the request carries them; this is for images already decoded.
    """
    head = f"pil:{image.mode}:{image.size[0]}x{image.size[1]}:".encode()
    return head + image.tobytes()


# config keys that change with the checkout path or library version but not with the computation
_VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash")


def _stable_config(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            str(k): _stable_config(v)
            for k, v in value.items()
            if str(k) not in _VOLATILE and not str(k).startswith("_attn")
        }
    if isinstance(value, (list, tuple)):
        return [_stable_config(v) for v in value]
    return value


# id(object) -> fingerprint, for as long as the object lives (a copy of a model is a new object)
_FINGERPRINTS: dict[int, str] = {}


def model_fingerprint(loaded) -> str:
    """SHA-256 hex over the model's config JSON and every weight tensor (name, dtype, shape, bytes).

    ``loaded`` is a :class:`~vlkv.runtime.models.registry.LoadedModel` or a bare ``nn.Module``. The
    result is cached per object (by identity, dropped with the object, not inherited by copies):
    weights changed in place afterwards are not seen. Cost: one pass over the weights at SHA-256 speed (~1-2 GB/s per core), i.e. well under
    a second for the tiny and smollm2 models, ~10 s for a 7B fp16 model — once per process.
    """
    cached = _FINGERPRINTS.get(id(loaded))
    if cached is not None:
        return cached
    model = getattr(loaded, "model", loaded)
    h = hashlib.sha256(b"vlkv.model-fingerprint\x00")
    config = getattr(model, "config", None)
    cfg = _stable_config(config.to_dict()) if config is not None else {}
    h.update(json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"\x00{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\x00".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    digest = h.hexdigest()
    _FINGERPRINTS[id(loaded)] = digest
    weakref.finalize(loaded, _FINGERPRINTS.pop, id(loaded), None)
    return digest


def processor_settings(loaded) -> dict:
    """The settings of ``loaded``'s image processor that change an image's tokens, as plain JSON."""
    proc = getattr(loaded.processor, "image_processor", None)
    raw = proc.to_dict() if proc is not None else {}
    settings = json.loads(json.dumps(_stable_config(raw), sort_keys=True, default=str))
    settings["family"] = loaded.family
    return settings
