"""What every remote tier shares: fault counters and exponential backoff, so a sick server never fails a request.

A remote tier (:class:`~vlkv.runtime.store.redis_tier.RedisTier`,
:class:`~vlkv.runtime.store.mooncake_tier.MooncakeTier`) runs each server call through
:meth:`RemoteGuard.call`. A call that fails with a fault its backend names (server down, timeout,
full, bad reply) returns the call's *default* — a miss for reads, a no-op for writes — and is
counted in :class:`FaultStats`. A fault that says the server is unreachable (down, timeout) starts
an exponential backoff: until it ends, calls are not made at all (counted as ``skipped``), so a dead
server is not hammered and a request does not wait on it. The first call after the backoff is the
retry; if it succeeds, the backoff resets (``recoveries``). A server that answered but refused
(full, a bad reply) is counted without backoff: it is alive and other calls may succeed.

Garbage *bytes* are not a tier fault: the tier returns them, and the
:class:`~vlkv.runtime.store.store.ContextStore` above it rejects them (``corrupt``/``stale`` in its
per-tier stats) and deletes the key.

:func:`remote_faults` reads every remote tier's counters from a store, for ``/metrics``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

T = TypeVar("T")

DOWN, TIMEOUT, FULL, ERROR = "down", "timeout", "full", "error"
UNBOUNDED = 1 << 60  # a remote tier's default budget: the server's own limit governs (maxmemory, segments)
_BACKS_OFF = {DOWN, TIMEOUT}


@dataclass
class FaultStats:
    """Counters of one remote tier. ``faults`` = ``down + timeout + full + error``; ``skipped`` calls were
    not made (backing off); ``recoveries``: a retry that succeeded after a backoff."""

    faults: int = 0
    down: int = 0
    timeout: int = 0
    full: int = 0
    error: int = 0
    skipped: int = 0
    recoveries: int = 0
    last_error: str = ""

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


@dataclass(slots=True)
class Backoff:
    """Exponential backoff with jitter: ``base_s * 2**(failures - 1)``, at most ``max_s``."""

    base_s: float = 0.05
    max_s: float = 5.0
    jitter: float = 0.2  # fraction of the delay added at random, so replicas do not retry in lockstep

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"base_s must be > 0, got {self.base_s}")
        if not self.max_s >= self.base_s:
            raise ValueError(f"max_s must be >= base_s ({self.base_s}), got {self.max_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, failures: int) -> float:
        d = min(self.max_s, self.base_s * 2 ** min(failures - 1, 30))
        return d * (1 + self.jitter * random.random())


class RemoteGuard:
    """Runs server calls for one tier: counts faults, backs off after the server looked unreachable."""

    def __init__(
        self,
        classify: Callable[[BaseException], str | None],
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.classify, self.backoff, self.clock = classify, backoff or Backoff(), clock
        self.stats = FaultStats()
        self._failures = 0  # consecutive unreachable faults
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def backing_off(self) -> bool:
        return self._failures > 0 and self.clock() < self._retry_at

    def call(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` when backing off or when ``fn`` raised a fault ``classify`` names.

        Exceptions ``classify`` does not name (None) are bugs, not faults: they propagate.
        """
        with self._lock:
            if self.backing_off:
                self.stats.skipped += 1
                return default
        try:
            out = fn()
        except Exception as exc:
            kind = self.classify(exc)
            if kind is None:
                raise
            self._fault(kind, exc)
            return default
        if self._failures:
            with self._lock:
                self._failures = 0
                self.stats.recoveries += 1
        return out

    def count(self, kind: str, exc: BaseException) -> None:
        """Count a fault found without a server call (e.g. a record too big to send); no backoff unless
        ``kind`` is down or timeout."""
        self._fault(kind, exc)

    def _fault(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            self.stats.faults += 1
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)
            self.stats.last_error = f"{kind}: {type(exc).__name__}: {exc}"[:300]
            if kind in _BACKS_OFF:
                self._failures += 1
                self._retry_at = self.clock() + self.backoff.delay(self._failures)


def remote_faults(store) -> dict[str, dict[str, int | str]]:
    """``{tier name: FaultStats.as_dict()}`` for every tier of ``store`` that has fault counters."""
    return {
        t.name: t.faults.as_dict() for t in store.tiers if isinstance(getattr(t, "faults", None), FaultStats)
    }


class GuardedTier:
    """What every remote tier shares: fault counters and backoff state from its :class:`RemoteGuard`,
    and record ids namespaced under ``namespace``. Subclasses set ``namespace`` and ``_guard``."""

    namespace: str
    _guard: RemoteGuard

    @property
    def faults(self) -> FaultStats:
        """This tier's fault counters (``faults``, ``down``, ``timeout``, ``full``, ``error``, ``skipped``, ...)."""
        return self._guard.stats

    @property
    def backing_off(self) -> bool:
        return self._guard.backing_off

    def _name(self, key: str) -> str:
        from vlkv.runtime.store.identity import validate_key

        return self.namespace + validate_key(key)
