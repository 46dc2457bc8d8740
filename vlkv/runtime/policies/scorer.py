"""Policies that are one score: :meth:`ScorePolicy.score` ranks a layer's entries, the shared
selection turns the ranking into edits (NVIDIA kvpress's ``ScorerPress`` is the anchor).

A scoring policy overrides :meth:`~ScorePolicy.score` and, where it needs them,
:meth:`~ScorePolicy.protect` (entries always kept: sinks, a recent window) and
:meth:`~vlkv.runtime.policies.base.Policy.observe` (running statistics, e.g. H2O's accumulated
attention). Everything else is shared and chosen by configuration:

* **top-k per KV head** with the protected entries counted in the budget (:func:`select_top`);
* **per-layer budgets**: :meth:`~ScorePolicy.layer_fractions` (a policy's own allocator: pyramidkv,
  vlcache) or ``allocator=NAME`` on any scoring policy (:class:`~.allocators.AllocatedPolicy`);
* **per-head budgets / model-wide ranking**: ``head_budgets() == "adaptive"`` and
  ``layer_scope() == "model"`` (:mod:`~vlkv.runtime.policies.budgets`, KVzip's);
* **when**: once after prefill, or also while decoding (``evicts_during_decode``) to
  :meth:`~vlkv.runtime.policies.base.Policy.decode_target` — every step, or every N steps with
  ``evict_every=N`` (:class:`~.cadence.Cadence`).

Kept entries keep their rotary phase (keys are stored post-RoPE); new tokens continue at
``positions`` (``original`` or ``compacted``), a :class:`~vlkv.runtime.policies.base.Policy` field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from vlkv.runtime.cache import KVCache, LayerKV
from vlkv.runtime.policies import budgets
from vlkv.runtime.policies.allocators import STATE_FRACTIONS, keep_counts
from vlkv.runtime.policies.base import LayerEdit, Policy, PolicyContext, select_top


@dataclass
class ScorePolicy(Policy):
    """A policy that is a score. Subclasses override :meth:`score` (and the hooks they need).

    ``stats_source``: where a layer's scoring input comes from in the step's
    :class:`~vlkv.runtime.backend.StepStats`: None = the layer's attention statistics
    (``stats[l]``), ``"replay"`` = the replay scores (``stats.replay[l]``, kvzip/kvgrad).
    """

    name: ClassVar[str] = "score"
    stats_source: ClassVar[str | None] = None

    # the one method ----------------------------------------------------------
    def score(self, layer: LayerKV, stats, ctx: PolicyContext) -> Tensor:
        """Scores of one layer's entries, higher = keep; ties go to the lower table column.

        Args:
            layer: the layer's cache (``lengths (B,)``; running scores in ``layer.scores``).
            stats: this layer's scoring input of the step (``stats_source``): an
                :class:`~vlkv.plugins.AttnStats` with ``colsum (B, H, S)`` float32 (``H`` query heads),
                or replay scores ``(B, H_kv, S)``; None for a decode-time eviction.
            ctx: batch facts (``num_heads``, ``num_kv_heads``, spans).

        Returns:
            ``(B, H_kv, W)`` float, ``W >= layer.max_length``: per sample, per KV head, per table
            column (the selection reads the first ``max_length`` columns; later ones are ignored).
        """
        raise NotImplementedError

    # optional hooks ----------------------------------------------------------
    def protect(self, layer: LayerKV, width: int, keep: Tensor) -> Tensor | None:
        """``(B, 1 or H_kv, width)`` bool entries always kept, counted within ``keep (B,)``; may depend
        on the layer only through ``layer.lengths``. None = nothing protected."""
        return None

    def min_keep(self) -> int:
        """Fewest entries a layer keeps per sample (what :meth:`protect` holds, plus one)."""
        return 1

    def layer_fractions(self, cache: KVCache, stats, ctx: PolicyContext) -> Tensor | None:
        """``(L, B)`` float64 kept fractions per layer (mean ``budget``), or None for ``budget`` everywhere."""
        return None

    def head_budgets(self) -> str:
        """``"own"``: every KV head of a layer keeps the same count; ``"adaptive"``: one ranking over the
        heads decides each head's count (the others' extra columns become holes)."""
        return "own"

    def layer_scope(self) -> str:
        """``"layer"``: each layer keeps its budget; ``"model"``: one ranking over every layer decides
        each layer's count (the sample's mean budget holds)."""
        return "layer"

    # the shared selection ----------------------------------------------------
    def after_prefill(self, cache, stats, ctx):
        self.observe(cache, stats, ctx)
        n = ctx.prompt_lengths
        fractions = self.layer_fractions(cache, stats, ctx)
        if fractions is None:
            keep = [self.prompt_keep(n, self.min_keep())] * len(cache.layers)
        else:
            cache.policy_state[STATE_FRACTIONS] = fractions
            keep = list(keep_counts(fractions, n, self.min_keep()))
        inputs = stats if self.stats_source is None else getattr(stats, self.stats_source)
        if not inputs:  # a score that reads only the cache (knorm) asks for no statistics
            inputs = [None] * len(cache.layers)
        return self.select(cache, inputs, ctx, keep)

    def decode_edits(self, cache, ctx):
        if not self.evicts_during_decode:
            return None
        target = self.decode_target(cache, self.min_keep())
        return self.select(cache, [None] * len(cache.layers), ctx, [target] * len(cache.layers))

    def select(
        self, cache: KVCache, inputs: list, ctx: PolicyContext, keep: list[Tensor]
    ) -> list[LayerEdit | None]:
        """Edits keeping, per layer ``l``, ``keep[l] (B,)`` entries per KV head by :meth:`score`
        (``inputs[l]`` its scoring input), the protected ones always; layers within budget get none."""
        layers = cache.layers
        if self.head_budgets() == "own" and self.layer_scope() == "layer":
            return select_top(
                cache,
                keep,
                lambda i, width: self.score(layers[i], inputs[i], ctx)[:, :, :width],
                self.protect,
            )
        scores = [self.score(layer, st, ctx)[:, :, : layer.max_length] for layer, st in zip(layers, inputs)]
        forced = [self.protect(layer, s.shape[2], k) for layer, s, k in zip(layers, scores, keep)]
        if self.head_budgets() == "adaptive":
            return budgets.adaptive_edits(cache, scores, forced, keep[0], self.layer_scope())
        per_layer = budgets.model_layer_keep(cache, scores, forced, keep[0], self.min_keep())
        return select_top(cache, per_layer, lambda i, width: scores[i], self.protect)
