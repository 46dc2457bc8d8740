"""Per-layer KV budgets, kept apart from scoring: *how many* entries each layer keeps after prefill.

An allocator turns the target kept fraction ``α`` (a policy's ``budget``) into per-layer,
per-sample fractions ``β (L, B)`` whose mean over layers is ``α``; a scoring policy then decides
*which* entries fill layer ``l``'s ``k = clamp(round(β_l · n), min_keep, n)`` slots, exactly as
:meth:`Policy.prompt_keep` rounds a uniform budget. See ``docs/policies-modality.md``.

* ``uniform``: ``β_l = α`` (what every policy does on its own).
* ``pyramid``: PyramidKV's linear depth decay, shallow layers ``(2 - 1/beta)·α`` down to ``α/beta``.
* ``sparsity``: VL-Cache Algorithm 1, shares proportional to each layer's post-vision attention
  density ``d_l = 1 - γ_l``, computed per sample from the prefill statistics.

Shares are clipped to ``[floor, 1]``; with ``redistribute`` (default) the clipped mass is handed
to the unclipped layers, in proportion to their weights, so the mean stays ``α`` (the paper clips
without redistributing; ``redistribute=False`` reproduces that).

:class:`AllocatedPolicy` composes any per-entry scoring policy with an allocator.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepStats
from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import LayerEdit, Policy, PolicyContext, check_range
from vlkv.runtime.prompt import Spans

STATE_FRACTIONS = "layer_fractions"  # cache.policy_state key: (L, B) float64 kept fractions
EXTRA = "allocator"  # name of the allocator's extra statistics request


# ------------------------------------------------------------ post-vision rows
def post_vision_rows(spans: Spans, n: int, fallback: int = 50) -> tuple[int, int]:
    """VL-Cache's post-vision query rows ``[start, n)`` of one prompt of ``n`` tokens.

    The language tokens after the *last* image; when the image is last, the last ``fallback``
    rows; with no image, every row (all text follows the — absent — image).
    """
    if not spans.image_spans:
        return 0, n
    v = spans.post_vision
    return (v, n) if v < n else (max(n - fallback, 0), n)


def post_vision_mask(ctx: PolicyContext, rows: int, fallback: int = 50) -> Tensor:
    """``(B, rows)`` bool, True on each sample's post-vision rows."""
    dev = ctx.prompt_lengths.device
    i = torch.arange(rows, device=dev)[None, :]
    bounds = [post_vision_rows(s, int(n), fallback) for s, n in zip(ctx.spans, ctx.prompt_lengths)]
    start = torch.tensor([b[0] for b in bounds], device=dev)[:, None]
    end = torch.tensor([b[1] for b in bounds], device=dev)[:, None]
    return (i >= start) & (i < end)


def layer_density(stats) -> Tensor:
    """VL-Cache Eq. 2 density ``d = 1 - mean_h γ_h`` per sample, ``(B,)`` float64, from one layer's
    :class:`~vlkv.plugins.AttnStats` (``below`` and ``visible`` are ``(B, H)``); rows with nothing
    visible count as dense."""
    visible = stats.visible.double()
    gamma = torch.where(visible > 0, stats.below.double() / visible.clamp(min=1), torch.zeros_like(visible))
    return 1.0 - gamma.mean(1)


# ------------------------------------------------------------ shares
def proportional_shares(
    weights: Tensor, target: float, low: float, high: float = 1.0, redistribute: bool = True
) -> Tensor:
    """Per-layer fractions proportional to ``weights (L, B)``, clipped to ``[low, high]``, mean ``target``.

    With ``redistribute`` the result is ``clip(λ_b · w, low, high)`` with ``λ_b`` found by bisection
    so that every column averages to ``target`` (feasible whenever ``low <= target <= high``; ``low``
    is lowered to ``target`` when it is above it). Without, ``λ_b = target·L / Σ w`` and the
    clipped column may average to something else, as in VL-Cache's Algorithm 1.
    Returns ``(L, B)`` float64. Columns whose weights are all zero get ``target`` everywhere.
    """
    w = weights.double().clamp(min=0)
    num_layers = w.shape[0]
    low = min(low, target)
    flat = w.sum(0, keepdim=True) <= 0
    w = torch.where(flat, torch.ones_like(w), w)
    if not redistribute:
        return (target * num_layers * w / w.sum(0, keepdim=True)).clamp(low, high)
    lo = torch.zeros(1, w.shape[1], dtype=torch.float64, device=w.device)
    hi = torch.full_like(lo, high) / w.masked_fill(w <= 0, float("inf")).amin(0, keepdim=True)
    for _ in range(100):  # f(λ) = mean clip(λ w) is monotone; 100 halvings reach float64 precision
        mid = (lo + hi) / 2
        below = (mid * w).clamp(low, high).mean(0, keepdim=True) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (hi * w).clamp(low, high)


