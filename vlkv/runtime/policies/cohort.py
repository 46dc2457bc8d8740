"""A cohort: the requests of one decode step that run equal policies on equally shaped caches, whose
decode-time bookkeeping runs once for all of them.

The scheduler keeps one single-sample cache per request, so a policy's ``after_decode`` called per
request repeats every op of its statistics and ranking (the running scores' update, the targets,
the protected windows, the ranking) once per request and layer: at batch 4 the scheduler path
dispatched ~4x the policy ops of ``Engine.decode`` over one batched cache. Here the requests of a
decode group whose policies are equal (dataclass equality), whose layers hold the same number of
entries and whose tables have the same capacity are stacked into a :class:`CohortCache`: per layer
the running score tables concatenated (``(R, H_kv, C)``, one ``cat`` per layer and table), the
lengths likewise. The policy runs once over that batch — the same per-row arithmetic as over each
request alone (its ops are per row: sums, masks, per-row rankings) — the score tables it may change are
copied back with one ``_foreach_copy_`` per layer and table, and its per-layer edits are split into
each request's rows (one ``split`` per tensor).

Which policies: those whose decode hook reads only what :class:`CohortLayer` holds (the layer's
``lengths``, host lengths, capacity, running ``scores``; the cache's ``processed`` and the
``policy_state`` entries named by :attr:`Policy.cohort_state`) declare ``cohort_decode``; the others
(and any request the cohort cannot take) keep the per-request call. A cohort that raises is rerun
request by request, its stacked copies dropped: nothing is written back before the policy returns.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from vlkv.runtime.backend import StepStats
from vlkv.runtime.policies.base import CutEdit, DropOneEdit, FactorEdit, LayerEdit, PolicyContext

__all__ = ["CohortCache", "CohortLayer", "cohorts", "decode_edits", "split_edits"]


class CohortLayer:
    """One layer of a :class:`CohortCache`: ``R`` one-sample layers holding the same number of entries,
    seen as one ``R``-sample layer. Its running scores are stacked copies (``(R, H_kv, C)``), written
    back by :meth:`write_back` (all but the ones the policy only reads)."""

    def __init__(self, rows: list, readonly: frozenset[str] = frozenset()):
        self.rows = rows
        first = rows[0]
        self.batch, self.kv_heads, self.layer = len(rows), first.kv_heads, first.layer
        self.capacity, self.device = first.capacity, first.device
        self._host = [n for r in rows for n in r.host_lengths()]
        self.lengths = torch.cat([r.lengths for r in rows])  # (R,) int64
        self.scores = _StackedScores(rows, readonly)

    def host_lengths(self) -> list[int]:
        return self._host

    @property
    def max_length(self) -> int:
        return max(self._host, default=0)

    def ensure_score(self, name: str) -> Tensor:
        """The stacked ``(R, H_kv, C)`` running statistic ``name``, created (zeros) in every row first."""
        for r in self.rows:
            r.ensure_score(name)
        return self.scores[name]

    def write_back(self) -> None:
        """Copy each stacked score table the policy changed back into the rows' own tables."""
        self.scores.write_back()


class _StackedScores(dict):
    """``name → (R, H_kv, C)`` stacked copies of the rows' running score tables, made on first read;
    all but the ``readonly`` ones are copied back."""

    def __init__(self, rows: list, readonly: frozenset[str] = frozenset()):
        super().__init__()
        self._rows, self._readonly = rows, readonly
        self._made: list[str] = []

    def __missing__(self, name: str) -> Tensor:
        stacked = torch.cat([r.scores[name] for r in self._rows])
        self[name] = stacked
        self._made.append(name)
        return stacked

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or all(name in r.scores for r in self._rows)

    def write_back(self) -> None:
        # every table made but the ones the policy only reads: a C++ kernel's in-place write (score_ops)
        # does not bump a tensor's version, so versions cannot tell which ones changed
        for name in self._made:
            if name not in self._readonly:
                stacked = dict.__getitem__(self, name)
                torch._foreach_copy_([r.scores[name] for r in self._rows], list(stacked.split(1)))


