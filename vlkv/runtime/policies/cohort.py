"""A cohort: the requests of one decode step that run equal policies, whose decode-time bookkeeping
runs once for all of them, whatever their lengths.

The scheduler keeps one single-sample cache per request, so a policy's ``after_decode`` called per
request repeats every op of its statistics and ranking (the running scores' update, the targets,
the protected windows, the ranking) once per request and layer: at batch 4 the scheduler path
dispatched ~4x the policy ops of ``Engine.decode`` over one batched cache. Here the requests of a
decode group whose policies are equal (dataclass equality) and whose caches are dense (no holes, no
low-rank factors) are stacked into a :class:`CohortCache`: per layer the running score tables
concatenated (``(R, H_kv, C)``, ``C`` the largest capacity: a shorter table is padded, one ``cat`` per
layer and table), the lengths likewise. The policy runs once over that batch — the same per-row
arithmetic as over each request alone: its ops are per row (sums, masks, per-row rankings over each
row's own ``lengths``; columns past a row's length rank as no entry) — the score tables it may change
are copied back with one ``_foreach_copy_`` per layer and table (each row its own columns), and its
per-layer edits are split into each request's rows (one ``split`` per tensor): a row keeping every
entry of a layer gets no edit there, as alone. Rows of different lengths are the common case: the
requests of a serving step almost never hold equal lengths.

Which policies: those whose decode hook reads only what :class:`CohortLayer` holds (the layer's
``lengths``, host lengths, capacity, running ``scores``; the cache's ``processed`` and the
``policy_state`` entries named by :attr:`Policy.cohort_state`) declare ``cohort_decode``; the others
(and any request the cohort cannot take) keep the per-request call. A cohort that raises is rerun
request by request, its stacked copies dropped: nothing is written back before the policy returns.

A :class:`CohortLayer` says ``per_row_edits``: its edits are split per row before they are applied,
so a selection may hand rows that keep everything an edit beside rows that drop
(:func:`~vlkv.runtime.policies.base.rank_layers`: one drop per row over rows of any lengths).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.runtime.backend import StepStats
from vlkv.runtime.policies.base import CutEdit, DropOneEdit, FactorEdit, LayerEdit, PolicyContext

__all__ = ["CohortCache", "CohortLayer", "cohort_attends", "cohorts", "decode_edits", "split_edits"]


class CohortLayer:
    """One layer of a :class:`CohortCache`: ``R`` one-sample layers (any lengths and capacities) seen as
    one ``R``-sample layer of capacity ``C``, the largest. Its running scores are stacked copies
    (``(R, H_kv, C)``, shorter tables padded with zeros past their capacity), written back by
    :meth:`write_back` (all but the ones the policy only reads; each row its own columns)."""

    # the edits of this layer are split per row before they are applied (``split_edits``)
    per_row_edits = True

    def __init__(self, rows: list, readonly: frozenset[str] = frozenset()):
        self.rows = rows
        first = rows[0]
        self.batch, self.kv_heads, self.layer = len(rows), first.kv_heads, first.layer
        self.capacity, self.device = max(r.capacity for r in rows), first.device
        self._host = [n for r in rows for n in r.host_lengths()]
        self.lengths = torch.cat([r.lengths for r in rows])  # (R,) int64
        self.scores = _StackedScores(rows, self.capacity, readonly)

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
    """``name → (R, H_kv, C)`` stacked copies of the rows' running score tables, made on first read
    (a table narrower than ``C`` padded with zeros: columns past a row's length, never read as
    entries); all but the ``readonly`` ones are copied back, each row its own ``C_r`` columns."""

    def __init__(self, rows: list, capacity: int, readonly: frozenset[str] = frozenset()):
        super().__init__()
        self._rows, self._readonly, self._capacity = rows, readonly, capacity
        self._made: list[str] = []

    def __missing__(self, name: str) -> Tensor:
        c = self._capacity
        tables = [r.scores[name] for r in self._rows]
        # ``pad``: one op per narrower table (a ragged step's rows hold different capacities)
        stacked = torch.cat([t if t.shape[2] == c else F.pad(t, (0, c - t.shape[2])) for t in tables])
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
                dst = [r.scores[name] for r in self._rows]
                src = [
                    s if d.shape[2] == s.shape[2] else s.narrow(2, 0, d.shape[2])
                    for d, s in zip(dst, stacked.split(1))
                ]
                torch._foreach_copy_(dst, src)


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
    """What requests of one cohort share beyond an equal policy: the layers' running score tables (the
    names the stacked layers hold); None where the request's cache is not one the cohort takes
    (holes, low-rank factors: their edits rebuild the tables). Lengths and capacities may differ."""
    cache = request.cache
    shape = []
    for layer in cache.layers:
        if layer.holes is not None or layer.lowrank is not None or layer.batch != 1:
            return None
        shape.append(tuple(layer.scores))
    return tuple(shape)


def cohorts(entries: list) -> list[list[int]]:
    """The group's entries (:class:`~vlkv.runtime.step_groups.Entry`) split into cohorts of indices:
    equal policies declaring ``cohort_decode`` on dense caches keeping the same running scores, at the
    same step where the policy reads the step (``cohort_decode == "same_step"``), else at any step and
    any lengths (each row's targets and drops are its own: the policy's arithmetic is per row); every
    other entry alone."""
    out: list[list[int]] = []
    open_: list[tuple] = []  # (policy, key, step, members)
    for i, e in enumerate(entries):
        policy = e.request.policy
        mode = getattr(policy, "cohort_decode", None)
        key = _key(e.request) if mode else None
        if key is None:
            out.append([i])
            continue
        step = e.ctx.step if mode == "same_step" else None
        for p, k, s, members in open_:
            if k == key and s == step and type(p) is type(policy) and p == policy:
                members.append(i)
                break
        else:
            members = [i]
            open_.append((policy, key, step, members))
            out.append(members)
    return out


def cohort_context(ctxs: list[PolicyContext]) -> PolicyContext:
    """One :class:`PolicyContext` over the cohort's requests (their spans and prompt lengths, in order)."""
    first = ctxs[0]
    spans = [s for c in ctxs for s in c.spans]
    lengths = torch.cat([c.prompt_lengths for c in ctxs])
    return PolicyContext(spans, lengths, first.num_heads, first.num_kv_heads, first.step)


