"""``kvzip`` (KVzip, arXiv 2505.23416): keep the entries the model needs to *reconstruct* its context.

After prefill the backend replays "Repeat the previous context:" + the context over the cache
(:mod:`vlkv.runtime.replay`); an entry's score is the largest attention any replay row pays it, per
KV head (max over the GQA group). The scores do not depend on any later question, so a cache
compressed once serves every later question (query-agnostic).

Budgets follow ``docs/policies.md``; how they are spread:

* ``heads="adaptive"`` (the default, KVzip's non-uniform head budgets): the ranking also decides
  how many entries each KV head keeps — over layers × heads × entries with ``scope="model"`` (the
  default), over heads × entries within each layer with ``scope="layer"``. A layer's table is as
  wide as its fullest head; the other heads' extra columns become *holes* (their slots are freed
  and never attended, see :class:`~vlkv.runtime.cache.LayerKV`), so the K/V bytes held are exactly
  the picked entries'. Every head keeps at least one entry. On real text it beats ``heads="own"``
  at every budget (docs/policies.md).
* ``heads="own"``: every KV head of a layer keeps the same number of entries, each head its own
  best ones. With ``scope="model"`` one ranking over every layer × KV head × entry of a sample picks
  the ``L · H_kv · k_b`` best and each layer keeps its share of them (non-uniform layer budgets, mean
  ``k_b``); with ``scope="layer"`` every layer keeps ``k_b`` per KV head.
* ``heads="shared"`` (the head-level variant): the KV heads of a layer keep one common set, ranked
  by their max score: one index per layer instead of one per head.

``sinks`` first entries are always kept. At ``budget = 1`` nothing is replayed or evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies.base import LayerEdit, Policy, sink_mask, top_entries, valid_slots
from vlkv.runtime.replay import DEFAULT_TEMPLATE, REPLAY_MODES, ReplayRequest
from vlkv.runtime.replay_dtype import REPLAY_DTYPES

SCOPES = ("model", "layer")
HEADS = ("own", "shared", "adaptive")


@dataclass
class KVzipPolicy(Policy):
    """Attributes:
    chunk_size: context tokens per replay chunk, >= 1 (memory O(chunk_size × context)).
    sinks: first entries always kept, >= 0.
    scope: ``"model"`` (non-uniform layer budgets from one ranking) or ``"layer"``.
    heads: ``"own"`` (each KV head its own entries, equal counts), ``"shared"`` (head-level: one set
        per layer) or ``"adaptive"`` (each KV head its own entries *and* its own count).
    every: replay every ``every``-th chunk only, >= 1 (cheaper scoring).
    template: the text replayed before each chunk.
    mode: ``"context"`` (template + context) or ``"prompt"`` (the template alone, e.g. a generic
        image description prompt).
    value_norm: also weight each (query head, entry) score by ``||W_O,h v||`` (KVgrad's input factor,
        no backward pass; KVgrad always has it).
    exact: score with the replay's reference pass (a second softmax per layer) instead of the fast
        one (scores from the attention kernel's own row statistics); same ranking, slower.
    replay_dtype: the replay's compute dtype, ``"model"`` or ``"bfloat16"``/``"float16"``/``"float32"``
        (cheaper scoring on CPUs with bf16 units; an approximation, see ``vlkv/runtime/replay_dtype.py``).
    grad_layers: KVgrad only: backward through the top ``grad_layers`` layers (-1 = all, exact).
    """

    chunk_size: int = 2048
    sinks: int = 4
    scope: str = "model"
    heads: str = "adaptive"
    every: int = 1
    template: str = DEFAULT_TEMPLATE
    mode: str = "context"
    exact: bool = False
    value_norm: bool = False
    replay_dtype: str = "model"
    grad_layers: int = -1

    name: ClassVar[str] = "kvzip"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("sinks",)
    gradient: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"mode must be one of {REPLAY_MODES}, got {self.mode!r}")
        if self.replay_dtype != "model" and self.replay_dtype not in REPLAY_DTYPES:
            raise ValueError(
                f"replay_dtype must be 'model' or one of {tuple(REPLAY_DTYPES)}, got {self.replay_dtype!r}"
            )
        if self.grad_layers < -1:
            raise ValueError(f"grad_layers must be >= -1 (-1 = all layers), got {self.grad_layers}")
        if self.mode == "prompt" and not self.template.strip():
            raise ValueError("template must not be empty with mode='prompt'")

    def replay_request(self, ctx) -> ReplayRequest | None:
        if self.budget >= 1.0:
            return None
        return ReplayRequest(
            self.template,
            self.chunk_size,
            self.gradient,
            self.mode,
            self.every,
            self.exact,
            self.value_norm,
            self.replay_dtype,
            self.grad_layers,
        )

    def after_prefill(self, cache, stats, ctx):
        scores = getattr(stats, "replay", None)
        if self.budget >= 1.0 or scores is None:
            return None
        n = ctx.prompt_lengths
        keep = self.prompt_keep(n, min_keep=self.sinks + 1)
        scores = [self._head_scores(s, cache.layers[i].max_length) for i, s in enumerate(scores)]
        if self.heads == "adaptive":
            return self._adaptive_edits(cache, scores, keep)
        per_layer = self._layer_keep(cache, scores, keep) if self.scope == "model" else [keep] * len(scores)
        edits = []
        for layer, score, k in zip(cache.layers, scores, per_layer):
            width = layer.max_length
            index, keep_len = top_entries(
                score, valid_slots(layer, width), k, force=sink_mask(layer.lengths, width, self.sinks)
            )
            edits.append(LayerEdit(index, keep_len))
        return edits

    def _head_scores(self, score: Tensor, width: int) -> Tensor:
        """``(B, H_kv, S)`` → ``(B, H_kv, width)`` float32, shared over heads for ``heads="shared"``."""
        score = score[:, :, :width].float()
        if self.heads == "shared":
            score = score.amax(1, keepdim=True).expand_as(score)
        return score

    def _ranked(self, layer, score: Tensor) -> Tensor:
        """``(B, H_kv, width)`` float32: ``score`` with invalid slots -inf and sinks +inf."""
        width = score.shape[2]
        valid = valid_slots(layer, width).expand_as(score)
        ranked = score.float().masked_fill(~valid, float("-inf"))
        return ranked.masked_fill(
            sink_mask(layer.lengths, width, self.sinks).expand_as(score) & valid, float("inf")
        )

    def _head_counts(self, cache: KVCache, ranked: list[Tensor], keep: Tensor) -> Tensor:
        """``(L, B, H_kv)`` int64 entries each (layer, sample, head) keeps: its picks in one ranking
        of ``H_kv · k_b`` entries per layer (over every layer with ``scope="model"``, each layer
        alone with ``scope="layer"``), at least one per head."""
        n_layers, (b, heads, _) = len(ranked), ranked[0].shape
        counts = torch.zeros(n_layers, b, heads, dtype=torch.long, device=keep.device)
        groups = [list(range(n_layers))] if self.scope == "model" else [[i] for i in range(n_layers)]
        for s in range(b):
            for group in groups:
                parts = [ranked[i][s, :, : int(cache.layers[i].lengths[s])] for i in group]
                flat = torch.cat([p.reshape(-1) for p in parts])
                owner = torch.cat(
                    [
                        (j * heads + torch.arange(heads, device=p.device))[:, None].expand_as(p).reshape(-1)
                        for j, p in enumerate(parts)
                    ]
                )
                total = min(int(keep[s]) * heads * len(group), flat.numel())
                picked = owner[torch.sort(flat, descending=True, stable=True).indices[:total]]
                got = torch.bincount(picked, minlength=heads * len(group)).view(len(group), heads)
                counts[group, s] = got.to(counts.device)
        lengths = torch.stack([layer.lengths for layer in cache.layers]).to(counts.device)  # (L, B)
        return torch.minimum(counts.clamp(min=1), lengths[:, :, None])

    def _adaptive_edits(self, cache: KVCache, scores: list[Tensor], keep: Tensor) -> list[LayerEdit]:
        """Per-head budgets: each layer keeps, per head, its top ``width`` entries (``width`` = the
        fullest head's count) and marks the ones past the head's own count as holes."""
        ranked = [self._ranked(layer, score) for layer, score in zip(cache.layers, scores)]
        counts = self._head_counts(cache, ranked, keep)
        edits = []
        for layer, score, rank_in, count in zip(cache.layers, scores, ranked, counts):
            width = score.shape[2]
            index, keep_len = top_entries(
                score,
                valid_slots(layer, width),
                count.amax(1),
                force=sink_mask(layer.lengths, width, self.sinks),
            )
            order = torch.sort(rank_in, dim=-1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(
                2, order, torch.arange(width, device=order.device).expand_as(order)
            )
            holes = rank.gather(2, index) >= count.to(rank.device)[:, :, None]
            edits.append(LayerEdit(index, keep_len, holes=holes))
        return edits

    def _layer_keep(self, cache: KVCache, scores: list[Tensor], keep: Tensor) -> list[Tensor]:
        """Per layer ``(B,)`` entries per KV head: each layer's share of one model-wide ranking.

        Sample ``b`` keeps ``L · k_b`` entries per head in all; a layer's count is its number of
        (head, entry) picks in the top ``L · H_kv · k_b`` of all layers, divided by ``H_kv``, rounded,
        then the rounding error is settled on the layers closest to the next integer.
        """
        n_layers = len(scores)
        b = keep.shape[0]
        out = torch.zeros(n_layers, b, dtype=torch.long, device=keep.device)
        for s in range(b):
            flat, owner = [], []
            for i, (layer, score) in enumerate(zip(cache.layers, scores)):
                n_s = int(layer.lengths[s])
                part = score[s, :, :n_s].clone()
                part[:, : self.sinks] = float("inf")  # sinks are kept wherever they are
                flat.append(part.reshape(-1))
                owner.append(torch.full((part.numel(),), i, dtype=torch.long, device=part.device))
            flat_t, owner_t = torch.cat(flat), torch.cat(owner)
            heads = scores[0].shape[1]
            total = min(int(keep[s]) * n_layers * heads, flat_t.numel())
            picked = owner_t[torch.sort(flat_t, descending=True, stable=True).indices[:total]]
            share = torch.bincount(picked, minlength=n_layers).double() / heads
            lengths = torch.tensor([int(layer.lengths[s]) for layer in cache.layers], device=share.device)
            out[:, s] = _round_shares(
                share, int(keep[s]) * n_layers, min(self.sinks + 1, int(keep[s])), lengths
            )
        return list(out)


def _round_shares(share: Tensor, total: int, low: int, high: Tensor) -> Tensor:
    """Integer per-layer counts summing to ``total``, each in ``[low, high[l]]``, closest to ``share (L,)``
    (largest remainders first)."""
    count = torch.minimum(share.floor().long().clamp(min=low), high)
    for _ in range(abs(total - int(count.sum()))):
        diff = total - int(count.sum())
        gap = share - count
        if diff > 0:
            count[int(torch.argmax(gap.masked_fill(count >= high, float("-inf"))))] += 1
        elif diff < 0:
            count[int(torch.argmin(gap.masked_fill(count <= low, float("inf"))))] -= 1
    return count
