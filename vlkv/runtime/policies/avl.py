"""``avl`` (A-VL, Zhang et al. AAAI 2025): vision entries split core ⊂ secondary ⊂ all, decode
computes over the core only and refreshes it every ``interval`` steps; text after the image is
managed H2O-style. See ``methods.md`` §3 and ``docs/policies-modality.md``.

Every prompt splits into system ``[0, first image)``, vision ``[first image, post_vision)`` (inter-
image text included, as in the reference code) and text ``[post_vision, n)`` plus generated tokens.
Each entry's region, core flag and accumulated text score live in ``LayerKV.scores`` so they move
with the entry through every edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.backend import AttendIndex, RowFilter, StatsRequest, StepStats
from vlkv.runtime.cache import KVCache, LayerKV
from vlkv.runtime.kv import score_ops
from vlkv.runtime.policies.avl_text import TEXT_SCORE, text_evictions
from vlkv.runtime.policies.base import (
    LayerEdit,
    Policy,
    check_range,
    per_kv_head,
    recent_mask,
    valid_slots,
)
from vlkv.runtime.policies.ranking import top_entries

REGION, CORE = "avl_region", "avl_core"  # per-entry scores (and avl_text.TEXT_SCORE)
TEXT, VISION, SYSTEM = 0, 1, 2  # region codes; appended (generated) entries start at 0 = text
LAST = "avl_last"  # extra stats request: the last prompt row
STATE_ROWS, STATE_CORE = "avl_filter_rows", "avl_core_count"


def count(fraction: float, n: Tensor) -> Tensor:
    """``int(fraction · n)`` as the reference code sizes sets (the epsilon absorbs float error)."""
    return torch.floor(n.double() * fraction + 1e-9).long()


def top_mask(
    score: Tensor, valid: Tensor, keep: Tensor, force: Tensor | None = None, kept: list[int] | None = None
) -> Tensor:
    """``(B, h, S)`` bool: the ``keep[b]`` best valid slots of each (sample, head), see ``top_entries``
    (``kept``: ``keep`` clamped to the valid count, on the host, when the caller read it)."""
    index, keep_len = top_entries(score, valid, keep.to(score.device), force, kept)
    ok = torch.arange(index.shape[-1], device=score.device)[None, None, :] < keep_len[:, None, None]
    hits = torch.zeros(score.shape, dtype=torch.long, device=score.device)
    hits.scatter_add_(2, index, ok.long().expand_as(index))
    return hits > 0


def mask_to_index(
    mask: Tensor, width: int | None = None, counts: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(..., h, S)`` bool → ascending slots ``(..., h, K)`` (padded with 0) and counts ``(..., h)``;
    ``width``: the largest count when the caller read it already (else read here); ``counts``:
    ``mask.sum(-1)`` where the caller holds it."""
    counts = mask.sum(-1) if counts is None else counts
    s = mask.shape[-1]
    slots = torch.where(mask, torch.arange(s, device=mask.device), s)
    index = torch.sort(slots, dim=-1).values[..., : max(int(counts.max()) if width is None else width, 1)]
    return index.masked_fill(index == s, 0), counts


