"""Applying a policy's edits to a cache: the one place every backend's steps and the scheduler share.

Its own module so that the scheduler applies edits without importing the engine that drives it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vlkv.runtime.cache import KVCache
from vlkv.runtime.policies import CutEdit, FactorEdit, LayerEdit
from vlkv.runtime.policies.base import DropOneEdit

# spare slots kept after a decode-time eviction so the next append does not reallocate
DECODE_SPARE = 8

# the rank settings that wait across apply_edits calls inside ``ranks_together`` (None: outside one)
_WAITING: contextvars.ContextVar = contextvars.ContextVar("vlkv_waiting_ranks", default=None)


@contextmanager
def ranks_together() -> Iterator[list]:
    """Within the block, the factor edits' rank settings of every :func:`apply_edits` call wait, and are
    set together when it ends (a scheduler commit applies each request's edits by a call of its own:
    one rank setting a step, not one a request). Yields a list that, once the block has ended,
    holds ``(cache, error)`` for each cache whose ranks could not be set (the batched setting raised,
    then its own did): the caller fails those requests. Nothing is set if the block raises."""
    ranks = _PendingRanks()
    token = _WAITING.set(ranks)
    failed: list = []
    try:
        yield failed
    finally:
        _WAITING.reset(token)
    failed.extend(ranks.failed + ranks.flush_each())


def apply_edits(cache: KVCache, edits: list | None, spare: int = 0) -> None:
    """Apply a policy's per-layer edits to the cache (backend-independent tensor ops).

    ``edits[l]`` is None, a :class:`LayerEdit` (select / merge), a :class:`CutEdit` (delete a run of
    entries per sample), a :class:`FactorEdit` (hold entries as low-rank factors), or a tuple of them
    applied in order. ``spare > 0`` marks decode-time edits:
    their tables keep ``spare`` columns for the coming appends, and the few slots an eviction drops
    are handed to those appends (:meth:`LayerKV.select`'s ``recycle``).
    """
    apply_edits_of([(cache, edits)], spare)


def apply_edits_of(items: list[tuple[KVCache, list | None]], spare: int = 0) -> None:
    """:func:`apply_edits` of several caches' edits ``(cache, edits)`` (a scheduler step's cohort of
    requests): the plain selections of every cache are prepared together (:func:`prepare_selects`:
    their checks in one read back, every one-column drop's tables moved at once) before each cache's
    edits are applied to it."""
    from vlkv.runtime.kv.drops import cut_soles
    from vlkv.runtime.kv.edits import prepare_selects

    if spare > 0:
        items = [(cache, _one_column_cuts(cache, edits)) for cache, edits in items]
    # plain selections (one per layer) check what their in-place path needs in one read for all
    # layers, not one per layer (:func:`prepare_selects`)
    plain = [
        (c, i)
        for c, (cache, edits) in enumerate(items)
        for i, item in enumerate(edits or [])
        if isinstance(item, LayerEdit) and item.assign is None and item.holes is None
    ]
    # an index built on first read (a per-step drop's, ``DropOneEdit``) stays unbuilt here: the one-call
    # drop closes the gaps from the dropped columns alone; only a layer that still needs it reads it
    jobs = []
    for c, i in plain:
        cache, edit = items[c][0], items[c][1][i]
        jobs.append((cache.layers[i], edit.built_index(), edit.keep_len, edit.kept, edit.dropped))
    prepared = dict(zip(plain, prepare_selects(jobs, spare, spare > 0))) if len(plain) > 1 else {}
    waiting = _WAITING.get()
    ranks = _PendingRanks() if waiting is None else waiting
    for c, (cache, edits) in enumerate(items):
        # cuts the policy read on the host (a per-step cut, every layer) check their recycled slots in
        # one read for all layers too
        cuts = [
            i for i, item in enumerate(edits or []) if isinstance(item, CutEdit) and item.host is not None
        ]
        soles = {}
        if len(cuts) > 1:
            soles = dict(zip(cuts, cut_soles([(cache.layers[i], *edits[i].host) for i in cuts], spare > 0)))
        _apply(cache, edits, spare, {i: p for (cc, i), p in prepared.items() if cc == c}, soles, ranks)
    if waiting is None:
        failed = ranks.failed + ranks.flush_each()
        if failed:  # outside ranks_together a call's caches fail together (a cohort's do anyway)
            raise failed[0][1]


def _one_column_cuts(cache: KVCache, edits: list | None) -> list | None:
    """``edits`` with each decode-time :class:`CutEdit` that deletes one entry of every sample (a
    per-step cut: local's oldest entry, Elastic Cache's at its fixed point) of a layer whose samples
    hold the same ``n`` entries, and no holes or factors, as the one-column drop it is
    (:class:`DropOneEdit` of column ``start``): the same tables, lengths and recycled slot, and every
    such layer (of every cache of a cohort) moved by :func:`prepare_selects`' one call, where each
    cut moved its tables one slice per table, layer and request."""
    if not edits:
        return edits
    out = list(edits)
    for i, (layer, edit) in enumerate(zip(cache.layers, edits)):
        if not isinstance(edit, CutEdit) or edit.host is None or layer.holes is not None:
            continue
        starts, counts = edit.host
        lens = layer.host_lengths()
        if layer.lowrank is not None or not lens or set(counts) != {1} or len(set(lens)) != 1:
            continue
        n = lens[0]
        if not all(0 <= st < n for st in starts):
            continue  # the cut refuses it, naming the column
        b, h = len(lens), layer.kv_heads
        dropped = edit.start.to(device=layer.device, dtype=torch.long).view(b, 1, 1).expand(b, h, 1)
        out[i] = DropOneEdit(n, layer.lengths - 1, [n - 1] * b, dropped)
    return out


class _PendingRanks:
    """Factor edits whose rank setting by importance waits, so that many layers' (and requests') ranks
    are set together (``kv/factor_ranks``: a fixed number of tensor ops, not ~29 a request and layer;
    across :func:`apply_edits` calls inside :func:`ranks_together`).

    A layer's ranks must be set before any later edit of that layer reads them (an eviction's
    ``LowRank.prune`` takes rows with their ranks, a merge rebuilds at them): :meth:`before` sets
    every waiting one first. Layers are otherwise independent, so waiting changes no result."""

    def __init__(self):
        self.jobs: list[tuple] = []  # (cache, layer, FactorEdit)
        self.failed: list[tuple] = []  # (cache, error): other caches whose setting raised in a `before`

    def factor(self, cache: KVCache, layer, edit: FactorEdit) -> None:
        """Factor ``layer``'s due samples now (``kv/lowrank.factor_due``); its ranks wait."""
        from vlkv.runtime.kv.lowrank import factor_due

        self.before(layer)
        factor_due(layer, edit)
        self.jobs.append((cache, layer, edit))

    def before(self, layer) -> None:
        """Set the waiting ranks if ``layer``'s are among them (an edit of ``layer`` follows). Every
        waiting cache's are set at once; a cache whose own setting raises is blamed, not the one
        being edited: the error is raised only if it is ``layer``'s cache's, else kept in
        :attr:`failed` for the caller that reports failures (``ranks_together``, the end of a call)."""
        owner = next((cache for cache, waiting, _ in self.jobs if waiting is layer), None)
        if owner is None:
            return
        failed = self.flush_each()
        self.failed.extend((cache, err) for cache, err in failed if cache is not owner)
        for cache, err in failed:
            if cache is owner:
                raise err

    def flush_each(self) -> list[tuple]:
        """Set every waiting rank at once; where that raises, each cache's ranks alone: ``[(cache,
        error)]`` of those that raise again."""
        jobs, self.jobs = self.jobs, []
        try:
            _set_ranks(jobs)
            return []
        except Exception:
            failed = []
            for cache in {id(c): c for c, _, _ in jobs}.values():
                try:
                    _set_ranks([j for j in jobs if j[0] is cache])
                except Exception as err:
                    failed.append((cache, err))
            return failed


