"""The context store: tenant-scoped records over tiers (device → host → disk), verified on every read.

Lookup (:meth:`ContextStore.get`) walks the tiers top-down. A hit is promoted to the fastest tier it
fits in (moved between memory tiers, copied from the last, persistent tier); writing into a full
tier first demotes that tier's least recently used records one tier down. :meth:`ContextStore.put`
writes to the fastest tier that fits and through to the last tier, so a record survives a restart.

Whatever a tier returns is checked before it is used: the checksum and the layout (host and disk
bytes), the model fingerprint, the key (the record's own identity + tenant must hash to the key that
was asked for), the tenant and the expiry. A record failing a check is a *miss*: it is deleted from
that tier, counted (``corrupt``, ``stale``, ``expired``) and never returned. A record of another
tenant is never returned either (``foreign``); the key already folds the tenant in, so this check
is the second of two independent walls.

Two libraries share the tiers: a tenant's *static* library (its uploads, which expire after
``static_ttl_s``) and the *dynamic* library of operator-curated records stored under
:data:`SHARED_TENANT`, which every tenant may read (:meth:`find` looks in both) but only
:meth:`put_shared` writes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from vlkv.runtime.store.identity import SHARED_TENANT, Identity, validate_key, validate_tenant
from vlkv.runtime.store.record import (
    CorruptRecord,
    ForgedRecord,
    Record,
    RecordInfo,
    StaleRecord,
    check_store_key,
    peek,
)
from vlkv.runtime.store.tiers import DeviceTier, DiskTier, HostTier, Tier

DEFAULT_DISK_BYTES = 16 << 30
DEFAULT_HOST_BYTES = 2 << 30
STORE_KEY_ENV = "VLKV_STORE_KEY"  # the deployment's record-signing secret


@dataclass
class TierStats:
    """Counters of one tier. ``misses``: lookups the tier could not answer (absent or rejected)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    forged: int = 0  # intact records refused for a missing or wrong HMAC tag (a keyed store)
    stale: int = 0
    foreign: int = 0
    expired: int = 0
    evictions: int = 0
    bytes_loaded: int = 0
    bytes_written: int = 0


_SUMMED = ("corrupt", "forged", "stale", "foreign", "expired", "evictions", "bytes_loaded", "bytes_written")


def _total(name: str) -> property:
    return property(lambda self: sum(getattr(t, name) for t in self.tiers.values()), doc=f"{name}, all tiers")


@dataclass
class StoreStats:
    """Per-tier counters plus the store's own ``hits``/``misses`` (lookups answered / not answered);
    ``corrupt``, ``stale``, ``foreign``, ``expired``, ``evictions``, ``bytes_loaded``, ``bytes_written``
    are sums over the tiers."""

    tiers: dict[str, TierStats] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    corrupt = _total("corrupt")
    forged = _total("forged")
    stale = _total("stale")
    foreign = _total("foreign")
    expired = _total("expired")
    evictions = _total("evictions")
    bytes_loaded = _total("bytes_loaded")
    bytes_written = _total("bytes_written")

    def to_dict(self) -> dict:
        total = {"hits": self.hits, "misses": self.misses, **{n: getattr(self, n) for n in _SUMMED}}
        return {**total, "tiers": {name: asdict(t) for name, t in self.tiers.items()}}


@dataclass(frozen=True)
class Entry:
    """One stored record as a listing sees it; ``problem`` names why it cannot be parsed (else None)."""

    tier: str
    key: str
    nbytes: int
    info: RecordInfo | None
    problem: str | None = None


