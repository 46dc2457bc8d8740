"""How far linked K/V entries sit from a full recompute's: per layer and prompt row.

A stored image's record is computed alone (after the template opening); linked into a prompt, its
entries miss everything the prompt puts before the image. This module measures that gap between two
caches of the same prompt (a linked one and a plain full prefill), the quantity CacheBlend checks at
one early layer (:mod:`vlkv.runtime.link.cacheblend`) — here at every layer, for diagnosis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache


def kv_deviation(linked: KVCache, full: KVCache, n: int) -> tuple[Tensor, Tensor]:
    """Relative squared deviation of every layer's K and V, per prompt row.

    Both caches hold one prompt of ``n`` rows in sequence order (a linked cache is, after
    :func:`vlkv.runtime.link.linker.link_prefill`). Keys are compared rotated to their positions.

    Returns:
        ``(dk, dv)``: ``(L, n)`` float32 each, ``||x_linked - x_full||² / ||x_full||²`` per row, the
        norms over KV heads and head dims.
    """
    if len(linked.layers) != len(full.layers):
        raise ValueError(f"caches of {len(linked.layers)} and {len(full.layers)} layers cannot be compared")
    dk, dv = [], []
    for a, b in zip(linked.layers, full.layers):
        (ka, va), (kb, vb) = a.attention_kv(n), b.attention_kv(n)  # (1, H_kv, n, D)
        for out, x, y in ((dk, ka, kb), (dv, va, vb)):
            x, y = x.float(), y.float()
            out.append((x - y).square().sum(dim=(0, 1, 3)) / y.square().sum(dim=(0, 1, 3)).clamp_min(1e-30))
    return torch.stack(dk), torch.stack(dv)