class CohortCache:
    """``R`` requests' one-sample caches seen as one ``R``-sample cache by a policy's decode hook:
    ``layers`` (:class:`CohortLayer`), ``lengths()``, ``processed (R,)``, the ``policy_state``
    entries the policy names (concatenated along their sample dimension), ``device``."""

    def __init__(self, caches: list, state: dict[str, int], readonly: frozenset[str] = frozenset()):
        self.caches = caches
        self.layers = [CohortLayer(rows, readonly) for rows in zip(*(c.layers for c in caches))]
        self.processed = torch.cat([c.processed for c in caches])
        self.policy_state = {
            name: torch.cat([c.policy_state[name] for c in caches], dim) for name, dim in state.items()
        }
        self.device = caches[0].device

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    def lengths(self) -> Tensor:
        """``(L, R)`` int64 valid entries per layer and request."""
        return torch.stack([layer.lengths for layer in self.layers])

    def write_back(self) -> None:
        for layer in self.layers:
            layer.write_back()


def _key(request) -> tuple | None:
    """What requests of one cohort share beyond an equal policy: each layer's entries and capacity
    (the stacked tables' shapes) and the policy's state names present; None where the request's cache
    is not one the cohort takes (holes, low-rank factors: their edits rebuild the tables)."""
    cache = request.cache
    shape = []
    for layer in cache.layers:
        if layer.holes is not None or layer.lowrank is not None or layer.batch != 1:
            return None
        shape.append((layer.host_lengths()[0], layer.capacity, tuple(layer.scores)))
    return tuple(shape)


def cohorts(entries: list) -> list[list[int]]:
    """The group's entries (:class:`~vlkv.runtime.step_groups.Entry`) split into cohorts of indices:
    equal policies declaring ``cohort_decode`` on equally shaped caches, at the same step where the
    policy reads the step (``cohort_decode == "same_step"``), else having processed as many tokens
    (the same decode targets: each row drops what it would alone); every other entry alone."""
    out: list[list[int]] = []
    open_: list[tuple] = []  # (policy, key, step, members)
    for i, e in enumerate(entries):
        policy = e.request.policy
        mode = getattr(policy, "cohort_decode", None)
        key = _key(e.request) if mode else None
        if key is None:
            out.append([i])
            continue
        # "any_step": the same tokens processed (the same decode targets), else the same step
        step = e.ctx.step if mode == "same_step" else _processed(e.request)
        for p, k, s, members in open_:
            if k == key and s == step and type(p) is type(policy) and p == policy:
                members.append(i)
                break
        else:
            members = [i]
            open_.append((policy, key, step, members))
            out.append(members)
    return out


def _processed(request) -> int:
    """Tokens ``request`` has processed, from host values (its one prompt's padded length is its
    length; ``Request.prompt_tokens`` reads the device)."""
    return request.batch.input_ids.shape[1] + request.decode_steps


def cohort_context(ctxs: list[PolicyContext]) -> PolicyContext:
    """One :class:`PolicyContext` over the cohort's requests (their spans and prompt lengths, in order)."""
    first = ctxs[0]
    spans = [s for c in ctxs for s in c.spans]
    lengths = torch.cat([c.prompt_lengths for c in ctxs])
    return PolicyContext(spans, lengths, first.num_heads, first.num_kv_heads, first.step)


def cohort_stats(stats: StepStats, rows: list[int], batch: int, widths: list[int]) -> StepStats:
    """The group's step statistics for the cohort's ``rows`` (of the group's ``batch``), each layer
    ``l`` trimmed to the cohort's width ``widths[l]`` (its layers hold the same entries)."""
    whole = rows == list(range(batch))
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    pick = None if whole or contiguous else torch.tensor(rows, device=_device(stats))

    def take(t: Tensor | None) -> Tensor | None:
        if t is None or whole:
            return t
        return t.narrow(0, rows[0], len(rows)) if pick is None else t.index_select(0, pick)

    def cut(st, w):
        if st is None:
            return None
        colsum = take(st.colsum)
        if colsum.shape[2] != w:
            colsum = colsum.narrow(2, 0, w)
        return replace(st, colsum=colsum, below=take(st.below), visible=take(st.visible))

    layers = [cut(st, w) for st, w in zip(stats, widths)]
    extra = {n: [cut(st, w) for st, w in zip(v, widths)] for n, v in getattr(stats, "extra", {}).items()}
    return StepStats(layers, extra)


