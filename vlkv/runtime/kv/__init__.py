"""KV storage: the slot pool every request writes into, and the per-request tables that index it."""

from vlkv.runtime.kv.pool import KVPool, PoolFull, PoolSpec

__all__ = ["KVPool", "PoolFull", "PoolSpec"]