def cohort_stats(stats: StepStats, rows: list[int], batch: int, widths: list[int]) -> StepStats:
    """The group's step statistics for the cohort's ``rows`` (of the group's ``batch``), each layer
    ``l`` trimmed to the cohort's width ``widths[l]`` (its widest row's; a shorter row's columns past
    its length hold no entry's attention)."""
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


def split_edits(edits: list | None, n: int, held: list[list[int]] | None = None) -> list[list | None]:
    """A cohort's per-layer edits over ``n`` rows → per request its own per-layer edits (views of the
    rows, one ``split`` per tensor and layer).

    ``held[l][r]``: the entries row ``r`` holds in layer ``l`` before the edits, where known: a row
    keeping all of them (a selection's ``kept``, a cut of none) then gets no edit there — what its
    policy gives it alone —, a one-column drop the row's own width, and a selection's index is cut to
    the row's own kept count (the width its ranking alone returns)."""
    if edits is None:
        return [None] * n
    per: list[list] = [[] for _ in range(n)]
    for i, item in enumerate(edits):
        for r, part in enumerate(_split(item, n, None if held is None else held[i])):
            per[r].append(part)
    return per


def _split(item, n: int, held: list[int] | None = None) -> list:
    if item is None or isinstance(item, FactorEdit):
        return [item] * n
    if isinstance(item, tuple):
        parts = [_split(e, n) for e in item]
        return [tuple(p[r] for p in parts) for r in range(n)]
    if isinstance(item, CutEdit):
        starts, counts = item.start.split(1), item.count.split(1)
        host = [None] * n if item.host is None else [([s], [c]) for s, c in zip(*item.host)]
        return [
            None if h is not None and held is not None and h[1][0] == 0 else CutEdit(s, c, h)
            for s, c, h in zip(starts, counts, host)
        ]
    kept = [None] * n if item.kept is None else [[k] for k in item.kept]
    # a row keeping every entry it holds: no edit (its selection alone was never made)
    same = [held is not None and k is not None and k[0] == m for k, m in zip(kept, held or [None] * n)]
    if isinstance(item, DropOneEdit):
        widths = [item.width] * n if held is None else held
        return [
            None if skip else DropOneEdit(w, lens, k, cols)
            for skip, w, lens, k, cols in zip(
                same, widths, item.keep_len.split(1), kept, item.dropped.split(1)
            )
        ]
    if isinstance(item, LayerEdit):
        keeps_all = item.assign is None and item.holes is None
        rows = {
            name: None if getattr(item, name) is None else getattr(item, name).split(1)
            for name in ("index", "keep_len", "assign", "counts", "holes", "dropped")
        }
        out = []
        for r in range(n):
            if keeps_all and same[r]:
                out.append(None)
                continue
            parts = {name: None if v is None else v[r] for name, v in rows.items()}
            width = parts["index"].shape[2]
            if keeps_all and kept[r] is not None and width > max(kept[r][0], 1):
                parts["index"] = parts["index"].narrow(2, 0, max(kept[r][0], 1))
            out.append(LayerEdit(**parts, kept=kept[r]))
        return out
    raise TypeError(f"a cohort cannot split a {type(item).__name__} edit")


def cohort_attends(entries: list) -> dict[int, list | None]:
    """The attend lists of the step's entries (:class:`~vlkv.runtime.step_groups.Entry`, their
    ``attend`` not yet asked) whose cohort's policy lists them for every row at once
    (``cohort_attend``, A-VL's core attention): entry index → that entry's lists (None: it reads
    everything), as its policy's ``decode_attend`` gives them alone. Entries of no such cohort, or of a
    cohort whose call raised (each is then asked alone), are left out."""
    out: dict[int, list | None] = {}
    for members in cohorts(entries):
        policy = entries[members[0]].request.policy
        attend = getattr(policy, "cohort_attend", None)
        if len(members) < 2 or attend is None:
            continue
        restricts = getattr(policy, "restricts_attention", None)
        if restricts is not None and not restricts(entries[members[0]].ctx):  # one step: nothing listed
            out.update((i, None) for i in members)
            continue
        try:
            view = CohortCache([entries[i].request.cache for i in members], {})
            rows = attend(view, cohort_context([entries[i].ctx for i in members]))
        except Exception:  # each request alone: only a request whose policy raises alone fails
            continue
        out.update(zip(members, rows))
    return out


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
                else:  # per layer the widest row's width
                    mine = cohort_stats(
                        stats, rows, len(entries), [max(w) for w in zip(*(widths[i] for i in rows))]
                    )
                held = [layer.host_lengths() for layer in view.layers]  # before the edits
                made = policy.after_decode(view, mine, ctx)
                view.write_back()
                edits.update(zip(rows, split_edits(made, len(rows), held)))
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