@dataclass
class Allocator:
    """Uniform allocation; subclasses override :meth:`weights` (and :meth:`request` for statistics).

    Attributes:
        floor: smallest per-layer fraction, in (0, 1] (VL-Cache clips at 0.01).
        redistribute: hand clipped mass to the other layers so the mean stays the target.
    """

    floor: float = 0.01
    redistribute: bool = True

    name: ClassVar[str] = "uniform"

    def __post_init__(self) -> None:
        check_range("floor", self.floor, 0.0, 1.0)

    def request(self, ctx: PolicyContext, rows: int) -> StatsRequest | None:
        """Prefill statistics the allocator needs (None = none)."""
        return None

    def weights(self, num_layers: int, batch: int, stats: list | None, device=None) -> Tensor:
        """``(L, B)`` non-negative layer weights (on ``device``)."""
        return torch.ones(num_layers, batch, dtype=torch.float64, device=device)

    def fractions(
        self, budget: float, prompt_lengths: Tensor, num_layers: int, stats: list | None = None
    ) -> Tensor:
        """``(L, B)`` float64 kept fractions averaging ``budget`` over layers, per sample."""
        b, dev = prompt_lengths.shape[0], prompt_lengths.device
        if self.name == "uniform" or budget >= 1.0:  # exact α everywhere, as prompt_keep rounds it
            return torch.full((num_layers, b), float(budget), dtype=torch.float64, device=dev)
        weights = self.weights(num_layers, b, stats, device=dev).to(dev)
        return proportional_shares(weights, budget, self.floor, 1.0, self.redistribute)


def keep_counts(fractions: Tensor, prompt_lengths: Tensor, min_keep: int = 1) -> Tensor:
    """``(L, B)`` int64 entries kept per layer: ``clamp(round(β · n), min_keep, n)``."""
    n = prompt_lengths.to(torch.long)[None, :]
    k = torch.round(n.double() * fractions).long()
    return torch.minimum(k.clamp(min=min_keep), n)


@dataclass
class PyramidAllocator(Allocator):
    """PyramidKV: fractions fall linearly with depth from ``(2 - 1/beta)·α`` to ``α/beta``.

    Attributes:
        beta: ratio of the mean to the deepest layer's share, > 1 (PyramidKV's default 20).
    """

    beta: float = 20.0

    name: ClassVar[str] = "pyramid"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 1.0:
            raise ValueError(f"beta must be > 1, got {self.beta}")

    def weights(self, num_layers, batch, stats, device=None):
        top, bottom = 2.0 - 1.0 / self.beta, 1.0 / self.beta
        depth = (
            torch.linspace(0.0, 1.0, num_layers, dtype=torch.float64, device=device)
            if num_layers > 1
            else torch.zeros(1, device=device)
        )
        return (top - (top - bottom) * depth.double())[:, None].expand(num_layers, batch).clone()


@dataclass
class SparsityAllocator(Allocator):
    """VL-Cache Algorithm 1: shares proportional to post-vision attention density, per sample.

    Attributes:
        threshold: relative threshold ``p`` of Eq. 1 (an entry is pruned below ``p × row max``), in (0, 1).
        fallback_rows: post-vision rows used when an image ends the prompt, >= 1.
    """

    threshold: float = 0.01
    fallback_rows: int = 50

    name: ClassVar[str] = "sparsity"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold (VL-Cache's p) must be in (0, 1), got {self.threshold}")
        if self.fallback_rows < 1:
            raise ValueError(f"fallback_rows must be >= 1, got {self.fallback_rows}")

    def request(self, ctx, rows):
        return StatsRequest(rows=post_vision_mask(ctx, rows, self.fallback_rows), threshold=self.threshold)

    def weights(self, num_layers, batch, stats, device=None):
        if stats is None or any(st is None or st.below is None for st in stats):
            raise ValueError(
                "the sparsity allocator needs thresholded post-vision statistics for every layer"
            )
        return torch.stack([layer_density(st) for st in stats])


ALLOCATORS: dict[str, type[Allocator]] = {
    "uniform": Allocator,
    "pyramid": PyramidAllocator,
    "sparsity": SparsityAllocator,
}


def make_allocator(name: str, **kwargs) -> Allocator:
    """Build an allocator by name; unknown names or settings raise ``ValueError`` naming them."""
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; known allocators: {', '.join(ALLOCATORS)}")
    cls = ALLOCATORS[name]
    known = {f.name for f in cls.__dataclass_fields__.values()}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)} for allocator {name!r}; known: {', '.join(sorted(known))}"
        )
    return cls(**kwargs)


