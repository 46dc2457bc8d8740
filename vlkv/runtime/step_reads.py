"""What the host reads back after a decode group's step, once: the commit's inputs.

A step's per-request bookkeeping (usage counts, peak bytes, statistics trimmed to each request's
own table width, the greedy token) needs a handful of numbers per request and layer. Read one by
one they are a host sync each, per layer and request; here they are stacked on the device and read
back in one transfer per group, so a decode step's syncs do not grow with the number of layers.
"""

from __future__ import annotations

import torch

from vlkv.runtime.backend import StepStats
from vlkv.runtime.sampling import Sampler


class GroupReads:
    """What the host reads back after a group's step, in one transfer: per request the usage counts
    (entries held, attended, an uncompressed cache's), per request and layer the table widths the
    statistics are trimmed to, and the greedy requests' tokens (None for a sampling request)."""

    def __init__(self, group, out):
        caches = [e.request.cache for e in group.entries]
        b, num_layers = len(caches), len(caches[0].layers)
        lengths = torch.cat([c.lengths() for c in caches], dim=1)  # (L, B) after the append
        stored = lengths.sum(0)
        used = stored if out.attended is None else out.attended.sum(0)
        full = torch.cat([c.processed for c in caches]) * num_layers
        rows = [stored.double(), used.double(), full.double()]
        # requests with holes or low-rank factors: the pool slots they hold, summed here (one number a
        # request in the same read back) rather than by ``kv_bytes()``'s read per layer
        sparse = [i for i, c in enumerate(caches) if not _dense(c)]
        if sparse:
            held = torch.zeros(b, dtype=torch.float64, device=stored.device)
            held[sparse] = torch.stack([_held_slots(caches[i]) for i in sparse]).double()
            rows.append(held)
        if any(st is not None for st in out.stats) or any(getattr(out.stats, "extra", {}).values()):
            rows.extend(lengths.double())  # the widths the statistics are trimmed to
        greedy = [i for i, e in enumerate(group.entries) if _greedy(e.request.sampler)]
        if greedy:
            rows.append(torch.zeros(b, dtype=torch.float64, device=stored.device))
            rows[-1][greedy] = out.logits[greedy].argmax(-1).double()
        host = torch.stack(rows).tolist()  # the group's one read back
        self.usage = list(zip(host[0], host[1], host[2]))
        self._held = host[3] if sparse else None
        self.widths = None
        first = 3 + bool(sparse)
        if len(host) > first + bool(greedy):
            self.widths = [[int(host[first + layer][i]) for layer in range(num_layers)] for i in range(b)]
        self.tokens: list[int | None] = [None] * b
        for i in greedy:
            self.tokens[i] = int(host[-1][i])
        self._caches, self._stored = caches, host[0]

    def kv_bytes(self, i: int) -> int:
        """Request ``i``'s K/V bytes after the append (dense caches from the lengths read back)."""
        cache = self._caches[i]
        first = cache.layers[0]
        if _dense(cache):
            return int(self._stored[i]) * first.pool.spec.entry_bytes
        # a slot holds one head's entry: entry_bytes / H_kv (what LayerKV.kv_bytes counts per layer)
        factors = sum(la.lowrank.nbytes() for la in cache.layers if la.lowrank is not None)
        return int(self._held[i]) * (first.pool.spec.entry_bytes // first.kv_heads) + factors


def _held_slots(cache) -> torch.Tensor:
    """``()`` int64: the pool slots a one-sample cache's layers hold (valid columns with a slot ``>= 0``).
    Where every layer's lengths are known on the host and none has holes, one count over its layers'
    valid columns (a slice a layer, then 3 ops a request) rather than ``held_mask`` per layer (~10 ops
    a layer and request); else (or where the host copy is stale: never a read back) the masks."""
    cols = []
    for la in cache.layers:
        n = la.kept_lengths()
        if n is None or len(n) != 1 or la.holes is not None:
            return sum(la.held_mask().sum() for la in cache.layers)
        cols.append(la.slots[:, :, : n[0]])
    return (torch.cat(cols, dim=2) >= 0).sum()


def _dense(cache) -> bool:
    """No layer of ``cache`` has per-head holes or low-rank factors (its bytes follow its lengths)."""
    return all(layer.lowrank is None and layer.holes is None for layer in cache.layers)


def _greedy(sampler) -> bool:
    """``sampler`` is the plain greedy :class:`Sampler` (its token is the row's argmax, taken here for
    the whole group at once); any other sampler is called per request."""
    return type(sampler) is Sampler and not sampler.do_sample


def slice_stats(stats: list, i: int, widths: list[list[int]] | None) -> StepStats:
    """Request ``i``'s statistics, trimmed to its own layer widths (``widths[i][layer]``)."""
    from vlkv.plugins import AttnStats

    def cut(st, w):
        if st is None:
            return None
        below = None if st.below is None else st.below[i : i + 1]
        return AttnStats(st.colsum[i : i + 1, :, :w], below, st.visible[i : i + 1])

    if widths is None:
        return StepStats([None] * len(stats))
    layers = [cut(st, w) for st, w in zip(stats, widths[i])]
    extra = {n: [cut(st, w) for st, w in zip(v, widths[i])] for n, v in getattr(stats, "extra", {}).items()}
    return StepStats(layers, extra)
