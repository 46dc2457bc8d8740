"""A-VL's decode and prefill hooks as they were before their checks were read once for every layer
(session 5, issue #28): one read back per layer for the text budget, one per layer for the edit, one
ranking per layer for the core refresh, one read back per layer for a core-only step's read. The
reference the fused hooks are tested against (``tests/runtime/policies/test_step_cost.py``,
``test_avl_state.py``) and measured against (``scripts/bench_step_cost.py``); in the package so that
neither the script nor the tests import the other's tree. Not a registered policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.backend import AttendIndex
from vlkv.runtime.policies.avl import (
    CORE,
    LAST,
    REGION,
    STATE_CORE,
    STATE_ROWS,
    TEXT,
    TEXT_SCORE,
    VISION,
    AVLPolicy,
    _store,
    count,
    mask_to_index,
    top_mask,
)
from vlkv.runtime.policies.base import LayerEdit, per_kv_head, recent_mask, valid_slots


@dataclass
class PerLayerAVL(AVLPolicy):
    """Today's A-VL with the per-layer hooks of commit e2c8b6c."""

    def after_prefill(self, cache, stats, ctx):
        bounds = self.bounds(ctx)
        n_img = bounds[:, 1] - bounds[:, 0]
        s_count = count(self.secondary_share, n_img)
        cache.policy_state[STATE_CORE] = count(self.core_share, n_img)
        rows = cache.policy_state.pop(STATE_ROWS, None)
        edits = []
        for i, (layer, st) in enumerate(zip(cache.layers, stats)):
            width, b, h = layer.max_length, layer.batch, layer.kv_heads
            tok = torch.arange(width, device=layer.lengths.device)[None, :].expand(b, width)
            if rows is not None and i >= self.filter_layer:
                tok = mask_to_index(rows[:, None])[0][:, 0, :width]
            region = self.regions(tok, bounds)
            valid = valid_slots(layer, width)[:, 0]
            _store(layer, REGION, region[:, None].expand(b, h, width).float())
            _store(layer, TEXT_SCORE, per_kv_head(st.colsum[:, :, :width], h) * (region == TEXT)[:, None])
            last = stats.extra[LAST][i].colsum[:, :, :width].mean(1)
            vision = (region == VISION) & valid
            secondary = top_mask(last[:, None], vision[:, None], s_count)
            if self.tracks_core:  # a core as large as the secondary set keeps no flags
                core = top_mask(last[:, None], secondary, cache.policy_state[STATE_CORE])
                _store(layer, CORE, core.expand(b, h, width).float())
            keep = (valid & ~vision)[:, None] | secondary
            edits.append(_edit(layer, keep & self._text_keep(layer, cache, bounds)))
        return edits

    def after_decode(self, cache, stats, ctx):
        bounds = self.bounds(ctx)
        edits = []
        for layer, st in zip(cache.layers, stats):
            width, h = layer.max_length, layer.kv_heads
            region = layer.scores[REGION][:, :, :width]
            colsum = st.colsum[:, :, :width]
            layer.scores[TEXT_SCORE][:, :, :width] += per_kv_head(colsum, h) * (region == TEXT)
            if self.update_step(ctx.step) and self.tracks_core:
                vision = (region[:, :1] == VISION) & valid_slots(layer, width)
                core = top_mask(colsum.mean(1, keepdim=True), vision, cache.policy_state[STATE_CORE])
                layer.scores[CORE][:, :, :width] = core.expand(-1, h, -1).float()
            edits.append(_edit(layer, self._text_keep(layer, cache, bounds)))
        return edits

    def decode_attend(self, cache, ctx):
        if self.interval < 0 or self.update_step(ctx.step) or self.core_share >= self.secondary_share:
            return None
        plans = []
        for layer in cache.layers:
            width = layer.max_length
            valid = valid_slots(layer, width)
            idle = (layer.scores[REGION][:, :, :width] == VISION) & (layer.scores[CORE][:, :, :width] == 0)
            used = valid & ~idle
            plans.append(None if bool((used == valid).all()) else AttendIndex(*mask_to_index(used)))
        return plans if any(p is not None for p in plans) else None

    def _text_keep(self, layer, cache, bounds: Tensor) -> Tensor:
        width = layer.max_length
        text = (layer.scores[REGION][:, :, :width] == TEXT) & valid_slots(layer, width)
        held = text[:, 0].sum(-1)
        seen = cache.processed - bounds[:, 1].to(cache.processed)
        rank = torch.round(seen.double() * self.text_share).long().clamp(min=self.text_min)
        keep = torch.minimum(rank, held)
        host = torch.cat([(held <= rank).all().long()[None], keep.to(held.device)]).tolist()
        if host[0]:
            return torch.ones_like(text)
        recent = recent_mask(
            layer.lengths, width, keep - torch.round(keep.double() * self.heavy_ratio).long()
        )
        score = layer.scores[TEXT_SCORE][:, :, :width]
        return ~text | top_mask(score, text, keep, force=recent & text, kept=host[1:])


def _edit(layer, keep: Tensor) -> LayerEdit | None:
    valid = valid_slots(layer, keep.shape[-1])
    keep = keep & valid
    counts = keep.sum(-1)
    checks = [(keep == valid).all().long(), counts.max(), (counts == counts[:, :1]).all().long()]
    everything, width, agree = torch.stack(checks).tolist()
    if everything:
        return None
    if not agree:
        raise RuntimeError("avl selected different numbers of entries per KV head")
    index, counts = mask_to_index(keep, width)
    return LayerEdit(index, counts[:, 0])