def _device(stats: StepStats):
    for st in [*stats, *(s for v in getattr(stats, "extra", {}).values() for s in v)]:
        if st is not None:
            return st.colsum.device
    return None


def split_edits(edits: list | None, n: int) -> list[list | None]:
    """A cohort's per-layer edits over ``n`` rows → per request its own per-layer edits (views of the
    rows, one ``split`` per tensor and layer)."""
    if edits is None:
        return [None] * n
    per: list[list] = [[] for _ in range(n)]
    for item in edits:
        for r, part in enumerate(_split(item, n)):
            per[r].append(part)
    return per


def _split(item, n: int) -> list:
    if item is None or isinstance(item, FactorEdit):
        return [item] * n
    if isinstance(item, tuple):
        parts = [_split(e, n) for e in item]
        return [tuple(p[r] for p in parts) for r in range(n)]
    if isinstance(item, CutEdit):
        starts, counts = item.start.split(1), item.count.split(1)
        host = [None] * n if item.host is None else [([s], [c]) for s, c in zip(*item.host)]
        return [CutEdit(s, c, h) for s, c, h in zip(starts, counts, host)]
    if isinstance(item, DropOneEdit):
        kept = [None] * n if item.kept is None else [[k] for k in item.kept]
        return [
            DropOneEdit(item.width, lens, k, cols)
            for lens, k, cols in zip(item.keep_len.split(1), kept, item.dropped.split(1))
        ]
    if isinstance(item, LayerEdit):
        rows = {
            name: None if getattr(item, name) is None else getattr(item, name).split(1)
            for name in ("index", "keep_len", "assign", "counts", "holes", "dropped")
        }
        kept = [None] * n if item.kept is None else [[k] for k in item.kept]
        return [
            LayerEdit(**{name: None if v is None else v[r] for name, v in rows.items()}, kept=kept[r])
            for r in range(n)
        ]
    raise TypeError(f"a cohort cannot split a {type(item).__name__} edit")


def decode_edits(entries: list, live: list[int], stats: StepStats, widths: list[list[int]] | None):
    """A decode group's policy edits: per live entry (indices into ``entries``, the group's
    :class:`~vlkv.runtime.step_groups.Entry` s) its policy's decode edits or the exception its policy
    raised, and the live entries grouped as their edits are to be applied (a cohort together).

    ``stats``: the group's step statistics; ``widths[i][l]``: entry ``i``'s layer widths (None: no
    statistics asked). A cohort's edits come from one policy call over its stacked
    caches; where that raises, each of its requests is rerun alone (nothing was written back)."""
    from vlkv.runtime.step_reads import slice_stats

    edits: dict = {}
    groups: list[list[int]] = []
    found = cohorts([entries[i] for i in live])
    for members in found:
        rows = [live[j] for j in members]
        if len(rows) > 1:
            try:
                policy = entries[rows[0]].request.policy
                view = CohortCache(
                    [entries[i].request.cache for i in rows], policy.cohort_state, policy.cohort_readonly
                )
                ctx = cohort_context([entries[i].ctx for i in rows])
                if widths is None:  # no statistics asked (local, elastic)
                    mine = StepStats([None] * len(stats))
                else:
                    mine = cohort_stats(stats, rows, len(entries), widths[rows[0]])
                made = policy.after_decode(view, mine, ctx)
                view.write_back()
                edits.update(zip(rows, split_edits(made, len(rows))))
                groups.append(rows)
                continue
            except Exception:  # each request alone: only a request whose policy raises alone fails
                pass
        for i in rows:
            r = entries[i].request
            try:
                edits[i] = r.policy.after_decode(r.cache, slice_stats(stats, i, widths), entries[i].ctx)
            except Exception as err:
                edits[i] = err
            groups.append([i])
    return edits, groups
