"""The in-pool records a scheduler links from: image K/V and prompt prefixes, tenant-scoped."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.kv.segments import SharedSegment


@dataclass
class SegmentStore:
    """In-pool records by key: image K/V (per image content) and prompt prefixes, all in ``pool``.

    The persistent, tiered, tenant-scoped store (``vlkv.runtime.store``) feeds records into this.
    Both tables are tenant-scoped: an image key is the store's record key (the tenant folded in) and
    a prefix key starts with the tenant (:func:`identity`), so one pool serves every tenant and no
    tenant ever links another's entries (a hit would be a timing side channel, vLLM's ``cache_salt``).
    """

    pool: KVPool
    images: dict[str, SharedSegment] = field(default_factory=dict)
    prefixes: dict[tuple, SharedSegment] = field(default_factory=dict)

    def release(self) -> None:
        for seg in [*self.images.values(), *self.prefixes.values()]:
            seg.release()
        self.images.clear()
        self.prefixes.clear()
