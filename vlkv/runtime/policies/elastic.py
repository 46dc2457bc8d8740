"""``elastic`` (Elastic Cache, Liu et al. ECCV 2024): importance-driven merging at prefill,
fixed-point elimination while decoding. See ``methods.md`` §1, ``docs/policies.md`` and
``docs/elastic.md`` (checked step by step against the authors' algorithm; measured on real text)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import CutEdit, LayerEdit, Policy

STATE_P = "elastic_fixed_point"
# int(n - n*budget) in floating point turns 10 * 0.7 into 2.999...: absorb that rounding noise
EPS = 1e-6


def nearest_anchor(thrown: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """For each thrown slot ``(T,)`` the index into ascending ``anchors (A,)`` of the nearest one
    by slot distance; ties go to the lower-slot anchor (the floor-midpoint buckets of Eq. 2)."""
    right = torch.searchsorted(anchors, thrown).clamp(max=anchors.numel() - 1)
    left = (right - 1).clamp(min=0)
    d_left = (thrown - anchors[left]).abs()
    d_right = (anchors[right] - thrown).abs()
    return torch.where(d_left <= d_right, left, right)


@dataclass
class ElasticPolicy(Policy):
    """Elastic Cache.

    Prefill (per layer, all heads share anchors): importance ``S[j]`` = head-mean attention
    column sum over every prompt row. With ``f = ⌊n·(1 - budget)⌋`` entries to forget, the
    candidate region ``[start, n-1)`` keeps its ``|C| - 1 - f`` most important entries as anchors;
    every other candidate is averaged (post-RoPE K and V, per head) into its nearest anchor.
    The cache becomes ``[first start] + anchors + [last prompt token]`` (``n - f - 1`` entries).

    Decode: with ``N`` tokens processed and ``L`` entries held, when ``⌊L - N·budget⌋ >= 1``
    the entry at the fixed point ``P = (n - f) + distance`` is deleted, so entries before ``P``
    are frozen and those after it form a FIFO.

    Attributes:
        start: leading entries never merged (BOS), >= 0.
        distance: ``P`` offset from the compressed prompt's end when <= 0, absolute slot when > 0.
        reference_quirks: reproduce the reference code's anchor choice (anchors are the
            candidates whose *argsort position* exceeds f, not the true top-k). Its other quirks
            (un-offset thrown indices, f == 1 deleting BOS, batch > 1 indexing) are not reproduced.
        positions: ``"original"`` by default. The authors' code numbers new tokens by the cache
            length (``"compacted"``), which on real text costs several times more perplexity than
            the method itself (``docs/elastic.md``); ``"compacted"`` reproduces it.
        merge: average thrown entries into their anchor (the method); False drops them (ablation).
        recent: the last ``recent`` prompt entries before the last one are kept as they are, outside
            the candidate region (ablation, >= 0; the method protects only the last token).
    """

    start: int = 1
    distance: int = -25
    reference_quirks: bool = False
    merge: bool = True
    recent: int = 0
    positions: str = "original"

    name: ClassVar[str] = "elastic"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("start", "recent")
    evicts_during_decode: ClassVar[bool] = True
    # batched over requests (``policies.cohort``): the fixed points concatenated
    cohort_decode: ClassVar[str | None] = "any_step"
    cohort_state: ClassVar[dict[str, int]] = {STATE_P: 0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0, got {self.recent}")

    def prefill_request(self, ctx, rows):
        return StatsRequest()

    def _plan(self, importance: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One sample: ``importance (n,)`` → kept slots ``(K,)``, per-slot target ``(n,)``, f."""
        f = math.floor(n * (1 - self.budget) + EPS)
        tail = max(n - 1 - self.recent, self.start)  # the protected tail [tail, n)
        dev = importance.device
        cand = torch.arange(self.start, tail, device=dev)
        f = min(f, cand.numel() - 2)  # always keep at least one anchor
        if f <= 0:
            return torch.arange(n, device=dev), torch.arange(n, device=dev), 0
        n_anchor = cand.numel() - 1 - f
        s = importance[self.start : tail]
        if self.reference_quirks:
            anchors = cand[torch.argsort(s, stable=True) > f]
        else:
            anchors = torch.sort(cand[torch.sort(s, descending=True, stable=True).indices[:n_anchor]]).values
        kept = torch.cat([torch.arange(self.start, device=dev), anchors, torch.arange(tail, n, device=dev)])
        target = torch.full((n,), -1, dtype=torch.long, device=dev)
        target[kept] = torch.arange(kept.numel(), device=dev)
        if self.merge:
            thrown = cand[target[cand] < 0]
            target[thrown] = self.start + nearest_anchor(thrown, anchors)
        return kept, target, f

    def after_prefill(self, cache: KVCache, stats, ctx):
        bsz, heads, dev = cache.batch_size, ctx.num_kv_heads, cache.device
        fixed = torch.zeros(bsz, dtype=torch.long, device=dev)
        edits = []
        for layer, st in zip(cache.layers, stats):
            importance = st.colsum.mean(1)  # (B, S)
            width = layer.max_length
            plans = [self._plan(importance[b], int(layer.lengths[b])) for b in range(bsz)]
            k = max(p[0].numel() for p in plans)
            index = torch.zeros(bsz, k, dtype=torch.long, device=dev)
            assign = torch.full((bsz, width), -1, dtype=torch.long, device=dev)
            keep_len = torch.zeros(bsz, dtype=torch.long, device=dev)
            for b, (kept, target, f) in enumerate(plans):
                n = target.numel()
                index[b, : kept.numel()], assign[b, :n], keep_len[b] = kept, target, kept.numel()
                p = (n - f) + self.distance if self.distance <= 0 else self.distance
                fixed[b] = max(p, self.start)
            counts = torch.zeros(bsz, k, dtype=torch.long, device=dev).scatter_add_(
                1, assign.clamp(min=0), (assign >= 0).long()
            )
            expand = lambda t: t[:, None].expand(-1, heads, -1).contiguous()  # noqa: E731
            edits.append(LayerEdit(expand(index), keep_len, expand(assign), expand(counts)))
        cache.policy_state[STATE_P] = fixed
        return edits

    def after_decode(self, cache: KVCache, stats, ctx):
        fixed = cache.policy_state[STATE_P]
        # every layer at once: a step cuts one entry at P from each (layer, sample) over its budget
        lengths = cache.lengths()  # (L, B)
        over = (lengths.double() - cache.processed.double()[None] * self.budget + EPS).floor() >= 1
        drop = (over & (fixed[None] < lengths)).long()
        # the cuts and the fixed points on the host in one read back for every layer (the cache's
        # cut then reads nothing)
        host = torch.cat([fixed[None].to(drop), drop]).tolist()
        starts = host[0]
        return [CutEdit(fixed, d, (starts, f)) if any(f) else None for d, f in zip(drop, host[1:])]
