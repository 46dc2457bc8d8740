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
        if any(st is not None for st in out.stats) or any(getattr(out.stats, "extra", {}).values()):
            rows.extend(lengths.double())  # the widths the statistics are trimmed to
        greedy = [i for i, e in enumerate(group.entries) if _greedy(e.request.sampler)]
        if greedy:
            rows.append(torch.zeros(b, dtype=torch.float64, device=stored.device))
            rows[-1][greedy] = out.logits[greedy].argmax(-1).double()
        host = torch.stack(rows).tolist()  # the group's one read back
        self.usage = list(zip(host[0], host[1], host[2]))
        self.widths = None
        if len(host) > 3 + bool(greedy):
            self.widths = [[int(host[3 + layer][i]) for layer in range(num_layers)] for i in range(b)]
        self.tokens: list[int | None] = [None] * b
        for i in greedy:
            self.tokens[i] = int(host[-1][i])
        self._caches, self._stored = caches, host[0]

    def kv_bytes(self, i: int) -> int:
        """Request ``i``'s K/V bytes after the append (dense caches from the lengths read back)."""
        cache = self._caches[i]
        if all(layer.lowrank is None and layer.holes is None for layer in cache.layers):
            return int(self._stored[i]) * cache.layers[0].pool.spec.entry_bytes
        return cache.kv_bytes()


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
