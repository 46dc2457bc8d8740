"""The linker: build a request's prefill cache from stored image K/V in one selective step (MPIC).

Every method is one :func:`link_prefill` call with a different *reuse plan*:

* ``none`` — recompute everything (a normal prefill);
* ``prefix`` — reuse a stored identical prefix (what vLLM's prefix caching does), recompute the rest;
* ``full-reuse`` — reuse every stored image's entries, recompute the text (MPIC with k = 0);
* ``mpic`` (MPIC-k) — reuse each stored image except its first ``k`` tokens; recompute those and
  every text token;
* ``cacheblend`` (CacheBlend-r) — reuse stored images except the fraction ``r`` of their tokens
  whose check-layer K (or V) deviates most from a fresh computation in this prompt.

Which stored rows are recomputed is :mod:`vlkv.runtime.link.picks`' choice (MPIC's ``pick``).

The plan's reused entries are linked into the cache at their *actual* positions (pre-RoPE keys,
rotated on read); the remaining prompt rows — a non-contiguous selection — run through the model in
one step whose attention masks by sequence order (:attr:`StepInputs.selective`), so each recomputed
row sees exactly the entries before it, linked or recomputed; afterwards the slot tables are put back
in sequence order (metadata only). An image missing from the store is recomputed whole and becomes a
record for the next request: computed alone after the model's template opening (the attention sink,
:mod:`vlkv.runtime.link.sink`), its rows stored pre-RoPE.

CacheBlend's choice (:mod:`vlkv.runtime.link.cacheblend`) costs one extra pass over the first
layers; the selective prefill then recomputes the text plus the chosen rows in *every* layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepInputs, StepOutput, StepStats
from vlkv.runtime.cache import KVCache
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.compress import entry_offsets as _offsets
from vlkv.runtime.link.picks import recompute_rows
from vlkv.runtime.link.spec import LinkSpec, LinkStats
from vlkv.runtime.prompt import PromptBatch

if TYPE_CHECKING:
    from vlkv.runtime.link.records import RecordSource


def identity(batch: PromptBatch, keys: list[str], tenant: str) -> tuple:
    """The prompt as a sequence where each image's tokens carry its key (prefix matching), after a
    first element naming ``tenant``: a text-only prompt carries no record key, so without it two
    tenants' prompts would share prefixes. ``key[1 + i]`` stands for prompt token ``i``."""
    ids = batch.input_ids[0, : int(batch.lengths[0])].tolist()
    out: list = [("tenant", tenant), *ids]
    for (a, b), key in zip(batch.spans[0].image_spans, keys):
        for i in range(a, b):
            out[1 + i] = (key, i - a)
    return tuple(out)


def standalone_segment(
    engine, batch: PromptBatch, emb: Tensor, span: tuple[int, int], pool, replay: bool = False
) -> SharedSegment:
    """One image's K/V computed alone after the model's template opening (the attention sink,
    :mod:`vlkv.runtime.link.sink`), at positions from 0, stored pre-RoPE (a reusable record of the
    image's rows only).

    ``replay`` also scores its entries by KVzip's replay over the image alone (``seg.replay_scores``,
    per layer ``(H_kv, n)``), for the ``kvzip`` record scorer."""
    from vlkv.runtime.link.sink import with_sink

    a, b = span
    pos = batch.positions[:, a:b]
    pos = pos - pos.amin(dim=1, keepdim=True)  # 1-D: 0..n-1; M-RoPE: the image's own grid ids
    embeds, pos, ids, modality, s = with_sink(
        engine, emb[:, a:b], pos, batch.input_ids[:, a:b], batch.modality[:, a:b]
    )
    cache = engine.new_cache(batch, pool=pool)
    seg = None
    n = b - a
    try:  # the scratch cache (and a half-made record) go back to the pool whatever fails
        inputs = StepInputs(ids, pos, modality, batch.lengths.new_tensor([s + n]), embeds)
        engine.backend.step(inputs, cache)
        seg = SharedSegment.from_cache(cache, s, s + n)
        if replay:
            from vlkv.runtime.replay import ReplayRequest

            request = ReplayRequest()
            tids = engine.tokenizer(request.template, add_special_tokens=False)["input_ids"]
            scores = engine.backend.replay(
                request,
                cache,
                embeds,
                batch.lengths.new_tensor([s + n]),
                torch.tensor(tids, dtype=torch.long, device=emb.device),
            )
            seg.replay_scores = [sc[0, :, s : s + n] for sc in scores]
    except BaseException:
        if seg is not None:
            seg.release()
        raise
    finally:
        cache.release()
    return seg