class ContextStore:
    """Records by key over ``tiers`` (fastest first), scoped by tenant.

    Args:
        tiers: e.g. ``[DeviceTier(...), HostTier(...), DiskTier(...)]``; names must differ.
        model_fingerprint: when given, records of any other model are stale (a miss, deleted).
        static_ttl_s: lifetime given to a tenant's record put without an expiry (None: never expires).
        clock: the time source for expiry (Unix seconds).
        store_key: HMAC-SHA256 key (>= 16 bytes) every byte tier's record is signed with and checked
            against: a record without a valid tag is refused (``forged``), deleted and recomputed.
            None reads ``VLKV_STORE_KEY`` from the environment; unset = unkeyed (SHA-256 only).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        model_fingerprint: str | None = None,
        static_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        store_key: bytes | str | None = None,
    ):
        if store_key is None:
            store_key = os.environ.get(STORE_KEY_ENV) or None
        self._key = check_store_key(store_key)
        if not tiers:
            raise ValueError("a context store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        if static_ttl_s is not None and not static_ttl_s > 0:
            raise ValueError(f"static_ttl_s must be > 0 or None, got {static_ttl_s}")
        self.tiers = list(tiers)
        self.model_fingerprint = None if model_fingerprint is None else validate_key(model_fingerprint)
        self.static_ttl_s, self.clock = static_ttl_s, clock
        self.stats = StoreStats({t.name: TierStats() for t in self.tiers})
        self._lock = threading.RLock()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        disk_bytes: int = DEFAULT_DISK_BYTES,
        host_bytes: int = DEFAULT_HOST_BYTES,
        device_bytes: int = 0,
        device: torch.device | str | None = None,
        create: bool = True,
        **kwargs,
    ) -> ContextStore:
        """A store on directory ``path``: [device,] host (if ``host_bytes``), disk tiers.

        A path that is a file or not writable is a one-line ``ValueError`` naming it.
        """
        tiers: list[Tier] = []
        if device_bytes:
            tiers.append(DeviceTier(device_bytes, device or "cuda"))
        if host_bytes:
            tiers.append(HostTier(host_bytes))
        tiers.append(DiskTier(path, disk_bytes, create=create))
        return cls(tiers, **kwargs)

    # ------------------------------------------------------------------ reads
    def get(self, key: str, tenant: str) -> Record | None:
        """The record ``key`` if ``tenant`` may read it and it passes every check, else None (a miss).

        A hit is promoted; when a device tier takes it, the record returned is the device tier's (its
        tensors on the device). Treat it as read-only: the tier holds the same object.
        """
        validate_key(key)
        validate_tenant(tenant, allow_reserved=True)
        with self._lock:
            record = self._lookup(key, tenant)
            if record is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return record

    def find(self, identity: Identity, tenant: str) -> Record | None:
        """The tenant's own record of ``identity``, else the dynamic library's, else None (one lookup)."""
        validate_tenant(tenant, allow_reserved=True)
        with self._lock:
            record = self._lookup(identity.key(tenant), tenant)
            if record is None and tenant != SHARED_TENANT:
                record = self._lookup(identity.key(SHARED_TENANT), tenant)
            if record is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return record

    def contains(self, identity: Identity, tenant: str) -> bool:
        """Whether some tier holds a record :meth:`find` would try (no read, no verification): a
        cheap hint that lets a linker start loading hits and computing misses at once. A record it
        reports may still turn out damaged (then :meth:`find` is a miss)."""
        validate_tenant(tenant, allow_reserved=True)
        keys = [identity.key(tenant)] + ([identity.key(SHARED_TENANT)] if tenant != SHARED_TENANT else [])
        return any(key in tier for key in keys for tier in self.tiers)

    def _lookup(self, key: str, tenant: str) -> Record | None:
        now = self.clock()
        for i, tier in enumerate(self.tiers):
            st = self.stats.tiers[tier.name]
            value = tier.get(key)
            if value is None:
                st.misses += 1
                continue
            try:
                record = self._verify(value, key)
            except ForgedRecord:
                tier.delete(key)  # never used; the recompute writes a signed record in its place
                st.forged += 1
                st.misses += 1
                continue
            except CorruptRecord:
                tier.delete(key)
                st.corrupt += 1
                st.misses += 1
                continue
            except StaleRecord:
                tier.delete(key)
                st.stale += 1
                st.misses += 1
                continue
            if record.tenant != tenant and not record.shared:
                # The owner's intact record, asked for under another tenant: refused, left in place.
                st.foreign += 1
                st.misses += 1
                return None
            if record.expired(now):
                self._delete(key)
                st.expired += 1
                st.misses += 1
                return None
            st.hits += 1
            st.bytes_loaded += value.nbytes if isinstance(value, Record) else len(value)
            return self._promote(i, key, record, value)
        return None

    def _verify(self, value: bytes | Record, key: str) -> Record:
        if isinstance(value, Record):
            record = value
            if self.model_fingerprint and record.identity.model_fingerprint != self.model_fingerprint:
                raise StaleRecord("computed by another model")
        else:
            record = Record.from_bytes(value, model_fingerprint=self.model_fingerprint, key=self._key)
        if record.key != key:
            raise CorruptRecord(f"file of record {key[:12]} holds record {record.key[:12]}")
        return record

    # ------------------------------------------------------------------ writes
    def put(self, record: Record) -> list[str]:
        """Store a tenant's record (static library); it gets ``static_ttl_s`` when it has no expiry.

        Returns the names of the tiers that took it (empty: bigger than every tier's budget).
        """
        if record.shared:
            raise ValueError(f"records of the shared library ({SHARED_TENANT}) are written with put_shared")
        if record.expires is None and self.static_ttl_s is not None:
            record.expires = self.clock() + self.static_ttl_s
        return self._put(record)

    def put_shared(self, record: Record) -> list[str]:
        """Store an operator-curated record in the dynamic library (readable by every tenant)."""
        if not record.shared:
            raise ValueError(f"a shared record must have tenant {SHARED_TENANT!r}, got {record.tenant!r}")
        return self._put(record)

    def _put(self, record: Record) -> list[str]:
        fp = record.identity.model_fingerprint
        if self.model_fingerprint and fp != self.model_fingerprint:
            raise ValueError(
                f"record of model {fp[:12]} does not belong in this store (model {self.model_fingerprint[:12]})"
            )
        with self._lock:
            self._delete(record.key)
            data = None if all(t.holds == "record" for t in self.tiers) else record.to_bytes(self._key)
            last = len(self.tiers) - 1
            placed = next((i for i in range(last + 1) if self._place(i, record.key, record, data)), None)
            if placed is None:
                return []
            took = [self.tiers[placed].name]
            # write through to the last tier, so the record survives a restart
            if placed != last and self._place(last, record.key, record, data):
                took.append(self.tiers[last].name)
            return took

    def _place(self, i: int, key: str, record: Record | None, data: bytes | None) -> bool:
        """Write into tier ``i`` after demoting its LRU victims; False when the record cannot fit."""
        tier = self.tiers[i]
        if tier.holds == "record":
            if record is None:
                record = Record.from_bytes(data, model_fingerprint=self.model_fingerprint, key=self._key)
            value, size = record, record.nbytes
        else:
            value = data if data is not None else record.to_bytes(self._key)
            size = len(value)
        if size > tier.max_bytes:
            return False
        for victim in tier.victims(size):
            self._demote(i, victim)
        tier.put(key, value)
        self.stats.tiers[tier.name].bytes_written += size
        return True

    def _demote(self, i: int, key: str) -> None:
        tier = self.tiers[i]
        value = tier.get(key, touch=False)
        tier.delete(key)
        self.stats.tiers[tier.name].evictions += 1
        if value is None or i + 1 >= len(self.tiers) or key in self.tiers[i + 1]:
            return
        record, data = (value, None) if isinstance(value, Record) else (None, value)
        try:
            self._place(i + 1, key, record, data)
        except (CorruptRecord, StaleRecord):
            self.stats.tiers[tier.name].corrupt += 1  # damaged in memory: dropped, not demoted

    def _promote(self, i: int, key: str, record: Record, value: bytes | Record) -> Record:
        """Copy a hit in tier ``i`` into the fastest tier it fits in; the record as that tier holds it.

        Memory tiers hold a record once (it leaves tier ``i``); the last, persistent tier keeps its copy.
        """
        data = None if isinstance(value, Record) else value
        for j in range(i):
            if self._place(j, key, record, data):
                if i != len(self.tiers) - 1:
                    self.tiers[i].delete(key)
                held = self.tiers[j].get(key, touch=False)
                return held if isinstance(held, Record) else record
        return record

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; True when some tier held it."""
        validate_key(key)
        with self._lock:
            return self._delete(key)

    def _delete(self, key: str) -> bool:
        return any([tier.delete(key) for tier in self.tiers])

    # ------------------------------------------------------------------ maintenance
    def entries(self) -> list[Entry]:
        """Every record of every tier (headers only where the tier allows), LRU first per tier."""
        out = []
        with self._lock:
            for tier in self.tiers:
                for key in tier.keys():  # noqa: SIM118 (a Tier's LRU list, not a dict)
                    out.append(self._entry(tier, key))
        return [e for e in out if e is not None]

    def _entry(self, tier: Tier, key: str) -> Entry | None:
        if isinstance(tier, DiskTier):
            got = tier.head(key)
            if got is None:
                return None
            data, size = got
        else:
            value = tier.get(key, touch=False)
            if value is None:
                return None
            if isinstance(value, Record):
                info = RecordInfo(
                    value.key, value.tenant, value.created, value.expires, value.length, value.nbytes, {}
                )
                return Entry(tier.name, key, value.nbytes, info)
            data, size = value, len(value)
        try:
            return Entry(tier.name, key, size, peek(data, size))
        except (CorruptRecord, StaleRecord) as exc:
            return Entry(tier.name, key, size, None, str(exc))

    def gc(
        self, max_bytes: int | None = None, temp_age_s: float = 600.0, tenant: str | None = None
    ) -> dict[str, int]:
        """Remove expired, corrupt and stale records, then LRU records over budget, then old temp files.

        Reads every record (checksums need the whole payload). ``max_bytes`` overrides the last
        (disk) tier's budget for this pass. With ``tenant``, only records whose header names that
        tenant are touched, ``max_bytes`` bounds that tenant's bytes, and temp files are left alone.
        Returns counts by reason and ``freed_bytes``.
        """
        if tenant is not None:
            validate_tenant(tenant, allow_reserved=True)
        report = dict.fromkeys(("expired", "corrupt", "stale", "evicted", "temp", "freed_bytes"), 0)
        now = self.clock()
        with self._lock:
            for i, tier in enumerate(self.tiers):
                kept: dict[str, int] = {}  # LRU first: key -> bytes, of the records in scope
                for key in tier.keys():  # noqa: SIM118 (a Tier's LRU list, not a dict)
                    value = tier.get(key, touch=False)
                    if value is None:
                        continue
                    size = value.nbytes if isinstance(value, Record) else len(value)
                    try:
                        record = self._verify(value, key)
                        owner, reason = record.tenant, "expired" if record.expired(now) else None
                    except (CorruptRecord, StaleRecord) as exc:
                        owner, reason = (
                            _owner(value),
                            "corrupt" if isinstance(exc, CorruptRecord) else "stale",
                        )
                    if tenant is not None and owner != tenant:
                        continue
                    if reason:
                        tier.delete(key)
                        report[reason] += 1
                        report["freed_bytes"] += size
                    else:
                        kept[key] = size
                last = i == len(self.tiers) - 1
                budget = max_bytes if max_bytes is not None and last else None if tenant else tier.max_bytes
                used = sum(kept.values()) if tenant else tier.bytes_used()
                for key, size in kept.items():
                    if budget is None or used <= budget:
                        break
                    tier.delete(key)
                    used -= size
                    report["evicted"] += 1
                    report["freed_bytes"] += size
                if isinstance(tier, DiskTier) and tenant is None:
                    report["temp"] += tier.gc_temp(temp_age_s)
        return report


def _owner(value: bytes | Record) -> str | None:
    """The tenant a damaged record's header names, if its header can still be read."""
    if isinstance(value, Record):
        return value.tenant
    try:
        return peek(value).tenant
    except (CorruptRecord, StaleRecord):
        return None
