"""The selection code of the scoring policies as it was before they became scores (commit 840413e),
kept as a reference: each class below takes its fields, checks and statistics requests from today's
policy and overrides only the hooks that turned statistics into edits, with their old bodies.
``PRE_SCORE`` maps registry names to them (``test_kept_sets`` swaps them into the registry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.runtime.policies.allocators import STATE_FRACTIONS, PyramidAllocator, keep_counts, per_layer
from vlkv.runtime.policies.base import (
    CutEdit,
    LayerEdit,
    per_kv_head,
    recent_mask,
    sink_mask,
    valid_slots,
)
from vlkv.runtime.policies.h2o import SCORE, H2OPolicy
from vlkv.runtime.policies.kvzip import KVzipPolicy
from vlkv.runtime.policies.local import LocalPolicy
from vlkv.runtime.policies.pyramid import PyramidKVPolicy
from vlkv.runtime.policies.ranking import top_entries
from vlkv.runtime.policies.snapkv import SnapKVPolicy
from vlkv.runtime.policies.vlcache import VLCachePolicy, token_scores


def old_evict_to(cache, target: Tensor, score, force) -> list:
    """``base.evict_to`` before it became a wrapper of ``select_top``."""
    edits: list = [None] * len(cache.layers)
    lengths = cache.lengths()
    over = (lengths > target.to(lengths.device)[None, :]).any(1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (row, o) in enumerate(zip(lengths.tolist(), over)):
        if o:
            groups.setdefault(tuple(row), []).append(i)
    for row, members in groups.items():
        first = cache.layers[members[0]]
        width, b = max(row), len(row)
        keep = torch.minimum(target, first.lengths)
        scores = torch.cat([score(cache.layers[i], width) for i in members])
        g = len(members)
        valid, forced = valid_slots(first, width), force(first, width, keep)
        if g > 1:
            valid = valid.repeat(g, 1, 1)
            forced = None if forced is None else forced.repeat(g, 1, 1)
        index, keep_len = top_entries(scores, valid, keep.repeat(g), forced)
        for j, i in enumerate(members):
            edits[i] = LayerEdit(index[j * b : (j + 1) * b], keep_len[j * b : (j + 1) * b])
    return edits


@dataclass
class OldH2O(H2OPolicy):
    def _evict(self, cache, target):
        def recent(layer, width, keep):
            return recent_mask(
                layer.lengths, width, keep - torch.round(keep.double() * self.heavy_ratio).long()
            )

        return old_evict_to(cache, target, lambda layer, width: layer.scores[SCORE][:, :, :width], recent)

    def after_prefill(self, cache, stats, ctx):
        self.observe(cache, stats, ctx)
        return self._evict(cache, self.prompt_keep(ctx.prompt_lengths))

    def decode_edits(self, cache, ctx):
        return self._evict(cache, self.decode_target(cache))


def _old_snapkv(self, cache, stats, ctx):
    keep = self.prompt_keep(ctx.prompt_lengths)
    edits = []
    for layer, st in zip(cache.layers, stats):
        width = layer.max_length
        score = per_kv_head(st.colsum[:, :, :width], ctx.num_kv_heads)
        b, h, s = score.shape
        pooled = F.avg_pool1d(
            score.reshape(b * h, 1, s),
            self.kernel,
            stride=1,
            padding=self.kernel // 2,
            count_include_pad=False,
        ).reshape(b, h, s)
        window = torch.minimum(keep, torch.full_like(keep, self.window))
        index, keep_len = top_entries(
            pooled, valid_slots(layer, width), keep, force=recent_mask(layer.lengths, width, window)
        )
        edits.append(LayerEdit(index, keep_len))
    return edits


@dataclass
class OldSnapKV(SnapKVPolicy):
    after_prefill = _old_snapkv


@dataclass
class OldPyramidKV(PyramidKVPolicy):
    def after_prefill(self, cache, stats, ctx):
        allocator = PyramidAllocator(floor=self.floor, beta=self.beta)
        fr = allocator.fractions(self.budget, ctx.prompt_lengths, len(cache.layers))
        if self.fallback:
            deepest = torch.round(fr.min(0).values * ctx.prompt_lengths.double())
            fr[:, deepest < self.window] = float(self.budget)
        cache.policy_state[STATE_FRACTIONS] = fr
        return per_layer(_old_snapkv, self, fr, cache, stats, ctx)


@dataclass
class OldVLCache(VLCachePolicy):
    def after_prefill(self, cache, stats, ctx):
        fr = self.make_allocator().fractions(self.budget, ctx.prompt_lengths, len(cache.layers), stats)
        cache.policy_state[STATE_FRACTIONS] = fr
        edits: list = []
        for layer, st, keep in zip(cache.layers, stats, keep_counts(fr, ctx.prompt_lengths)):
            if bool((keep >= layer.lengths).all()):
                edits.append(None)
                continue
            width = layer.max_length
            score = token_scores(st.colsum[:, :, :width], ctx.num_kv_heads, self.heads)
            recent = torch.floor(keep.double() * self.recent_ratio).long()
            index, keep_len = top_entries(
                score, valid_slots(layer, width), keep, force=recent_mask(layer.lengths, width, recent)
            )
            edits.append(LayerEdit(index, keep_len))
        return edits


@dataclass
class OldLocal(LocalPolicy):
    def _keep(self, cache, target):
        lengths = cache.lengths()
        over = lengths - torch.minimum(target.to(lengths)[None, :], lengths)
        if not bool(over.any()):
            return [None] * len(cache.layers)
        start = torch.full_like(over[0], self.sinks)
        return [CutEdit(start, o) if any(f) else None for o, f in zip(over, over.tolist())]

    def after_prefill(self, cache, stats, ctx):
        return self._keep(cache, self.prompt_keep(ctx.prompt_lengths, min_keep=self.sinks + 1))

    def decode_edits(self, cache, ctx):
        return self._keep(cache, self.decode_target(cache, min_keep=self.sinks + 1))


@dataclass
class OldKVzip(KVzipPolicy):
    def after_prefill(self, cache, stats, ctx):
        scores = getattr(stats, "replay", None)
        if self.budget >= 1.0 or scores is None:
            return None
        keep = self.prompt_keep(ctx.prompt_lengths, min_keep=self.sinks + 1)
        scores = [self._head_scores(s, cache.layers[i].max_length) for i, s in enumerate(scores)]
        if self.heads == "adaptive":
            return self._adaptive_edits(cache, scores, keep)
        layer_keep = self._layer_keep(cache, scores, keep) if self.scope == "model" else [keep] * len(scores)
        edits = []
        for layer, score, k in zip(cache.layers, scores, layer_keep):
            width = layer.max_length
            index, keep_len = top_entries(
                score, valid_slots(layer, width), k, force=sink_mask(layer.lengths, width, self.sinks)
            )
            edits.append(LayerEdit(index, keep_len))
        return edits

    def _head_scores(self, score, width):
        score = score[:, :, :width].float()
        return score.amax(1, keepdim=True).expand_as(score) if self.heads == "shared" else score

    def _ranked(self, layer, score):
        width = score.shape[2]
        valid = valid_slots(layer, width).expand_as(score)
        ranked = score.float().masked_fill(~valid, float("-inf"))
        return ranked.masked_fill(
            sink_mask(layer.lengths, width, self.sinks).expand_as(score) & valid, float("inf")
        )

    def _head_counts(self, cache, ranked, keep):
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
        lengths = torch.stack([layer.lengths for layer in cache.layers]).to(counts.device)
        return torch.minimum(counts.clamp(min=1), lengths[:, :, None])

    def _adaptive_edits(self, cache, scores, keep):
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

    def _layer_keep(self, cache, scores, keep):
        n_layers, b = len(scores), keep.shape[0]
        out = torch.zeros(n_layers, b, dtype=torch.long, device=keep.device)
        for s in range(b):
            flat, owner = [], []
            for i, (layer, score) in enumerate(zip(cache.layers, scores)):
                part = score[s, :, : int(layer.lengths[s])].clone()
                part[:, : self.sinks] = float("inf")
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
    count = torch.minimum(share.floor().long().clamp(min=low), high)
    for _ in range(abs(total - int(count.sum()))):
        diff = total - int(count.sum())
        gap = share - count
        if diff > 0:
            count[int(torch.argmax(gap.masked_fill(count >= high, float("-inf"))))] += 1
        elif diff < 0:
            count[int(torch.argmin(gap.masked_fill(count <= low, float("inf"))))] -= 1
    return count


@dataclass
class OldKVgrad(OldKVzip):
    chunk_size: int = 512

    name: ClassVar[str] = "kvgrad"
    gradient: ClassVar[bool] = True


PRE_SCORE = {
    "h2o": OldH2O,
    "snapkv": OldSnapKV,
    "pyramidkv": OldPyramidKV,
    "vlcache": OldVLCache,
    "local": OldLocal,
    "kvzip": OldKVzip,
    "kvgrad": OldKVgrad,
}
