"""The record format's fixed parts: the byte prefix, layout bits, header parsing, the errors a reader
raises. :mod:`vlkv.runtime.store.record` builds and reads whole records on top of these; a tier that
only needs a record's size or header (Redis, disk, ``vlkv store ls``) reads them here.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch

from vlkv.runtime.store.identity import LAYOUT_VERSION, validate_key

MAGIC = b"VLKVREC\n"
_PREFIX = struct.Struct("<8sII")  # magic, layout version, header length
_DIGEST = 32
MAX_HEADER = 1 << 20
COMPRESSED = 0x100  # layout-version bit of a compressed record (entries kept at ``offsets``)
FACTORED = 0x200  # layout-version bit of a record whose K/V are stored as low-rank factors
SIGNED = 0x400  # layout-version bit of a record followed by an HMAC-SHA256 tag (a keyed store)
MIN_KEY_BYTES = 16
_DTYPES = {"float32", "float16", "bfloat16", "float64"}


class CorruptRecord(ValueError):
    """The bytes are not an intact record: wrong magic, truncated, checksum or structure mismatch."""

    def __init__(self, reason: str):
        super().__init__(f"corrupt record: {reason}")
        self.reason = reason


class ForgedRecord(CorruptRecord):
    """An intact record (valid SHA-256) whose HMAC tag is missing or wrong under this store's key:
    written by someone without the deployment's secret."""


def check_store_key(key: bytes | str | None) -> bytes | None:
    """The store key as bytes (None: unkeyed); one-line ``ValueError`` for a key too short to matter."""
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"store key must be at least {MIN_KEY_BYTES} bytes, got {len(raw)}")
    return raw


class StaleRecord(ValueError):
    """An intact record this reader must not use: another layout version or another model."""

    def __init__(self, reason: str):
        super().__init__(f"stale record: {reason}")
        self.reason = reason


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CorruptRecord(f"unknown dtype {name!r}")
    return getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"record tensors must be one of {sorted(_DTYPES)}, got {name}")
    return name


@dataclass(frozen=True)
class RecordInfo:
    """A record's header, readable without its payload (``vlkv store ls``)."""

    key: str
    tenant: str
    created: float
    expires: float | None
    length: int
    nbytes: int  # whole record in bytes
    header: dict = field(repr=False)

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires


_FIELDS = {
    "key": str, "tenant": str, "model_fingerprint": str, "processor_settings": dict, "content_id": str,
    "created": (int, float), "dtype": str, "embeds_dtype": str, "num_layers": int, "kv_heads": int,
    "length": int, "head_dim": int, "hidden": int, "payload_bytes": int,
}  # fmt: skip


def _read_header(data: bytes, layout_version: int = LAYOUT_VERSION) -> tuple[dict, int]:
    """The parsed header and its length; checks magic, layout version and the header's own shape."""
    if len(data) < _PREFIX.size:
        raise CorruptRecord(f"truncated: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptRecord(f"wrong magic {magic!r}")
    if version & ~(COMPRESSED | FACTORED | SIGNED) != layout_version:
        raise StaleRecord(f"layout version {version}, this reader uses {layout_version}")
    if hlen > MAX_HEADER or len(data) < _PREFIX.size + hlen:
        raise CorruptRecord(f"truncated or bad header length {hlen} ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecord(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptRecord("header is not a JSON object")
    for name, kind in _FIELDS.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise CorruptRecord(f"header field {name!r} missing or not {kind}")
    if header.get("expires") is not None and not isinstance(header["expires"], (int, float)):
        raise CorruptRecord("header field 'expires' is not a number")
    header["compressed"] = bool(version & COMPRESSED)
    header["signed"] = bool(version & SIGNED)
    factored = bool(version & FACTORED)
    rank = header.get("rank")
    if factored != (rank is not None) or (
        factored and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1)
    ):
        raise CorruptRecord(f"factored bit {int(factored)} with header rank {rank!r}")
    header.setdefault("kept", header["length"])  # dense records written before "kept" existed
    if not isinstance(header["kept"], int) or isinstance(header["kept"], bool) or header["kept"] < 0:
        raise CorruptRecord("header field 'kept' is not a count")
    if header["kept"] > header["length"] or (header["kept"] != header["length"] and not header["compressed"]):
        raise CorruptRecord(f"header keeps {header['kept']} of {header['length']} entries")
    if (
        min(header[f] for f in ("num_layers", "kv_heads", "length", "head_dim", "hidden", "payload_bytes"))
        < 0
    ):
        raise CorruptRecord("negative size in the header")
    try:
        validate_key(header["key"])
    except ValueError as exc:
        raise CorruptRecord(str(exc)) from None
    return header, hlen


def peek(data: bytes, nbytes: int | None = None) -> RecordInfo:
    """The header of a record whose first bytes are ``data`` (not verified: the checksum needs it all).

    ``nbytes`` is the whole record's size (``len(data)`` when None).
    """
    header, _ = _read_header(data)
    return RecordInfo(
        key=header["key"],
        tenant=header["tenant"],
        created=float(header["created"]),
        expires=None if header.get("expires") is None else float(header["expires"]),
        length=header["length"],
        nbytes=len(data) if nbytes is None else nbytes,
        header=header,
    )


def header_size(prefix: bytes) -> int:
    """Bytes of prefix + header, from a record's first 16 bytes (to read only the header from a file)."""
    if len(prefix) < _PREFIX.size:
        raise CorruptRecord(f"truncated: {len(prefix)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, _, hlen = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptRecord(f"wrong magic {magic!r}")
    return _PREFIX.size + min(hlen, MAX_HEADER)


def record_size(head: bytes) -> int:
    """The whole record's size in bytes, from its prefix and header (``head``: the first
    :func:`header_size` bytes); raises :class:`CorruptRecord` / :class:`StaleRecord` like a read."""
    header, hlen = _read_header(head)
    return _PREFIX.size + hlen + header["payload_bytes"] + _DIGEST * (2 if header["signed"] else 1)


PREFIX_SIZE = _PREFIX.size
