"""A-VL's decode-time text eviction (H2O over the text after the image), every layer at once.

:class:`~vlkv.runtime.policies.avl.AVLPolicy` decides the text budgets; this turns them into the
layers' select edits the way :func:`~vlkv.runtime.policies.base.select_top` turns H2O's: one ranking
per group of layers, the dropped columns named for the cache's one-call drop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.cache import LayerKV
from vlkv.runtime.policies.base import LayerEdit, group_edits, rank_layers, valid_slots

TEXT_SCORE = "avl_text"  # per-entry score: each text entry's accumulated attention


def text_evictions(
    layers: list[LayerKV], keep: Tensor, counts: Tensor, host: list[int], heavy_ratio: float
) -> list[LayerEdit | None]:
    """Per layer, a decode step's text eviction as a select edit, None where every text entry
    stays (``keep (L, B)`` int64 text entries each keeps, ``counts (L, B)`` int64 text entries each
    holds, ``host``: :meth:`AVLPolicy._text_budgets`' read back, holding both;
    ``heavy_ratio``: the heavy-hitter share of each text budget, the rest recent).

    The text entries are the tail ``[n - held, n)`` of every head's slots (regions follow the
    prompt's order; appends are text), the recent ones its last, so :meth:`AVLPolicy._text_keeps`' ranking
    of the text alone is the ranking of every valid slot with all but the non-recent text forced
    in, keeping ``n - held + keep``: forced slots rank highest and, among equals, the lower column
    first, which puts the non-text slots (the lowest columns) before any text one. In that form
    the layers holding the same lengths and counts share their masks and are ranked in one call
    over their stacked score tables (as :func:`~vlkv.runtime.policies.base.select_top` does
    H2O's), and where every row drops one entry (a one-sample cache's step) each edit names its
    dropped column (:class:`DropOneEdit`): the cache then closes every layer's gap in one call."""
    n_layers, b = keep.shape
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        if not host[i]:
            at = n_layers + i * b
            key = (tuple(layer.host_lengths()), tuple(host[at : at + b]))
            held = host[at + n_layers * b : at + n_layers * b + b]
            groups.setdefault((*key, tuple(held)), []).append(i)
    edits: list[LayerEdit | None] = [None] * n_layers
    for (rows, text_kept, held), members in groups.items():
        first, g = layers[members[0]], len(members)
        width = max(rows)
        kept = [n - h + k for n, h, k in zip(rows, held, text_kept)]
        # per sample the text entries that may go: [n - held, n - recent), from the device values (a
        # tensor made from host values would wait for the device on a GPU)
        k, n = keep[members[0]], first.lengths
        start = n - counts[members[0]].to(n)
        end = n - (k - torch.round(k.double() * heavy_ratio).long())
        j = torch.arange(width, device=n.device)
        force = ((j < start[:, None]) | (j >= end[:, None]))[:, None]  # (B, 1, width)
        valid = valid_slots(first, width)
        per = [layers[i].scores[TEXT_SCORE].narrow(2, 0, width) for i in members]  # (B, H_kv, width)
        keep_len = start + k  # (B,) every sample's entries after the step, whichever path ranks
        index, _, dropped = rank_layers(
            per, valid, force, keep_len, kept, keep_len, list(rows), getattr(first, "per_row_edits", False)
        )
        group_edits(edits, members, width, kept, index, keep_len.repeat(g), dropped)
    return edits
