"""CacheBlend-r's choice of stored image rows to recompute, for the linker's one selective step.

CacheBlend (LMCache) checks one early layer: the stored rows whose K (LMCache) or V (the CacheBlend
repository) deviates most there from a fresh computation in the new prompt are recomputed. Here
the check costs one extra pass: the whole prompt through layers ``0..CHECK_LAYER`` (a row filter
drops every row but the last after the check layer, so later layers run one row) into a scratch
cache, whose check-layer entries are compared with the records'. The linker then recomputes the
chosen rows with the text in *every* layer, and links the others in every layer, so ``r = 0`` is
exactly ``full-reuse`` and ``r = 1`` exactly full recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vlkv.runtime.backend import RowFilter, StepInputs
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.compress import entry_offsets
from vlkv.runtime.prompt import PromptBatch

if TYPE_CHECKING:
    from vlkv.runtime.link.spec import LinkSpec

CHECK_LAYER = 1  # CacheBlend's check layer (its code's ``check_layers = [1]``)


def blend_rows(
    engine, batch: PromptBatch, emb: Tensor, hits: dict[int, SharedSegment], spec: LinkSpec
) -> Tensor:
    """CacheBlend's choice: the prompt rows of stored images to recompute, ``(c,)`` int64.

    The ``int(r * m)`` of the ``m`` stored image rows whose check-layer key (or value) deviates most
    (:func:`check_deviation`).
    """
    spans = batch.spans[0].image_spans
    host = batch.input_ids.device
    m = sum(entry_offsets(seg).numel() for seg in hits.values())
    count = int(spec.r * m)
    if count == 0 or count == m:
        rows = torch.cat([spans[i][0] + entry_offsets(seg).to(host) for i, seg in hits.items()])
        return rows[:count]
    rows, dev = check_deviation(engine, batch, emb, hits, spec.deviation)
    return rows[dev.topk(count).indices.cpu()].sort().values


def check_deviation(
    engine, batch: PromptBatch, emb: Tensor, hits: dict[int, SharedSegment], deviation: str = "k"
) -> tuple[Tensor, Tensor]:
    """Every stored image row's check-layer deviation from a fresh computation in this prompt.

    Squared L2 over heads and dims between the record's key (rotated to the row's position; or
    value, ``deviation="v"``) and a fresh pass of the whole prompt through layers ``0..CHECK_LAYER``.

    Args:
        emb: ``(1, n, hidden)`` the prompt's embeddings (every row, stored images included).
        hits: image index → its record, for the prompt's stored images.

    Returns:
        ``(rows, dev)``: ``(m,)`` int64 prompt rows of the stored entries (image by image, in
        ``hits``' order) and their ``(m,)`` float32 deviations.
    """
    spans = batch.spans[0].image_spans
    host = batch.input_ids.device  # prompt rows are indexed where the prompt lives
    rows = torch.cat([spans[i][0] + entry_offsets(seg).to(host) for i, seg in hits.items()])
    n = int(batch.lengths[0])
    pool = next(iter(hits.values())).pool
    layer = min(CHECK_LAYER, engine.backend.num_layers - 1)
    scratch = engine.new_cache(batch, pool=pool)
    try:
        # every row through the check layer; after it only the last row (kept by the filter) goes on
        drop = RowFilter(layer, lambda _stats, _layer: torch.zeros(1, n, dtype=torch.bool, device=emb.device))
        inputs = StepInputs(
            batch.input_ids[:, :n], batch.positions[:, :n], batch.modality[:, :n], batch.lengths.new_tensor([n]),
            emb[:, :n], row_filter=drop,
        )  # fmt: skip
        engine.backend.step(inputs, scratch)
        fk, fv = scratch.layers[layer].attention_kv(n)  # (1, H_kv, n, D), keys rotated
    finally:
        scratch.release()
    stored = []
    for i, seg in hits.items():
        a, b = spans[i]
        k, v = pool.read(layer, seg.ids[layer][None])  # (1, H_kv, m_i, D), keys pre-RoPE
        if deviation == "k":
            pos = (
                batch.positions[0, a + entry_offsets(seg).to(host)]
                .to(k.device)[None, None]
                .expand(1, k.shape[1], -1, -1)
            )
            stored.append(pool.rope(k, pos))
        else:
            stored.append(v)
    fresh = (fk if deviation == "k" else fv)[:, :, rows.to(fk.device)]
    dev = (fresh.float() - torch.cat(stored, dim=2).float()).square().sum(dim=(0, 1, 3))
    return rows, dev.cpu()
