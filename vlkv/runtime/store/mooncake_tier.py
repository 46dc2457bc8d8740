"""A context-store tier on Mooncake Store (the distributed KV pool of vLLM, SGLang HiCache and Dynamo).

One object per record: ``<prefix>:rec:<record key>`` holds the record's full self-describing bytes,
written with one ``upsert`` (Mooncake's ``put`` keeps an existing object; ``upsert`` replaces it).
Every read is verified by the :class:`~vlkv.runtime.store.store.ContextStore` above, as for Redis.

How Mooncake is laid out: ``mooncake_master`` keeps the metadata (which object lives where) and an
HTTP metadata server; the bytes live in memory *segments* that clients mount into the pool. Each
process using this tier is such a client and contributes ``segment_bytes`` (0: it only reads and
writes others' memory, e.g. a dedicated ``mooncake_store_service`` process). Objects in a segment
vanish when its process exits, and the master forgets every object when it restarts; both are
misses here, never errors. Size and eviction are the master's (``--eviction_high_watermark_ratio``,
``--eviction_ratio``): :meth:`MooncakeTier.victims` is always empty; ``max_bytes`` (default:
unbounded) is the namespace's budget for an explicit ``ContextStore.gc``, and a record larger than
``buffer_bytes`` is not sent (a ``full`` fault). The transport is TCP (``protocol="tcp"``; ``rdma`` where the NICs exist).

The Python client does not raise: it returns error codes (or empty bytes), and a call to an
unreachable master can block for seconds. So every call runs on a small thread pool and is waited
for at most ``timeout_s``; codes and timeouts become faults counted in :attr:`MooncakeTier.faults`,
with the same backoff as every remote tier (:mod:`~vlkv.runtime.store.remote`). ``mooncake`` is
imported lazily (PyPI ``mooncake-transfer-engine-non-cuda``, which needs Debian's ``libibverbs1``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import urllib.parse
import urllib.request

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

MAX_RECORD = 1 << 30
# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this tier tells apart
NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, RPC_FAIL = -200, -704, -705, -900
_CONNECT_TIMEOUT_S = 10.0


class MooncakeFault(RuntimeError):
    """A Mooncake call that returned an error code (``kind``: down, full or error)."""

    def __init__(self, kind: str, what: str):
        super().__init__(what)
        self.kind = kind


def _code_fault(op: str, rc: int) -> MooncakeFault:
    kind = DOWN if rc == RPC_FAIL else FULL if rc == NO_AVAILABLE_HANDLE else ERROR
    return MooncakeFault(kind, f"{op} returned {rc}")


def _mooncake_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "the Mooncake tier needs 'mooncake-transfer-engine-non-cuda' (pip) and libibverbs1 (apt): "
            f"pip install 'vlkv[store]' ({exc})"
        ) from None
    return MooncakeDistributedStore


class MooncakeTier(GuardedTier):
    """Record bytes in Mooncake Store under ``<prefix>:rec:<key>``; eviction is the master's.

    Args:
        master: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata: the metadata server URL, e.g. ``http://127.0.0.1:8080/metadata`` (the master's own
            with ``--enable_http_metadata_server=true``).
        protocol: ``tcp`` (or ``rdma``).
        segment_bytes: memory this process contributes to the pool (0: none).
        buffer_bytes: this process's transfer buffer (bounds one record's size, too).
        local_hostname: the address other clients reach this process's segment at.
        timeout_s: the longest a call is waited for; a slower one is a ``timeout`` fault (a miss).
        admin: the master's HTTP admin URL (``--metrics_port``, default 9003) for :meth:`keys`.
        max_bytes: this namespace's budget for ``ContextStore.gc`` (default: unbounded).
    """

    holds = "bytes"

    def __init__(
        self,
        master: str,
        metadata: str,
        protocol: str = "tcp",
        segment_bytes: int = 256 << 20,
        buffer_bytes: int = 64 << 20,
        local_hostname: str = "127.0.0.1",
        timeout_s: float = 2.0,
        prefix: str = "vlkv",
        admin: str | None = None,
        max_bytes: int | None = None,
        backoff: Backoff | None = None,
        name: str = "mooncake",
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for field, value in (("segment_bytes", segment_bytes), ("buffer_bytes", buffer_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an int >= 0, got {value!r}")
        max_bytes = UNBOUNDED if max_bytes is None else max_bytes
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be non-empty, without spaces, got {prefix!r}")
        self._cls = _mooncake_store()
        self.name, self.max_bytes, self.timeout_s = name, max_bytes, timeout_s
        self.max_record_bytes = min(max_bytes, buffer_bytes or MAX_RECORD, MAX_RECORD)
        self.master, self.metadata, self.protocol = master, metadata, protocol
        self.segment_bytes, self.buffer_bytes, self.local_hostname = (
            segment_bytes,
            buffer_bytes,
            local_hostname,
        )
        self.admin = admin or f"http://{master.rsplit(':', 1)[0]}:9003"
        self.namespace = f"{prefix}:rec:"
        self._client = None
        self._connect_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="vlkv-mooncake")
        self._guard = RemoteGuard(_classify, backoff)
        self._guard.call(self._connected, None)  # a master that is down is a fault, not an error

    def _connected(self):
        """The client, set up on first use (again after a failed setup)."""
        with self._connect_lock:
            if self._client is not None:
                return self._client
            # the binding's setup holds the GIL while it retries a dead master (minutes): probe first
            for what, addr in (("master", self.master), ("metadata server", _host_port(self.metadata))):
                if addr is not None:
                    try:
                        socket.create_connection(
                            addr if isinstance(addr, tuple) else _split(addr), self.timeout_s
                        ).close()
                    except OSError as exc:
                        raise MooncakeFault(DOWN, f"{what} {addr} unreachable: {exc}") from None
            client = self._cls()

            def setup() -> int:
                return client.setup(
                    self.local_hostname,
                    self.metadata,
                    self.segment_bytes,
                    self.buffer_bytes,
                    self.protocol,
                    "",
                    self.master,
                )

            rc = self._pool.submit(setup).result(timeout=max(self.timeout_s, _CONNECT_TIMEOUT_S))
            if rc != 0:
                raise MooncakeFault(DOWN, f"setup with master {self.master} returned {rc}")
            self._client = client
            return client

    def _run(self, fn, default):
        """``fn(client)`` on the pool, waited for at most ``timeout_s``, through the fault guard."""

        def call():
            client = self._connected()
            return self._pool.submit(fn, client).result(timeout=self.timeout_s)

        return self._guard.call(call, default)

    # ------------------------------------------------------------------ the Tier protocol
    def get(self, key: str, touch: bool = True) -> bytes | None:
        name = self._name(key)

        def get(client) -> bytes | None:
            data = client.get(name)
            if data:
                return bytes(data)
            # empty bytes: absent, or the master could not be asked (the client says which)
            if client.health_check() != 0:
                raise MooncakeFault(DOWN, f"get({name}) with the master unreachable")
            return None

        return self._run(get, None)

    def __contains__(self, key: str) -> bool:
        name = self._name(key)

        def exists(client) -> bool:
            rc = client.is_exist(name)
            if rc < 0:
                raise _code_fault("is_exist", rc)
            return rc == 1

        return self._run(exists, False)

    def put(self, key: str, value: bytes) -> None:
        """One ``upsert`` of the whole record; dropped (and counted) on a fault."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"mooncake tier holds record bytes, got {type(value).__name__}")
        if len(value) > self.max_record_bytes:  # too big to send: dropped and counted, like a full server
            self._guard.count(FULL, ValueError(f"a record of {len(value)} bytes > {self.max_record_bytes}"))
            return
        name, data = self._name(key), bytes(value)

        def put(client) -> None:
            rc = client.upsert(name, data)
            if rc not in (0, OBJECT_ALREADY_EXISTS):
                raise _code_fault("upsert", rc)

        self._run(put, None)

    def delete(self, key: str) -> bool:
        name = self._name(key)

        def remove(client) -> bool:
            rc = client.remove(name, True)  # force: a read's lease does not keep a rejected record alive
            if rc not in (0, OBJECT_NOT_FOUND):
                raise _code_fault("remove", rc)
            return rc == 0

        return self._run(remove, False)

    def keys(self) -> list[str]:
        """This namespace's record keys (from the master's ``/get_all_keys``; in no LRU order: Mooncake
        does not say). O(records): for tools."""

        def keys() -> list[str]:
            with urllib.request.urlopen(f"{self.admin}/get_all_keys", timeout=self.timeout_s) as r:
                names = r.read().decode().split()
            return [n[len(self.namespace) :] for n in names if n.startswith(self.namespace)]

        return self._guard.call(keys, [])

    def bytes_used(self) -> int:
        """Sum of this namespace's object sizes. O(records): for tools."""
        names = [self.namespace + k for k in self.keys()]
        sizes = self._run(lambda client: [client.get_size(n) for n in names], [])
        return sum(s for s in sizes if s > 0)

    def victims(self, nbytes: int) -> list[str]:
        return []  # the master evicts (see the module docstring)

    def close(self) -> None:
        """Unmount this process's segment (its records leave the pool) and stop the pool."""
        if self._client is not None:
            with contextlib.suppress(
                Exception
            ):  # closing a client of a dead master may fail: nothing to keep
                self._pool.submit(self._client.close).result(timeout=_CONNECT_TIMEOUT_S)
            self._client = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _split(host_port: str) -> tuple[str, int]:
    host, _, port = host_port.rpartition(":")
    return host.strip("[]"), int(port)


def _host_port(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of an ``http://`` metadata URL; None for other kinds (etcd, P2P)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _classify(exc: BaseException) -> str | None:
    if isinstance(exc, MooncakeFault):
        return exc.kind
    if isinstance(exc, concurrent.futures.TimeoutError):
        return TIMEOUT
    if isinstance(exc, OSError):  # includes the admin URL's urllib errors
        return DOWN
    if isinstance(exc, RuntimeError):  # the binding's own errors
        return ERROR
    return None