def link_prefill(
    engine,
    batch: PromptBatch,
    images: list,
    cache: KVCache,
    spec: LinkSpec,
    source: RecordSource,
    request: StatsRequest | None = None,
    idents: list | None = None,
) -> tuple[StepOutput, LinkStats]:
    """Prefill a one-prompt ``batch`` (whose images are ``images``) into ``cache`` reusing ``store``'s
    records; returns the step's output (logits of the last prompt token) and what was reused.

    Images whose token runs cannot be told apart (two images with no token between them) are
    recomputed, never guessed. ``request`` (over the whole prompt's rows, as a policy asks for a
    prefill) gets its statistics from the recomputed rows only — linked rows run no query — and the
    returned statistics follow the cache's slots in sequence order. Images are keyed by their pixels
    (:meth:`RecordSource.identity`), never by a client's uuid; ``idents`` (one per image, for this
    ``spec``) are those identities when the caller computed them already (hashing reads every pixel)."""
    stats = LinkStats()
    n = int(batch.lengths[0])
    spans = batch.spans[0].image_spans
    variant = spec.record_variant()
    if idents is None or len(idents) != len(images):
        idents = [source.identity(img, variant) for img in images]
    idents = idents if len(images) == len(spans) else None
    keys = None if idents is None else [source.key(i) for i in idents]
    store = source.segments
    loaded_before = source.loaded_bytes
    host = batch.input_ids.device  # the prompt's row bookkeeping lives with the prompt
    linked = torch.zeros(n, dtype=torch.bool, device=host)
    known: dict[int, Tensor | None] = {}  # image index -> embeddings from its record (None: none kept)
    hits: dict[int, SharedSegment] = {}  # image index -> its record (image-wise methods)
    if spec.method == "prefix" and keys is not None:
        ident = identity(batch, keys, source.tenant)
        best = max((p for p in store.prefixes if ident[: len(p)] == p), key=len, default=None)
        if best is not None:
            m = min(len(best) - 1, n - 1)  # the last token is recomputed: it gives the logits
            _link_part(store.prefixes[best], cache, batch, m)
            linked[:m] = True
            stats.hits += 1
            known = {i: _ZERO for i, (a, b) in enumerate(spans) if b <= m}  # wholly linked: no rows to embed
        else:
            stats.misses += 1
    if spec.method in ("mpic", "full-reuse", "cacheblend") and keys is not None:
        emb = _load_or_compute(engine, batch, cache, spec, source, keys, idents, hits, stats)
    else:
        emb = _embed(engine, batch, known) if keys is not None else engine.backend.embed(batch)
    absent = torch.zeros(n, dtype=torch.bool, device=host)  # rows a compressed record left out
    if hits:
        fresh = torch.zeros(n, dtype=torch.bool, device=host)  # stored rows recomputed anyway
        fresh[recompute_rows(engine, batch, emb, hits, spec)] = True  # MPIC's / CacheBlend's choice
        for i, seg in hits.items():
            a, b = spans[i]
            off = _offsets(seg).to(host)
            use = ~fresh[a + off]
            if use.any():
                _link_rows(
                    seg, cache, torch.nonzero(use).flatten(), batch.positions[0, a + off[use]], a + off[use]
                )
                linked[a + off[use]] = True
            if off.numel() < b - a:
                absent[a:b] = True
                absent[a + off] = False
                absent[a:b] &= ~fresh[a:b]
    linked[n - 1] = False  # the last prompt token always runs: it gives the logits
    absent[n - 1] = False
    stats.dropped_tokens = int(absent.sum())
    rows = torch.nonzero(~linked & ~absent).flatten()
    stats.reused_tokens = int(linked.sum())
    stats.recomputed_tokens = rows.numel()
    stats.bytes_linked = stats.reused_tokens * cache.pool.spec.entry_bytes * len(cache.layers)
    dev = cache.device
    inputs = StepInputs(
        batch.input_ids[:, rows],
        batch.positions[:, rows],
        batch.modality[:, rows],
        batch.lengths.new_tensor([rows.numel()]),
        emb[:, rows],
        order=rows[None].to(dev),
        selective=bool(linked.any()),
    )
    out = engine.backend.step(inputs, cache, _only_rows(request, rows))
    if linked.any():
        perms = _sort_tables(cache)
        out.stats = _permute(out.stats, perms)
    cache.processed = torch.full_like(cache.processed, n)
    _remember(engine, batch, emb, cache, spec, source, keys, idents)
    stats.bytes_loaded = source.loaded_bytes - loaded_before
    return out, stats


