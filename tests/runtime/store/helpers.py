"""Small records built from seeded random tensors (no model needed)."""

from __future__ import annotations

import hashlib

import torch

from vlkv.runtime.store import Identity, Record

FP = hashlib.sha256(b"model A").hexdigest()
OTHER_FP = hashlib.sha256(b"model B").hexdigest()
SETTINGS = {"family": "llava", "size": {"shortest_edge": 56}}


def make_record(
    tenant: str = "alice",
    content: bytes = b"image-1",
    fp: str = FP,
    n: int = 5,
    layers: int = 2,
    heads: int = 2,
    dim: int = 4,
    hidden: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    expires: float | None = None,
) -> Record:
    """A record of ``n`` tokens with seeded random K/V ``(heads, n, dim)`` per layer."""
    g = torch.Generator().manual_seed(seed)
    return Record(
        identity=Identity.of(fp, SETTINGS, content=content),
        tenant=tenant,
        keys=[torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)],
        values=[torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)],
        embeds=torch.randn(n, hidden, generator=g).to(dtype),
        modality=torch.ones(n, dtype=torch.int8),
        expires=expires,
    )


def assert_same_record(a: Record, b: Record) -> None:
    assert a.key == b.key and a.tenant == b.tenant and a.identity == b.identity
    assert a.created == b.created and a.expires == b.expires
    for x, y in zip([*a.keys, *a.values, a.embeds, a.modality], [*b.keys, *b.values, b.embeds, b.modality]):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0)
