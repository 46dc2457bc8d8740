"""Admission prices: what a request is expected to hold, and whether it can ever fit a fixed pool."""

from __future__ import annotations

import math


class RequestTooLarge(ValueError):
    """A request that could never fit in the scheduler's pool."""


def reserve(req, n: int) -> int:
    """Entries per layer request ``req`` (``n`` prompt tokens) is expected to hold at most: its
    admission price (``budget × prompt`` + generated tokens for compress-once policies,
    ``budget × (prompt + max_new)`` for policies that evict while decoding)."""
    budget, m = float(req.policy.budget), req.max_new_tokens
    if budget >= 1:
        return n + m
    if req.policy.evicts_during_decode:  # a cadence wrapper lets the cache run ``every - 1`` over
        return min(n + m, math.ceil(budget * (n + m)) + 8 + getattr(req.policy, "every", 1))
    return min(n + m, math.ceil(budget * n) + m)


def check_pool(req, pool) -> None:
    """Raise :class:`RequestTooLarge` (one line, sizes named) when ``req`` (its ``reserve`` set) could
    never fit in ``pool``, a fixed :class:`~vlkv.runtime.kv.pool.KVPool`; a growable pool takes anything."""
    if pool.grow:
        return
    n = req.prompt_tokens
    slots = pool.capacity(0)
    need = max(n, req.reserve)
    if need > slots:
        per = pool.spec.entry_bytes * pool.spec.num_layers
        raise RequestTooLarge(
            f"request {req.id} needs {need} KV entries per layer ({need * per} bytes: "
            f"{n} prompt tokens, {req.max_new_tokens} new, policy {req.policy.name} at "
            f"budget {float(req.policy.budget):g}); the pool holds {slots} ({slots * per} bytes)"
        )