_ZERO = torch.zeros(0)  # marks an image whose rows are all linked (its embeddings are never read)


def _load_or_compute(
    engine, batch, cache, spec, source: RecordSource, keys, idents, hits: dict, stats: LinkStats
):
    """``(1, n, hidden)`` prompt embeddings; fills ``hits`` (image index → record) and the hit/miss counts.

    Store reads start first; while they run (with ``source.loader``), the images nothing holds go
    through the vision tower and become records. Then the reads are waited for and loaded into the
    pool; an image whose read fails (a damaged record) or whose record kept no embeddings goes
    through the vision tower last."""
    spans = batch.spans[0].image_spans
    pending = source.prefetch(idents)
    emb = _embed(engine, batch, {i: _ZERO for i, p in enumerate(pending) if p is not None})
    misses = [i for i, p in enumerate(pending) if p is None]
    _records(engine, batch, emb, cache.pool, spec, source, misses, keys, idents)
    late = []
    for i, entry in enumerate(pending):
        seg = source.resolve(entry)
        if seg is None:
            stats.misses += 1
            if entry is not None:
                late.append(i)
            continue
        stats.hits += 1
        hits[i] = seg
        if seg.embeds is None:
            late.append(i)
        else:
            a, b = spans[i]
            emb[0, a:b] = seg.embeds.to(device=emb.device, dtype=emb.dtype)
    _features(engine, batch, emb, late)
    return emb


def _embed(engine, batch: PromptBatch, known: dict) -> Tensor:
    """``(1, n, hidden)`` prompt embeddings, running the vision tower only for images without a record.

    ``known[i]`` holds image ``i``'s ``(n_i, hidden)`` embeddings from its record (or :data:`_ZERO`
    when none of its rows is recomputed); the others are computed, all in one vision call."""
    dev = engine.backend.device
    emb = engine.backend.adapter.embed_tokens(batch.input_ids.to(dev))
    spans = batch.spans[0].image_spans
    _features(engine, batch, emb, [i for i in range(len(spans)) if known.get(i) is None])
    for i, e in known.items():
        if e is not None and e.numel():
            a, b = spans[i]
            emb[0, a:b] = e.to(device=dev, dtype=emb.dtype)
    return emb


def _link_rows(seg: SharedSegment, cache: KVCache, idx: Tensor, positions: Tensor, order: Tensor) -> None:
    """Link entries ``idx (c,)`` of ``seg`` at ``positions (c, P)`` with sequence indices ``order (c,)``."""
    if cache.pool is not seg.pool:
        raise ValueError("a segment links only into caches on its own pool")
    for layer, ids in zip(cache.layers, seg.ids):
        layer.link(ids[:, idx.to(ids.device)], positions, seg.modality[idx], 0, order)


def _features(engine, batch: PromptBatch, emb: Tensor, images: list[int]) -> None:
    """Write images ``images``' vision features into their rows of ``emb (1, n, hidden)`` (one call)."""
    if not images:
        return
    ad = engine.backend.adapter
    spans = batch.spans[0].image_spans
    need = [i in images for i in range(len(spans))]
    vision = {k: v.to(engine.backend.device) for k, v in batch.prompts[0].vision.items()}
    feats = ad.image_features(ad.select_images(vision, need))
    at = 0
    for (a, b), todo in zip(spans, need):
        if todo:
            emb[0, a:b] = feats[at : at + b - a].to(emb.dtype)
            at += b - a


