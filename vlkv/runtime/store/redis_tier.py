"""A context-store tier on a Redis (or Valkey) server, shared by every process that points at it.

One key per record: ``<prefix>:rec:<record key>`` holds the record's full self-describing bytes
(:meth:`Record.to_bytes`: header, payload and checksum in one object), written with one ``SET``. A
reader sees a whole record or none — there is no data key and metadata key to race between — and
every read is verified by the :class:`~vlkv.runtime.store.store.ContextStore` (checksum, model,
layout, key, tenant), so bytes damaged in or on the way from Redis are a counted miss, never used.
A record with an expiry is written with ``EXAT``, so Redis drops it when it expires.

Size and LRU belong to Redis: run the server with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (or ``volatile-lru`` when the server is shared with data that must
not be evicted). :meth:`RedisTier.victims` is therefore always empty — the store never demotes out of
the shared tier on one process's say-so. ``max_bytes`` (default: unbounded) is the namespace's budget
for an explicit ``ContextStore.gc`` (which trims least recently used records first); a record larger
than it or than 512 MiB (Redis's string limit) is not sent (a ``full`` fault). Under ``noeviction`` a
full server answers writes with an OOM error: counted as a ``full`` fault, the write is dropped,
reads go on.

Faults (server down, slower than ``timeout_s``, full, a reply of the wrong type) never raise: reads
miss, writes are dropped, and :attr:`RedisTier.faults` counts them (:mod:`~vlkv.runtime.store.remote`
backs off after an unreachable server and retries it later). ``redis`` is imported lazily.
"""

from __future__ import annotations

from vlkv.runtime.store.record import CorruptRecord, StaleRecord, peek
from vlkv.runtime.store.remote import (
    DOWN,
    ERROR,
    FULL,
    TIMEOUT,
    UNBOUNDED,
    Backoff,
    GuardedTier,
    RemoteGuard,
)

REDIS_MAX_VALUE = 512 << 20
SCAN_COUNT = 1000


def _redis():
    try:
        import redis
    except ImportError:
        raise ImportError(
            "the Redis tier needs the 'redis' client: pip install 'vlkv[store]' (or pip install redis)"
        ) from None
    return redis


class RedisTier(GuardedTier):
    """Record bytes in Redis under ``<prefix>:rec:<key>``; LRU and size are the server's (see the module).

    Args:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS).
        max_bytes: this namespace's budget for ``ContextStore.gc`` (default: unbounded; the server's
            ``maxmemory`` governs); records above ``min(max_bytes, 512 MiB)`` are dropped, counted.
        timeout_s: connect and per-call socket timeout; a slower call is a ``timeout`` fault (a miss).
        prefix: key namespace, so several stores (or other data) can share one Redis database.
        backoff: how long to leave the server alone after it looked unreachable.
        name: the tier's name in the store's stats.
    """

    holds = "bytes"

    def __init__(
        self,
        url: str,
        max_bytes: int | None = None,
        timeout_s: float = 2.0,
        prefix: str = "vlkv",
        backoff: Backoff | None = None,
        name: str = "redis",
    ):
        if max_bytes is None:
            max_bytes = UNBOUNDED
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not prefix or any(c.isspace() or c in "*?[]" for c in prefix):
            raise ValueError(f"prefix must be non-empty, without spaces or glob characters, got {prefix!r}")
        redis = _redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.name, self.url, self.max_bytes, self.timeout_s = name, url, max_bytes, timeout_s
        self.max_record_bytes = min(max_bytes, REDIS_MAX_VALUE)
        self.namespace = f"{prefix}:rec:"
        # no client-side retries: a failed call is a fault at once, and RemoteGuard decides when to retry
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._guard = RemoteGuard(_classify, backoff)

    # ------------------------------------------------------------------ the Tier protocol
    def get(self, key: str, touch: bool = True) -> bytes | None:
        """The bytes under ``key``, or None (absent, or a fault). Redis touches its LRU clock on every
        read; ``touch=False`` cannot avoid that."""
        name = self._name(key)
        value = self._guard.call(lambda: self.client.get(name), None)
        return bytes(value) if value is not None else None

    def __contains__(self, key: str) -> bool:
        name = self._name(key)
        return bool(self._guard.call(lambda: self.client.exists(name), 0))

    def put(self, key: str, value: bytes) -> None:
        """One ``SET`` of the whole record; dropped (and counted) on a fault."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"redis tier holds record bytes, got {type(value).__name__}")
        if len(value) > self.max_record_bytes:  # too big to send: dropped and counted, like a full server
            self._guard.count(FULL, ValueError(f"a record of {len(value)} bytes > {self.max_record_bytes}"))
            return
        name, data = self._name(key), bytes(value)
        exat = _expires(data)
        self._guard.call(lambda: self.client.set(name, data, exat=exat), None)

    def delete(self, key: str) -> bool:
        name = self._name(key)
        return bool(self._guard.call(lambda: self.client.delete(name), 0))

    def keys(self) -> list[str]:
        """Record keys in this namespace, least recently used first (by ``OBJECT IDLETIME``, which has a
        1-second resolution; in scan order when the server's policy is LFU, which keeps no idle time).
        O(records): for tools."""
        return self._guard.call(self._keys, [])

    def bytes_used(self) -> int:
        """Sum of this namespace's record sizes (``STRLEN`` of each key). O(records): for tools."""

        def used() -> int:
            names = self._scan()
            if not names:
                return 0
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.strlen(n)
            return sum(pipe.execute())

        return self._guard.call(used, 0)

    def victims(self, nbytes: int) -> list[str]:
        return []  # Redis evicts by its maxmemory policy; see the module docstring

    # ------------------------------------------------------------------ helpers
    def ping(self) -> bool:
        """True when the server answers now (not counted as a fault either way, ignores backoff)."""
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def _scan(self) -> list[bytes]:
        return list(self.client.scan_iter(match=self.namespace + "*", count=SCAN_COUNT))

    def _keys(self) -> list[str]:
        names = self._scan()
        keys = [n.decode()[len(self.namespace) :] for n in names]
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.object("idletime", n)
        idle = pipe.execute(raise_on_error=False)
        if any(isinstance(i, Exception) for i in idle):
            return keys
        return [k for _, k in sorted(zip(idle, keys), key=lambda p: -(p[0] or 0))]

    def close(self) -> None:
        self.client.close()


def _expires(data: bytes) -> int | None:
    """The record's expiry as whole Unix seconds (rounded up), or None (never, or unreadable header)."""
    try:
        expires = peek(data).expires
    except (CorruptRecord, StaleRecord):
        return None
    return None if expires is None else int(expires) + 1


def _classify(exc: BaseException) -> str | None:
    redis = _redis()
    e = redis.exceptions
    if isinstance(exc, (e.TimeoutError, TimeoutError)):
        return TIMEOUT
    if isinstance(exc, (e.ConnectionError, ConnectionError, OSError)):
        return DOWN
    if isinstance(exc, getattr(e, "OutOfMemoryError", ())) or (
        isinstance(exc, e.ResponseError) and str(exc).startswith("OOM")
    ):
        return FULL
    if isinstance(exc, e.RedisError):
        return ERROR
    return None
