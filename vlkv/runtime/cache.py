"""Per-request, per-layer KV-cache state over a shared slot pool: a re-export.

The cache lives in ``vlkv/runtime/kv/``, one noun per module: the entry table
(:mod:`~vlkv.runtime.kv.entries`), appends (:mod:`~vlkv.runtime.kv.appends`), edits
(:mod:`~vlkv.runtime.kv.edits`), spare slots (:mod:`~vlkv.runtime.kv.spares`), a layer's cache
(:mod:`~vlkv.runtime.kv.layer`) and a batch's (:mod:`~vlkv.runtime.kv.cache`). This module keeps
``from vlkv.runtime.cache import KVCache, LayerKV, Modality`` working; nothing under ``kv/`` imports it.
"""

from vlkv.runtime.kv.appends import append_one_each
from vlkv.runtime.kv.cache import KVCache
from vlkv.runtime.kv.edits import RECYCLE_MAX
from vlkv.runtime.kv.entries import Modality
from vlkv.runtime.kv.layer import LayerKV, private_pool
from vlkv.runtime.kv.pool import GROW_SLOTS, KVPool, PoolSpec

__all__ = ["GROW_SLOTS", "RECYCLE_MAX", "KVCache", "KVPool", "LayerKV", "Modality", "PoolSpec"]
__all__ += ["append_one_each", "private_pool"]