def _link_part(seg: SharedSegment, cache: KVCache, batch: PromptBatch, m: int) -> None:
    """Link the first ``m`` entries of a prefix segment (a longer stored prefix)."""
    if cache.pool is not seg.pool:
        raise ValueError("a segment links only into caches on its own pool")
    for layer, ids in zip(cache.layers, seg.ids):
        layer.link(
            ids[:, :m], batch.positions[0, :m], seg.modality[:m], 0, torch.arange(m, device=cache.device)
        )


def _sort_tables(cache: KVCache) -> list[Tensor]:
    """Put every layer's entries back in sequence order (slot tables and metadata only).

    Returns per layer the ``(B, H_kv, n)`` permutation applied (new column → old column)."""
    perms = []
    for layer in cache.layers:
        n = layer.max_length
        order = layer.order[:, :, :n].masked_fill(
            ~layer.valid_mask()[:, None, :n], torch.iinfo(torch.long).max
        )
        perm = torch.sort(order, dim=-1, stable=True).indices
        layer.select(perm, layer.lengths.clone())
        perms.append(perm)
    return perms


def _only_rows(request: StatsRequest | None, rows: Tensor) -> StatsRequest | None:
    """A prefill statistics request narrowed to the recomputed ``rows (q,)`` of a one-prompt batch."""
    if request is None:
        return None

    def cut(r: StatsRequest) -> StatsRequest:
        sel = None if r.rows is None else r.rows[:, rows.to(r.rows.device)]
        return replace(r, rows=sel, extra={})

    return replace(cut(request), extra={name: cut(sub) for name, sub in request.extra.items()})


def _permute(stats, perms: list[Tensor]):
    """Statistics over pre-sort columns → the sorted tables' columns (per KV head, GQA-expanded)."""
    from vlkv.plugins import AttnStats

    def one(st, perm):
        if st is None:
            return None
        group = st.colsum.shape[1] // perm.shape[1]
        n = perm.shape[2]
        idx = perm.repeat_interleave(group, dim=1).to(st.colsum.device)
        colsum = st.colsum.clone()
        colsum[:, :, :n] = st.colsum[:, :, :n].gather(2, idx)
        return AttnStats(colsum, st.below, st.visible)

    out = StepStats([one(st, p) for st, p in zip(stats, perms)])
    out.extra = {
        name: [one(st, p) for st, p in zip(v, perms)] for name, v in getattr(stats, "extra", {}).items()
    }
    return out


def _remember(engine, batch, emb, cache, spec, source: RecordSource, keys, idents) -> None:
    """Store what a later request can reuse: missing images (computed alone) and the prompt prefix."""
    if keys is None or spec.method == "none":
        return
    store = source.segments
    if spec.method == "prefix":
        ident = identity(batch, keys, source.tenant)
        if ident not in store.prefixes:
            store.prefixes[ident] = SharedSegment.from_cache(cache, 0, len(ident) - 1)
        return
    _records(engine, batch, emb, cache.pool, spec, source, range(len(keys)), keys, idents)


def _records(engine, batch, emb, pool, spec: LinkSpec, source: RecordSource, images, keys, idents) -> None:
    """Make records of images ``images`` that have none yet (computed alone, compressed to the
    request's store budget, kept, written back)."""
    spans = batch.spans[0].image_spans
    for i in images:
        if keys[i] not in source.segments.images:
            replay = spec.store_budget < 1.0 and spec.store_scorer == "kvzip"
            seg = standalone_segment(engine, batch, emb, spans[i], pool, replay)
            try:  # until the segment table owns it, a record that fails half-way is freed here
                seg.embeds = emb[0, spans[i][0] : spans[i][1]].detach()
                if spec.store_budget < 1.0:
                    from vlkv.runtime.link.compress import compress_segment

                    seg = compress_segment(seg, spec.store_budget, spec.store_scorer)
                if spec.store_rank:
                    from vlkv.runtime.link.compress import factor_segment

                    seg = factor_segment(seg, spec.store_rank)
            except BaseException:
                seg.release()  # compress/factor release their input only on success
                raise
            source.remember(idents[i], seg, seg.embeds)
