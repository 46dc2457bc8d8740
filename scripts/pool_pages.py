"""The KV pool's pages as a benchmark configuration (``bench_decode_bound`` / ``bench_decode_parts``).

``--kv-4k`` runs each configuration again as ``<config>+kv4k``: the same steps with the pool's K/V in
ordinary 4 KiB pages (``weight_pages.HUGE_KV`` off while its cache is copied, what ``VLKV_KV_HUGE_PAGES=0``
does) — the before of ``vlkv/runtime/kv/pool_memory.py``, bit-equal. Each configuration records how much of
its pool the kernel really held in huge pages (``kv_huge_share``: ``AnonHugePages`` over the bytes of the
pool's mappings, read right after the prefill is copied in), so a row says which memory it measured.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

from vlkv.plugins import weight_pages
from vlkv.runtime.kv import pool_memory

SUFFIX = "+kv4k"
HELP = (
    "also each configuration with its KV pool in ordinary 4 KiB pages (VLKV_KV_HUGE_PAGES=0: the before of "
    "the pool in huge pages, bit-equal), run right after it in every round, as '<config>+kv4k'"
)


def add_arg(ap) -> None:
    ap.add_argument("--kv-4k", action="store_true", help=HELP)


def twins(configs: list[str], on: bool) -> list[str]:
    """Each of ``configs`` as its ``+kv4k`` twin (none when ``on`` is false)."""
    return [f"{c}{SUFFIX}" for c in configs] if on else []


def base(name: str) -> str:
    return name.removesuffix(SUFFIX)


@contextmanager
def pool_pages(name: str, pre):
    """Run a configuration's steps with its pool in huge pages (unless ``name`` ends in ``+kv4k`` or the
    switch is off); yields a dict that gets ``kv_huge_share`` once the prefill is copied into the pool."""
    default, real = weight_pages.HUGE_KV, pre.cache_copy
    info: dict = {}

    def cache_copy():
        cache = real()
        pool = cache.layers[0].pool
        share = pool_memory.huge_share([*pool.keys, *pool.values])
        info["kv_huge_share"] = share[0] / share[1] if share and share[1] else 0.0
        return cache

    weight_pages.HUGE_KV = default and not name.endswith(SUFFIX)
    pre.cache_copy = cache_copy
    try:
        yield info
    finally:
        weight_pages.HUGE_KV = default
        del pre.cache_copy  # the class's method again


def paired_speed(got: dict[str, list[dict]], name: str, key: str = "step_s") -> float | None:
    """``name``'s ``+kv4k`` twin's ``key`` seconds over its own, paired per round (median), or None."""
    twin = got.get(f"{name}{SUFFIX}")
    if not twin:
        return None
    return statistics.median(t[key] / r[key] for t, r in zip(twin, got[name], strict=True) if r[key] > 0)
