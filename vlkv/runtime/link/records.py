"""Where the linker finds image records: in the pool first, then the persistent context store.

Keys are the store's record keys (model fingerprint, processor settings, image content, layout
version, tenant), so the in-pool cache is tenant-scoped exactly like the store: a
tenant never links another tenant's record from either place. A record found in the store is
verified there (checksum, model, layout, tenant, expiry) and loaded into the pool once; an image
computed alone is kept in the pool and written back to the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.segment_store import SegmentStore


@dataclass
class RecordSource:
    """The linker's view of records for one tenant.

    Attributes:
        segments: in-pool records (shared by every request on the pool).
        store: optional :class:`~vlkv.runtime.store.ContextStore` behind them.
        tenant: whose records these are (validated).
        fingerprint, settings: the model fingerprint and processor settings keys are made of.
        loaded_bytes: record bytes read from the store so far (a factored record counts its factors).
        writer: optional executor the store writes go to, so a new record is written back without
            delaying the answer (the record's tensors are copied out of the pool first).
        loader: optional executor store reads go to (:meth:`prefetch`), so hits load (read, verify,
            deserialise) while the misses compute; without it they load one by one, in order.
        ready: store look-ups the caller started ahead on the loader threads (record key →
            :class:`StoreRead`), e.g. the scheduler while the request waited for admission:
            :meth:`prefetch` takes their answers instead of asking the store on this thread.
    """

    segments: SegmentStore
    store: object | None
    tenant: str
    fingerprint: str
    settings: dict
    loaded_bytes: int = 0
    writer: object | None = None
    pending: list = field(default_factory=list)
    loader: object | None = None
    ready: dict = field(default_factory=dict)  # record key -> StoreRead started ahead

    @classmethod
    def for_engine(cls, engine, segments: SegmentStore, store=None, tenant: str = "default") -> RecordSource:
        from vlkv.runtime.link.sink import sink_ids
        from vlkv.runtime.store.identity import model_fingerprint, processor_settings, validate_tenant

        loaded = engine.loaded
        # records are computed after the template's opening: it is part of what their K/V depend on
        settings = {**processor_settings(loaded), "sink": sink_ids(engine)}
        return cls(segments, store, validate_tenant(tenant), model_fingerprint(loaded), settings)

    def identity(self, image, variant: dict | None = None):
        """The store identity of one prompt image (a PIL image, a path or a ``builtin:`` spec): always
        its pixels. A client's image ``uuid`` never names a record — it would let one client's uuid
        link another image's K/V (the server decodes the pixels anyway, so a uuid saves only a hash).
        ``variant`` (a compressed record's budget and scorer, :meth:`LinkSpec.record_variant`) joins
        the settings."""
        from vlkv.runtime.models.images import load_image
        from vlkv.runtime.store.identity import Identity, image_content

        settings = self.settings if variant is None else {**self.settings, "record": variant}
        return Identity.of(self.fingerprint, settings, content=image_content(load_image(image)))

    def key(self, identity) -> str:
        """This tenant's record key for an :meth:`identity` (computed once per image and request:
        an identity hashes the image's pixels)."""
        return identity.key(self.tenant)

    def prefetch(self, identities: list) -> list:
        """Start finding every identity's record; per identity, what :meth:`resolve` takes.

        An entry is the in-pool record, None for a miss known at once (nothing in any tier), or a
        pending store read (a future when a ``loader`` runs it in the background). The same image
        twice shares one read."""
        reads: dict[str, object] = {}
        out = []
        for ident in identities:
            key = self.key(ident)
            seg = self.segments.images.get(key)
            if seg is not None or self.store is None:
                out.append(seg)
            elif key in reads:
                out.append(reads[key])
            elif key in self.ready:
                ahead = self.ready.pop(key)
                if ahead.known_absent():
                    out.append(None)
                else:
                    found = ahead.find or self.loader.submit(self.store.find, ident, self.tenant)
                    out.append(reads.setdefault(key, _Read(ident, found)))
            elif self.loader is None:
                out.append(self.lookup(ident))
            elif not self.store.contains(ident, self.tenant):
                out.append(None)
            else:
                out.append(
                    reads.setdefault(
                        key, _Read(ident, self.loader.submit(self.store.find, ident, self.tenant))
                    )
                )
        return out

    def resolve(self, entry) -> SharedSegment | None:
        """The record a :meth:`prefetch` entry stands for (waits for its read), loaded into the pool."""
        if entry is None or isinstance(entry, SharedSegment):
            return entry
        key = self.key(entry.identity)
        seg = self.segments.images.get(key)
        if seg is not None:  # loaded already (the same image earlier in the prompt)
            return seg
        found = entry.found
        record = found.result() if hasattr(found, "result") else found
        if record is None or isinstance(record, SharedSegment):
            return record
        return self._load(key, record)

    def lookup(self, identity) -> SharedSegment | None:
        """The record of ``identity`` in the pool, loading it from the store on a pool miss."""
        key = self.key(identity)
        seg = self.segments.images.get(key)
        if seg is not None or self.store is None:
            return seg
        record = self.store.find(identity, self.tenant)
        return None if record is None else self._load(key, record)

    def _load(self, key: str, record) -> SharedSegment:
        """Copy a store record into the pool (the caller's thread: the pool is not thread-safe)."""
        seg = record.to_segment(self.segments.pool)
        seg.embeds = record.embeds.to(self.segments.pool.spec.device)
        self.loaded_bytes += record.stored_nbytes
        self.segments.images[key] = seg
        return seg

    def remember(self, identity, seg: SharedSegment, embeds: Tensor) -> None:
        """Keep a freshly computed image record in the pool and write it to the store."""
        self.segments.images[self.key(identity)] = seg
        if self.store is not None:
            from vlkv.runtime.store.record import Record

            rec = Record.from_segment(seg, identity, self.tenant, embeds=embeds.detach().cpu())
            if self.writer is None:
                self.store.put(rec)
            else:
                self.pending = [f for f in self.pending if not f.done()]
                self.pending.append(self.writer.submit(_put, self.store, rec))

    def flush(self) -> None:
        """Wait for the record writes still in flight."""
        for f in self.pending:
            f.result()
        self.pending = []


@dataclass
class StoreRead:
    """One record's store look-up started ahead on a loader thread: ``present`` (a future of
    :meth:`ContextStore.contains`), then ``find`` (a future of :meth:`ContextStore.find`, started once
    ``present`` said yes)."""

    identity: object
    present: object
    find: object | None = None

    def known_absent(self) -> bool:
        p = self.present
        return p.done() and p.exception() is None and not p.result()

    def start_find(self, loader, store, tenant: str) -> None:
        """Start the read once the look-up found the record (idempotent)."""
        p = self.present
        if self.find is None and p.done() and (p.exception() is not None or p.result()):
            self.find = loader.submit(store.find, self.identity, tenant)

    def done(self) -> bool:
        return self.present.done() and (self.known_absent() or (self.find is not None and self.find.done()))


@dataclass
class _Read:
    """One pending store read: the identity and its record (or a future of it)."""

    identity: object
    found: object


def _put(store, record) -> None:
    try:
        store.put(record)
    except Exception as err:  # a write that fails loses a future hit, never an answer
        logging.getLogger("vlkv.store").warning("record write failed: %s: %s", type(err).__name__, err)