# ------------------------------------------------------------ composition
Hook = Callable[[Policy, KVCache, list, PolicyContext], "list[LayerEdit | None] | None"]


def per_layer(
    hook: Hook, policy: Policy, fractions: Tensor, cache: KVCache, stats: list, ctx: PolicyContext
) -> list:
    """Run a scoring policy's hook layer by layer, each with its own per-sample budget.

    For layer ``l`` the hook sees a one-layer view of the cache, that layer's statistics, and a
    shallow copy of ``policy`` whose ``budget`` is the ``(B,)`` float64 tensor ``fractions[l]``:
    :meth:`Policy.prompt_keep` and :meth:`Policy.decode_target` broadcast it per sample, so any
    policy that sizes layers through them gets per-layer, per-sample budgets unchanged.
    """
    extra = getattr(stats, "extra", {})
    edits: list[LayerEdit | None] = []
    for i, layer in enumerate(cache.layers):
        view = KVCache(
            [layer], cache.next_position, cache.prompt_lengths, cache.processed, cache.policy_state
        )
        clone = copy.copy(policy)
        clone.budget = fractions[i]  # a (B,) tensor: skips __post_init__'s scalar range check on purpose
        sub = StepStats([stats[i] if stats else None], {name: [v[i]] for name, v in extra.items()})
        out = hook(clone, view, sub, ctx)
        edits.append(out[0] if out else None)
    return edits


# scorers whose layer sizes do not come from prompt_keep / decode_target
NOT_COMPOSABLE = {
    "elastic": "it merges with one fixed point shared by all layers",
    "vlcache": "it has its own allocator field",
    "avl": "its per-layer sizes come from its vision and text fractions",
    "pyramidkv": "it is snapkv with the pyramid allocator already",
}


@dataclass
class AllocatedPolicy(Policy):
    """A per-entry scoring policy whose per-layer budgets come from an :class:`Allocator`.

    ``budget`` and ``positions`` are the scorer's. Budgets hold through decoding too: a scorer that
    evicts while decoding keeps layer ``l`` at ``round(β_l · N)`` of the ``N`` processed tokens.

    Attributes:
        scorer: the policy that ranks entries (``snapkv``, ``h2o``, ``local`` …).
        allocator: the per-layer budget rule.
    """

    scorer: Policy = field(default_factory=Policy)
    allocator: Allocator = field(default_factory=Allocator)

    name: ClassVar[str] = "allocated"

    def __post_init__(self) -> None:
        if self.scorer.name in NOT_COMPOSABLE or isinstance(self.scorer, AllocatedPolicy):
            reason = NOT_COMPOSABLE.get(self.scorer.name, "it is already allocated")
            raise ValueError(f"allocator cannot be combined with policy {self.scorer.name!r}: {reason}")
        self.budget, self.positions = self.scorer.budget, self.scorer.positions
        super().__post_init__()
        # instance attributes shadow the class-level ones the engine and reports read
        self.name = f"{self.scorer.name}+{self.allocator.name}"
        self.evicts_during_decode = self.scorer.evicts_during_decode

    def prefill_request(self, ctx, rows):
        req = self.scorer.prefill_request(ctx, rows)
        extra = self.allocator.request(ctx, rows)
        if extra is None:
            return req
        base = req if req is not None else StatsRequest(layers=frozenset())
        return replace(base, extra={**base.extra, EXTRA: extra})

    def decode_request(self, cache, ctx):
        return self.scorer.decode_request(cache, ctx)

    def after_prefill(self, cache, stats, ctx):
        extra = getattr(stats, "extra", {}).get(EXTRA)
        fr = self.allocator.fractions(self.budget, ctx.prompt_lengths, len(cache.layers), extra)
        cache.policy_state[STATE_FRACTIONS] = fr
        return per_layer(type(self.scorer).after_prefill, self.scorer, fr, cache, stats, ctx)

    def after_decode(self, cache, stats, ctx):
        fr = cache.policy_state[STATE_FRACTIONS]
        return per_layer(type(self.scorer).after_decode, self.scorer, fr, cache, stats, ctx)

    @property
    def can_defer_edits(self) -> bool:  # type: ignore[override]
        return self.scorer.can_defer_edits

    def observe(self, cache, stats, ctx):
        def hook(policy, view, sub, c):
            type(policy).observe(policy, view, sub, c)

        per_layer(hook, self.scorer, cache.policy_state[STATE_FRACTIONS], cache, stats, ctx)
