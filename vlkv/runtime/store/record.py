"""A stored span (an image, or a reusable text chunk): its K/V and what recompute needs, in one object.

Byte layout (little endian)::

    0      8  magic  b"VLKVREC\\n"
    8      4  u32 layout version (LAYOUT_VERSION; | COMPRESSED, | FACTORED as below)
    12     4  u32 header length H
    16     H  header: UTF-8 JSON (identity, tenant, times, dtype, shapes, payload length)
    16+H   P  payload: safetensors ("k.<l>", "v.<l>", "embeds", "modality"[, "offsets"]); no pickle
    16+H+P 32 SHA-256 over every byte before it (magic, version, header and payload)
    [+32   32 HMAC-SHA256 of the same bytes under the deployment's store key — signed records only]

A *signed* record (layout bit :data:`SIGNED`, written when the store has a key, ``VLKV_STORE_KEY``)
also carries an HMAC-SHA256 tag: the SHA-256 catches damage, the tag catches forgery (anyone who can
write to a shared Redis or Mooncake can compute a valid SHA-256, not a tag without the key). A reader
with a key refuses an unsigned record and a wrong tag (:class:`ForgedRecord`); a reader without one
checks the SHA-256 only.

A *compressed* record keeps only some of the span's entries (the same ones in every layer and KV
head): its K/V and modality hold ``kept`` entries, ``offsets`` says where each sits inside the span,
and ``embeds`` still covers the whole span (any row can be recomputed). Its layout version carries
the :data:`COMPRESSED` bit, so a reader that predates compressed records takes it for another layout
(a counted miss) rather than misreading it; dense records keep the plain version, readable by both.

A *factored* record (``rank`` R, bit :data:`FACTORED`) stores each layer's ``(m, H_kv·D)`` K and V
(heads concatenated) as truncated-SVD factors ``kbar.<l> (m, R')``, ``dk.<l> (R', H_kv·D)``,
``vbar.<l>``, ``dv.<l>`` with ``R' = min(R, m, H_kv·D)``, and is read back dense (the product). Its
K/V were already cut to rank R when the record was made (``link.compress.factor_segment``), so the
round trip changes only the rounding.

:meth:`Record.from_bytes` checks, in order: the magic and the length (:class:`CorruptRecord`), the
layout version (:class:`StaleRecord`: another layout cannot even be parsed), the checksum, the
header and the payload against the header (:class:`CorruptRecord`), then the model fingerprint the
caller expects (:class:`StaleRecord`). A record that fails any check is never returned.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlkv.runtime.store.identity import LAYOUT_VERSION, SHARED_TENANT, Identity, validate_tenant
from vlkv.runtime.store.record_format import (  # re-exported: part of the record API
    _DIGEST,
    _PREFIX,
    COMPRESSED,
    FACTORED,
    MAGIC,
    MAX_HEADER,
    MIN_KEY_BYTES,
    PREFIX_SIZE,
    SIGNED,
    CorruptRecord,
    ForgedRecord,
    RecordInfo,
    StaleRecord,
    _dtype,
    _dtype_name,
    _read_header,
    check_store_key,
    header_size,
    peek,
    record_size,
)


@dataclass(eq=False, kw_only=True, repr=False)
class Record:
    """One span's per-layer pre-RoPE K/V, projected embeddings and modality, with its identity.

    Attributes:
        identity: what the K/V depends on (:class:`Identity`); with ``tenant`` it gives :attr:`key`.
        tenant: the owner; :data:`SHARED_TENANT` marks the dynamic (shared) library.
        key: the record id, computed from ``identity`` and ``tenant`` (64 hex digits).
        keys, values: per layer ``(H_kv, m, D)`` K (before RoPE) and V, one dtype for all; ``m = n``
            unless the record is compressed.
        embeds: ``(n, hidden)`` the span's input embeddings (projected image features), for
            recomputing selected tokens.
        modality: ``(m,)`` int8 :class:`~vlkv.runtime.cache.Modality` codes.
        offsets: ``(m,)`` int64 strictly increasing offsets in ``[0, n)`` of the kept entries inside the
            span (a compressed record), or None (every entry, in order).
        created, expires: Unix seconds; ``expires`` None never expires.
        rank: None (K/V stored dense) or the rank its K/V are stored at as factors.
    """

    identity: Identity
    tenant: str
    keys: list[Tensor]
    values: list[Tensor]
    embeds: Tensor
    modality: Tensor
    offsets: Tensor | None = None
    created: float = field(default_factory=time.time)
    expires: float | None = None
    rank: int | None = None
    key: str = field(init=False)  # the record id: ``identity.key(tenant)``, fixed at construction

    def __post_init__(self) -> None:
        validate_tenant(self.tenant, allow_reserved=self.tenant == SHARED_TENANT)
        if self.identity.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"records are written in layout {LAYOUT_VERSION}, identity says {self.identity.layout_version}"
            )
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(
                f"need one K and one V per layer, got {len(self.keys)} K and {len(self.values)} V"
            )
        shape, dtype = tuple(self.keys[0].shape), self.keys[0].dtype
        if len(shape) != 3:
            raise ValueError(f"K/V must be (H_kv, n, D) per layer, got {shape}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, t in (("keys", k), ("values", v)):
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"{name}[{layer}] is {tuple(t.shape)} {t.dtype}, layer 0 is {shape} {dtype}"
                    )
        _dtype_name(dtype)
        m = shape[1]
        if self.embeds.dim() != 2 or (self.offsets is None and self.embeds.shape[0] != m):
            raise ValueError(f"embeds must be (n={m}, hidden), got {tuple(self.embeds.shape)}")
        _dtype_name(self.embeds.dtype)
        if tuple(self.modality.shape) != (m,):
            raise ValueError(f"modality must be (m={m},), got {tuple(self.modality.shape)}")
        if self.offsets is not None:
            n, off = self.embeds.shape[0], self.offsets
            if tuple(off.shape) != (m,) or off.dtype != torch.int64:
                raise ValueError(f"offsets must be (m={m},) int64, got {tuple(off.shape)} {off.dtype}")
            if m and (int(off[0]) < 0 or int(off[-1]) >= n or bool((off[1:] <= off[:-1]).any())):
                raise ValueError(f"offsets must increase strictly inside [0, n={n})")
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1
        ):
            raise ValueError(f"rank must be None or an integer >= 1, got {self.rank!r}")
        self.modality = self.modality.to(torch.int8)
        self.key = self.identity.key(self.tenant)

    def __repr__(self) -> str:
        h, n, d = self.keys[0].shape
        return (
            f"Record(key={self.key[:12]}…, tenant={self.tenant!r}, layers={len(self.keys)}, H_kv={h}, n={n}, "
            f"D={d}, dtype={self.keys[0].dtype}, device={self.keys[0].device}, nbytes={self.nbytes})"
        )

    # ------------------------------------------------------------------ views
    @property
    def length(self) -> int:
        """The span's tokens (``n``)."""
        return self.embeds.shape[0]

    @property
    def kept(self) -> int:
        """Entries stored (``m``; ``n`` unless compressed)."""
        return self.keys[0].shape[1]

    @property
    def version(self) -> int:
        """The layout version written for this record."""
        return (
            LAYOUT_VERSION
            | (COMPRESSED if self.offsets is not None else 0)
            | (FACTORED if self.rank is not None else 0)
        )

    @property
    def shared(self) -> bool:
        """In the dynamic library (readable by every tenant)."""
        return self.tenant == SHARED_TENANT

    @property
    def nbytes(self) -> int:
        """Tensor bytes (what a device tier holds)."""
        ts = (*self.keys, *self.values, self.embeds, self.modality)
        ts += () if self.offsets is None else (self.offsets,)
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def stored_nbytes(self) -> int:
        """Tensor bytes as written to bytes (a factored record's factors instead of its dense K/V):
        what a hit from a disk or remote tier moves."""
        if self.rank is None:
            return self.nbytes
        h, m, d = self.keys[0].shape
        r = self._stored_rank()
        dense = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        factors = 2 * len(self.keys) * (m * r + r * h * d) * self.keys[0].element_size()
        return self.nbytes - dense + factors

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def to(self, device: torch.device | str) -> Record:
        """A copy with every tensor on ``device`` (same identity and times)."""
        return Record(
            identity=self.identity,
            tenant=self.tenant,
            keys=[k.to(device) for k in self.keys],
            values=[v.to(device) for v in self.values],
            embeds=self.embeds.to(device),
            modality=self.modality.to(device),
            offsets=None if self.offsets is None else self.offsets.to(device),
            created=self.created,
            expires=self.expires,
            rank=self.rank,
        )

    # ------------------------------------------------------------------ pool
    def to_segment(self, pool):
        """A :class:`~vlkv.runtime.kv.segments.SharedSegment` holding this record's K/V in ``pool``
        (a compressed record's segment gets an ``offsets`` attribute, ``(m,)`` int64 on the CPU)."""
        from vlkv.runtime.kv.segments import SharedSegment

        spec = pool.spec
        h, _, d = self.keys[0].shape
        want = (spec.num_layers, spec.kv_heads, spec.head_dim)
        if (len(self.keys), h, d) != want:
            raise ValueError(f"record is (layers, H_kv, D) = {(len(self.keys), h, d)}, the pool is {want}")
        dev = spec.device
        keys = [k.to(dev) for k in self.keys]
        values = [v.to(dev) for v in self.values]
        seg = SharedSegment.from_tensors(pool, keys, values, self.modality.to(dev))
        seg.offsets = None if self.offsets is None else self.offsets.cpu()
        seg.rank = self.rank
        return seg

    @classmethod
    def from_segment(
        cls, segment, identity: Identity, tenant: str, embeds: Tensor, expires: float | None = None
    ) -> Record:
        """A record of a :class:`~vlkv.runtime.kv.segments.SharedSegment`'s pre-RoPE K/V (copied);
        compressed when the segment has ``offsets`` (``embeds`` then covers the whole span)."""
        keys, values = [], []
        for layer, ids in enumerate(segment.ids):
            k, v = segment.pool.read(layer, ids[None])
            keys.append(k[0])
            values.append(v[0])
        return cls(
            identity=identity, tenant=tenant, keys=keys, values=values, embeds=embeds,
            modality=segment.modality, offsets=getattr(segment, "offsets", None), expires=expires,
            rank=getattr(segment, "rank", None) or None,
        )  # fmt: skip

    # ------------------------------------------------------------------ bytes
    def _header(self, payload_bytes: int) -> dict:
        h, n, d = self.keys[0].shape
        ident = self.identity
        return {
            "key": self.key,
            "tenant": self.tenant,
            "model_fingerprint": ident.model_fingerprint,
            "processor_settings": ident.processor_settings,
            "content_id": ident.content_id,
            "created": self.created,
            "expires": self.expires,
            "dtype": _dtype_name(self.keys[0].dtype),
            "embeds_dtype": _dtype_name(self.embeds.dtype),
            "num_layers": len(self.keys),
            "kv_heads": h,
            "length": self.length,
            "kept": n,
            "head_dim": d,
            "hidden": self.embeds.shape[1],
            "payload_bytes": payload_bytes,
            "checksum": "sha256",
            **({} if self.rank is None else {"rank": self._stored_rank()}),
        }

    def _stored_rank(self) -> int:
        h, m, d = self.keys[0].shape
        return min(self.rank, m, h * d)

    def to_bytes(self, key: bytes | None = None) -> bytes:
        """The record as one self-describing bytes object (see the module docstring); signed with
        HMAC-SHA256 under ``key`` when given."""
        from safetensors.torch import save

        tensors = {"embeds": self.embeds, "modality": self.modality}
        if self.offsets is not None:
            tensors["offsets"] = self.offsets
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if self.rank is None:
                tensors[f"k.{layer}"], tensors[f"v.{layer}"] = k, v
                continue
            for name, t in (("k", k), ("v", v)):
                bar, basis = _factors(t, self._stored_rank())
                tensors[f"{name}bar.{layer}"], tensors[f"d{name}.{layer}"] = bar, basis
        payload = save({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})
        header = json.dumps(self._header(len(payload)), sort_keys=True, allow_nan=False).encode()
        version = self.version | (SIGNED if key is not None else 0)
        body = b"".join((_PREFIX.pack(MAGIC, version, len(header)), header, payload))
        tag = b"" if key is None else hmac.new(key, body, hashlib.sha256).digest()
        return body + hashlib.sha256(body).digest() + tag

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        model_fingerprint: str | None = None,
        layout_version: int = LAYOUT_VERSION,
        key: bytes | None = None,
    ) -> Record:
        """Parse and verify; raises :class:`CorruptRecord` (:class:`ForgedRecord`) or
        :class:`StaleRecord`, never returns a bad record.

        ``model_fingerprint`` None skips the model check (tools that only list or verify); ``key``
        (the store's HMAC key) requires a signed record with a valid tag.
        """
        header, hlen = _read_header(data, layout_version)
        start = _PREFIX.size + hlen
        body = start + header["payload_bytes"]
        tail = _DIGEST * (2 if header["signed"] else 1)
        if len(data) != body + tail:
            raise CorruptRecord(f"truncated: {len(data)} bytes, the header says {body + tail}")
        view = memoryview(data)
        if hashlib.sha256(view[:body]).digest() != bytes(view[body : body + _DIGEST]):
            raise CorruptRecord("checksum mismatch (sha256)")
        if key is not None:
            if not header["signed"]:
                raise ForgedRecord("unsigned record in a store that has a key")
            tag = hmac.new(key, view[:body], hashlib.sha256).digest()
            if not hmac.compare_digest(tag, bytes(view[body + _DIGEST :])):
                raise ForgedRecord("HMAC mismatch: not written with this store's key")
        if model_fingerprint is not None and header["model_fingerprint"] != model_fingerprint:
            raise StaleRecord(
                f"computed by model {header['model_fingerprint'][:12]}, this is {model_fingerprint[:12]}"
            )
        return cls._from_payload(header, bytes(view[start:body]))

    @classmethod
    def _from_payload(cls, header: dict, payload: bytes) -> Record:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(payload)
        except (SafetensorError, ValueError) as exc:
            raise CorruptRecord(f"unreadable payload ({exc})") from None
        layers, h, n, d = (header[f] for f in ("num_layers", "kv_heads", "length", "head_dim"))
        m = header["kept"]
        kv_dtype, emb_dtype = _dtype(header["dtype"]), _dtype(header["embeds_dtype"])
        want = {"embeds": ((n, header["hidden"]), emb_dtype), "modality": ((m,), torch.int8)}
        if header["compressed"]:
            want["offsets"] = ((m,), torch.int64)
        rank = header.get("rank")
        for layer in range(layers):
            if rank is None:
                want[f"k.{layer}"] = want[f"v.{layer}"] = ((h, m, d), kv_dtype)
            else:
                want[f"kbar.{layer}"] = want[f"vbar.{layer}"] = ((m, rank), kv_dtype)
                want[f"dk.{layer}"] = want[f"dv.{layer}"] = ((rank, h * d), kv_dtype)
        if set(tensors) != set(want):
            raise CorruptRecord(f"payload tensors {sorted(tensors)} do not match the header")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CorruptRecord(
                    f"tensor {name} is {tuple(t.shape)} {t.dtype}, the header says {shape} {dtype}"
                )
        try:
            identity = Identity(
                model_fingerprint=header["model_fingerprint"],
                processor_settings=header["processor_settings"],
                content_id=header["content_id"],
            )
            record = cls(
                identity=identity,
                tenant=header["tenant"],
                keys=[_dense(tensors, "k", i, h, d, rank) for i in range(layers)],
                values=[_dense(tensors, "v", i, h, d, rank) for i in range(layers)],
                embeds=tensors["embeds"],
                modality=tensors["modality"],
                offsets=tensors.get("offsets"),
                created=float(header["created"]),
                expires=None if header["expires"] is None else float(header["expires"]),
                rank=header.get("rank"),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise CorruptRecord(f"invalid header ({exc})") from None
        if record.key != header["key"]:
            raise CorruptRecord("the stored key does not match the record's identity and tenant")
        return record


def _factors(t: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``t (H_kv, m, D)`` → ``(m, rank)`` and ``(rank, H_kv·D)`` factors (exact SVD, fp32), in ``t``'s dtype."""
    from vlkv.runtime.kv.lowrank import truncated_svd

    h, m, d = t.shape
    bar, basis = truncated_svd(t.detach().cpu().permute(1, 0, 2).reshape(m, h * d).float(), rank, exact=True)
    pad = rank - bar.shape[1]  # an all-zero matrix has fewer components: zero columns keep the shape
    if pad:
        bar = torch.cat([bar, bar.new_zeros(m, pad)], 1)
        basis = torch.cat([basis, basis.new_zeros(pad, h * d)], 0)
    return bar.to(t.dtype).contiguous(), basis.to(t.dtype).contiguous()


def _dense(tensors: dict, name: str, layer: int, h: int, d: int, rank: int | None) -> Tensor:
    """Layer ``layer``'s ``(H_kv, m, D)`` K (``name`` "k") or V from a payload, dense or factored."""
    if rank is None:
        return tensors[f"{name}.{layer}"]
    bar, basis = tensors[f"{name}bar.{layer}"], tensors[f"d{name}.{layer}"]
    m = bar.shape[0]
    return (bar.float() @ basis.float()).view(m, h, d).permute(1, 0, 2).to(bar.dtype).contiguous()


__all__ = [
    "COMPRESSED",
    "CorruptRecord",
    "FACTORED",
    "ForgedRecord",
    "MAGIC",
    "MAX_HEADER",
    "MIN_KEY_BYTES",
    "PREFIX_SIZE",
    "Record",
    "RecordInfo",
    "SIGNED",
    "StaleRecord",
    "_PREFIX",
    "check_store_key",
    "header_size",
    "peek",
    "record_size",
]