def _set_ranks(jobs: list[tuple]) -> None:
    """The ranks by importance of ``jobs`` ``(cache, layer, FactorEdit)`` (those that set any, whose
    layer still holds factors: a request failed meanwhile released its cache), all at once."""
    from vlkv.runtime.kv.factor_ranks import rank_jobs, set_ranks_by_importance

    todo = rank_jobs([(layer, edit) for _, layer, edit in jobs])
    if todo:
        set_ranks_by_importance(todo)


def _apply(
    cache: KVCache, edits: list | None, spare: int, prepared: dict, soles: dict, ranks: _PendingRanks
) -> None:
    """Each layer's edits of one cache, its selections prepared (``prepared``: layer → select) and
    its cuts' recycled slots checked (``soles``) where that was done for many layers at once.

    Applied stage by stage (every layer's first edit, then every layer's second...): each layer's
    edits keep their order, and a factor edit's rank setting waits in ``ranks`` until the next stage
    touches its layer, so the layers' ranks are set together."""
    per_layer = [item if isinstance(item, tuple) else (item,) for item in edits or []]
    for stage in range(max(map(len, per_layer), default=0)):
        for i, (layer, item) in enumerate(zip(cache.layers, per_layer)):
            edit = item[stage] if stage < len(item) else None
            if edit is None:
                continue
            if isinstance(edit, FactorEdit):
                ranks.factor(cache, layer, edit)
                continue
            ranks.before(layer)
            if isinstance(edit, CutEdit):
                layer.cut(edit.start, edit.count, recycle=spare > 0, host=edit.host, sole=soles.get(i))
            elif edit.assign is None:
                prep = prepared.get(i)
                layer.select(
                    edit.built_index() if _index_unread(prep) else edit.index,
                    edit.keep_len,
                    spare=spare,
                    holes=edit.holes,
                    recycle=spare > 0,
                    kept=edit.kept,
                    prepared=prep,
                )
            else:
                layer.merge(edit.index, edit.keep_len, edit.assign, edit.counts)


def _index_unread(prep) -> bool:
    """Whether a prepared select never reads its edit's kept columns: the gaps are closed already
    (``moved``), or each row drops one known column in place (the shift reads the dropped column
    alone), so a :class:`DropOneEdit` need not build its ``(B, H_kv, n - 1)`` index."""
    if prep is None:
        return False
    return prep.moved or (prep.in_place and prep.cols is not None and prep.cols.shape[2] == 1)