@dataclass
class AVLPolicy(Policy):
    """A-VL's adaptive attention. Fractions default from ``budget``: ``secondary = text = budget``,
    ``core = secondary`` (no core-only decoding unless ``core`` is set, so budget 1 is exact).

    Attributes:
        secondary: S, share of the ``N_img`` vision tokens kept after prefill, in (0, 1].
        core: C, share of ``N_img`` decode computes over, in (0, secondary].
        interval: K; step ``t`` with ``t % K == 0`` attends to every secondary entry and refreshes the
            core as the top ``int(C·N_img)`` by that step's head-mean attention; other steps compute
            over system + core + text + the new token. -1 = never restrict to the core. 0 is invalid.
        text: T, text cache kept: ``max(round(T · n_text), text_min)`` entries, ``n_text`` = text tokens
            processed so far; in (0, 1].
        text_min: floor of the text budget (``text_init_cache``), >= 0.
        heavy_ratio: heavy-hitter share of the text budget (the rest is recent), in [0, 1].
        prefill_keep: P, share of vision hidden states kept after layer ``filter_layer`` during prefill
            (FastV-like, original positions kept), in (0, 1]; 1 = off.
        filter_layer: number of leading layers that see every vision token, >= 1.
    """

    secondary: float | None = None
    core: float | None = None
    interval: int = 3
    text: float | None = None
    text_min: int = 20
    heavy_ratio: float = 0.5
    prefill_keep: float = 1.0
    filter_layer: int = 2

    name: ClassVar[str] = "avl"
    evicts_during_decode: ClassVar[bool] = True
    # the decode hook batches over requests at the same step (``policies.cohort``): the core refresh
    # reads the step; the regions are only read
    cohort_decode: ClassVar[str | None] = "same_step"
    cohort_state: ClassVar[dict[str, int]] = {STATE_CORE: 0}
    cohort_readonly: ClassVar[frozenset[str]] = frozenset({REGION})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions != "original":
            raise ValueError(f"positions must be 'original' for policy 'avl', got {self.positions!r}")
        for name in ("secondary", "core", "text"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), 0.0, 1.0)
        if self.core_share > self.secondary_share:
            raise ValueError(
                f"core must be <= secondary (core tokens are a subset of the secondary ones), "
                f"got core={self.core_share} > secondary={self.secondary_share}"
            )
        if self.interval == 0 or self.interval < -1:
            raise ValueError(f"interval must be -1 (never restrict to the core) or >= 1, got {self.interval}")
        if self.text_min < 0:
            raise ValueError(f"text_min must be >= 0, got {self.text_min}")
        check_range("heavy_ratio", self.heavy_ratio, 0.0, 1.0, low_open=False)
        check_range("prefill_keep", self.prefill_keep, 0.0, 1.0)
        if self.filter_layer < 1:
            raise ValueError(f"filter_layer must be >= 1, got {self.filter_layer}")

    @property
    def secondary_share(self) -> float:
        return self.budget if self.secondary is None else self.secondary

    @property
    def core_share(self) -> float:
        return self.secondary_share if self.core is None else self.core

    @property
    def tracks_core(self) -> bool:
        """Whether the core is a strict subset of the secondary set, so its flags are kept (a ``CORE``
        score table) and refreshed. A core as large as the secondary set is every vision entry a layer
        holds: no table (nothing to rank at the prefill or refresh, no column zeroed per append)."""
        return self.core_share < self.secondary_share

    @property
    def text_share(self) -> float:
        return self.budget if self.text is None else self.text

    # ------------------------------------------------------------ prefill
    @staticmethod
    def bounds(ctx) -> Tensor:
        """``(B, 2)`` int64 ``(first image, post_vision)``; ``(0, 0)`` without images (all text)."""
        rows = [[s.first_image or 0, s.post_vision] for s in ctx.spans]
        return torch.tensor(rows, dtype=torch.long, device=ctx.prompt_lengths.device)

    @staticmethod
    def regions(tok: Tensor, bounds: Tensor) -> Tensor:
        """Region codes ``(B, S)`` of token indices ``tok (B, S)``."""
        first, v = bounds[:, :1].to(tok.device), bounds[:, 1:].to(tok.device)
        return torch.where(tok < first, SYSTEM, torch.where(tok < v, VISION, TEXT))

    def prefill_request(self, ctx, rows):
        bounds, n = self.bounds(ctx), ctx.prompt_lengths[:, None]
        i = torch.arange(rows, device=n.device)[None, :]
        text_rows = (i >= bounds[:, 1:]) & (i < n)  # H2O scores: post-image text rows
        return StatsRequest(rows=text_rows, extra={LAST: StatsRequest(rows=i == n - 1)})

    def prefill_filter(self, cache: KVCache, ctx) -> RowFilter | None:
        """Engine hook: the prefill row filter P, or None when off."""
        if self.prefill_keep >= 1.0 or self.filter_layer >= len(cache.layers):
            return None
        bounds = self.bounds(ctx)
        keep_n = count(self.prefill_keep, bounds[:, 1] - bounds[:, 0])
        last_row = ctx.prompt_lengths[:, None] - 1

        def choose(stats: StepStats, layer: int) -> Tensor:
            score = stats.extra[LAST][layer].colsum.mean(1)  # (B, q): the last row's head mean
            tok = torch.arange(score.shape[-1], device=score.device)[None, :].expand_as(score)
            vision = self.regions(tok, bounds) == VISION
            # the backend always keeps the last row (it gives the logits), so the map must too
            keep = (
                ~vision | top_mask(score[:, None], vision[:, None], keep_n)[:, 0] | (tok == last_row.to(tok))
            )
            cache.policy_state[STATE_ROWS] = keep
            return keep

        return RowFilter(self.filter_layer - 1, choose)

    def after_prefill(self, cache, stats, ctx):
        bounds = self.bounds(ctx)
        n_img = bounds[:, 1] - bounds[:, 0]
        s_count = count(self.secondary_share, n_img)
        cache.policy_state[STATE_CORE] = count(self.core_share, n_img)
        rows = cache.policy_state.pop(STATE_ROWS, None)
        keeps = []
        for i, (layer, st) in enumerate(zip(cache.layers, stats)):
            width, b, h = layer.max_length, layer.batch, layer.kv_heads
            tok = torch.arange(width, device=layer.lengths.device)[None, :].expand(b, width)
            if rows is not None and i >= self.filter_layer:  # slots hold the filter's surviving rows
                tok = mask_to_index(rows[:, None])[0][:, 0, :width]
            region = self.regions(tok, bounds)
            valid = valid_slots(layer, width)[:, 0]
            _store(layer, REGION, region[:, None].expand(b, h, width).float())
            _store(layer, TEXT_SCORE, per_kv_head(st.colsum[:, :, :width], h) * (region == TEXT)[:, None])
            last = stats.extra[LAST][i].colsum[:, :, :width].mean(1)
            vision = (region == VISION) & valid
            secondary = top_mask(last[:, None], vision[:, None], s_count)
            if self.tracks_core:
                core = top_mask(last[:, None], secondary, cache.policy_state[STATE_CORE])
                _store(layer, CORE, core.expand(b, h, width).float())
            keeps.append((valid & ~vision)[:, None] | secondary)
        texts = [
            (layer.scores[REGION][:, :, : layer.max_length] == TEXT) & valid_slots(layer, layer.max_length)
            for layer in cache.layers
        ]
        text_keeps = self._text_keeps(cache, texts, *self._text_budgets(cache, bounds, texts))
        return _edits(cache.layers, [k if t is None else k & t for k, t in zip(keeps, text_keeps)])

    # ------------------------------------------------------------ decode
    def update_step(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def decode_request(self, cache, ctx):
        return StatsRequest(exact_output=self.budget >= 1)

    def decode_attend(self, cache: KVCache, ctx) -> list[AttendIndex | None] | None:
        """Engine hook: per layer, the past entries a non-update step computes over (None = all)."""
        plan = self._attend_plan(cache, ctx)
        if plan is None:
            return None
        everything, widths, index, counts = plan
        plans: list[AttendIndex | None] = [None] * len(cache.layers)
        for i, (every, width) in enumerate(zip(everything, widths)):
            if not all(every):  # each layer's list as wide as its own longest
                plans[i] = AttendIndex(index[i].narrow(2, 0, max(max(width), 1)), counts[i])
        return plans if any(p is not None for p in plans) else None

    def cohort_attend(self, cache, ctx) -> list[list[AttendIndex | None] | None]:
        """:meth:`decode_attend` of each row of a scheduler cohort (``policies.cohort.CohortCache``: one
        request per row, any lengths), from one pass over the stacked rows and one read back, not one
        per request: per row the lists its :meth:`decode_attend` alone gives (a layer it reads whole:
        None; each list as wide as the row's own longest)."""
        rows = cache.batch_size
        plan = self._attend_plan(cache, ctx)
        if plan is None:
            return [None] * rows
        everything, widths, index, counts = plan
        out: list[list] = [[None] * len(cache.layers) for _ in range(rows)]
        for i, (every, width) in enumerate(zip(everything, widths)):
            if all(every):
                continue
            for b, (idx, cnt) in enumerate(zip(index[i].split(1), counts[i].split(1))):
                if not every[b]:
                    w = max(width[b], 1)
                    out[b][i] = AttendIndex(idx if idx.shape[2] == w else idx.narrow(2, 0, w), cnt)
        return [plans if any(p is not None for p in plans) else None for plans in out]

    def restricts_attention(self, ctx) -> bool:
        """Whether this step may compute over the core only (a non-update step of a policy keeping a
        core smaller than its secondary set; a core as large is every vision entry a layer holds)."""
        return self.interval > 0 and not self.update_step(ctx.step) and self.tracks_core

    def _attend_plan(self, cache, ctx):
        """What :meth:`decode_attend` lists, for every layer and sample, from one read back: None where
        no layer is restricted this step; else per layer and sample whether it reads every entry
        (``everything[l][b]``) and its longest list (``widths[l][b]``), per layer ``index (B, H_kv, K)``
        ascending, 0-padded (``K`` the widest list of every layer) and ``counts (B, H_kv)``."""
        if not self.restricts_attention(ctx):
            return None
        layers = cache.layers
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, layer in enumerate(layers):
            groups.setdefault(tuple(layer.host_lengths()), []).append(i)
        parts, checks = [], []
        for members in groups.values():
            # the layers holding the same lengths stacked (G, B, H_kv, width): one mask for them all
            width = layers[members[0]].max_length
            region = torch.stack([layers[i].scores[REGION].narrow(2, 0, width) for i in members])
            core = torch.stack([layers[i].scores[CORE].narrow(2, 0, width) for i in members])
            valid = valid_slots(layers[members[0]], width)  # (B, 1, width)
            used = valid & ((region != VISION) | (core != 0))  # every valid entry but the idle vision
            counts = used.sum(-1)  # (G, B, H_kv)
            parts.append((members, used, counts))
            checks += [(used == valid).flatten(2).all(2).long(), counts.amax(2)]  # (G, B) each
        # per layer and sample whether it reads every entry and its longest list: one read back
        host = torch.cat(checks).tolist()
        everything: list = [None] * len(layers)
        widths: list = [None] * len(layers)
        index: list = [None] * len(layers)
        count: list = [None] * len(layers)
        at = 0
        for members, used, counts in parts:
            g = len(members)
            every, wide = host[at : at + g], host[at + g : at + 2 * g]
            at += 2 * g
            if all(all(e) for e in every):
                for j, i in enumerate(members):
                    everything[i], widths[i] = every[j], wide[j]
                continue
            stacked = mask_to_index(used, max(max(w) for w in wide), counts)[0]  # (G, B, H_kv, K)
            for j, (i, idx, cnt) in enumerate(zip(members, stacked.unbind(0), counts.unbind(0))):
                everything[i], widths[i], index[i], count[i] = every[j], wide[j], idx, cnt
        if all(all(e) for e in everything):
            return None
        return everything, widths, index, count

    def after_decode(self, cache, stats, ctx):
        layers = cache.layers
        # the text scores updated and the text counted, every layer at once (one C++ call on CPU caches)
        held = score_ops.text_step(
            [layer.scores[REGION] for layer in layers],
            [layer.scores[TEXT_SCORE] for layer in layers],
            [st.colsum for st in stats],
            [layer.max_length for layer in layers],
            [layer.lengths for layer in layers],
            ctx.num_kv_heads,
        )
        keep, host = self._text_budgets(cache, self.bounds(ctx), held=held)
        # a core as large as the secondary set is every vision entry a layer holds (no flags kept)
        if self.update_step(ctx.step) and self.tracks_core:
            self._refresh_cores(cache, stats)
        return text_evictions(cache.layers, keep, held, host, self.heavy_ratio)

    def _refresh_cores(self, cache: KVCache, stats) -> None:
        """Each layer's core: the top ``STATE_CORE`` vision entries by this step's head-mean attention.
        Layers holding the same lengths are ranked in one :func:`top_mask` over their stacked rows
        (each row is ranked alone: the same picks as one call per layer, one read back, not one per
        layer)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, layer in enumerate(cache.layers):
            groups.setdefault(tuple(layer.host_lengths()), []).append(i)
        for members in groups.values():
            first, g = cache.layers[members[0]], len(members)
            width = first.max_length
            valid = valid_slots(first, width)
            # ``narrow``: one op per view, where ``t[:, :1, :w]`` dispatches a slice per dimension
            means = torch.cat([stats[i].colsum.narrow(2, 0, width).mean(1, keepdim=True) for i in members])
            region = torch.cat(
                [cache.layers[i].scores[REGION].narrow(1, 0, 1).narrow(2, 0, width) for i in members]
            )
            core = top_mask(
                means, (region == VISION) & valid.repeat(g, 1, 1), cache.policy_state[STATE_CORE].repeat(g)
            )
            for i, rows in zip(members, core.split(first.batch)):
                layer = cache.layers[i]
                # bool into the float table in one pass (no float copy of the expanded rows first)
                layer.scores[CORE].narrow(2, 0, width).copy_(rows.expand(-1, layer.kv_heads, -1))

    # ------------------------------------------------------------ text H2O
    def _text_budgets(
        self, cache: KVCache, bounds: Tensor, texts: list[Tensor] | None = None, held: Tensor | None = None
    ):
        """The text entries each layer keeps: ``keep (L, B)`` and, read back in one transfer for
        every layer, per layer whether every text entry stays (``L`` ints), the counts kept
        (``L * B``) and the counts held (``L * B``). ``texts[l]``: ``(B, H_kv, S)`` bool, the layer's valid text slots, or ``held
        (L, B)``: their counts in head 0, where known."""
        # text tokens processed so far (prompt + generated)
        seen = cache.processed - bounds[:, 1].to(cache.processed)
        rank = torch.round(seen.double() * self.text_share).long().clamp(min=self.text_min)
        if held is None:
            held = torch.stack([text[:, 0].sum(-1) for text in texts])  # (L, B)
        rank = rank.to(held.device)
        keep = torch.minimum(rank, held)
        return keep, torch.cat([(held <= rank).all(1).long(), keep.reshape(-1), held.reshape(-1)]).tolist()

    def _text_keeps(self, cache: KVCache, texts: list[Tensor], keep: Tensor, host: list[int]):
        """Per layer, ``(B, H_kv, S)`` bool: every non-text slot plus the text entries the H2O budget
        keeps; None where every text entry stays (``keep``, ``host``: :meth:`_text_budgets`; top_mask
        reads nothing back)."""
        n, b = keep.shape
        out: list[Tensor | None] = []
        for i, (layer, text) in enumerate(zip(cache.layers, texts)):
            if host[i]:
                out.append(None)
                continue
            # text entries are the tail of every head's slots, so the recent ones are the last slots
            k = keep[i]
            recent = recent_mask(
                layer.lengths, text.shape[-1], k - torch.round(k.double() * self.heavy_ratio).long()
            )
            score = layer.scores[TEXT_SCORE][:, :, : text.shape[-1]]
            kept = host[n + i * b : n + (i + 1) * b]
            out.append(~text | top_mask(score, text, k, force=recent & text, kept=kept))
        return out


def _store(layer: LayerKV, name: str, values: Tensor) -> None:
    """Write ``values (B, H_kv, S)`` into the first ``S`` slots of a per-entry score."""
    layer.ensure_score(name)[:, :, : values.shape[-1]] = values


def _edits(layers: list[LayerKV], keeps: list[Tensor | None]) -> list[LayerEdit | None]:
    """Per layer, a select edit keeping ``keeps[l] (B, H_kv or 1, S)`` (equal counts per head), None where
    it keeps all (``keeps[l]`` None: all). Whether each keeps everything, its width and whether its
    heads agree: one read back for every layer, not three per layer."""
    live = [i for i, keep in enumerate(keeps) if keep is not None]
    if not live:
        return [None] * len(layers)
    masks, checks = {}, []
    for i in live:
        valid = valid_slots(layers[i], keeps[i].shape[-1])
        # a keep shared by the heads ((B, 1, S): a prefill that evicts no text) edits every head
        keep = masks[i] = (keeps[i] & valid).expand(-1, layers[i].kv_heads, -1)
        counts = keep.sum(-1)
        checks += [(keep == valid).all().long(), counts.max(), (counts == counts[:, :1]).all().long()]
    host = torch.stack(checks).tolist()
    edits: list[LayerEdit | None] = [None] * len(layers)
    for j, i in enumerate(live):
        everything, width, agree = host[3 * j : 3 * j + 3]
        if everything:
            continue
        if not agree:
            raise RuntimeError("avl selected different numbers of entries per KV head")
        index, counts = mask_to_index(masks[i], width)
        edits[i] = LayerEdit(index, counts[:, 0])
    return edits
