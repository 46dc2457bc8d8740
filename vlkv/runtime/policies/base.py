"""The policy side of the seam: statistics + cache metadata → what to keep / merge, per layer and sample.

A policy never calls the model. The engine asks it which statistics the next step needs
(:meth:`Policy.prefill_request`, :meth:`Policy.decode_request`), runs the step on whatever
backend, and hands the statistics back (:meth:`Policy.after_prefill`,
:meth:`Policy.after_decode`), which return :class:`LayerEdit` s that the engine applies to the
cache. The same policy object therefore drives every backend.

Budget semantics (shared by every policy, see ``docs/policies.md``):

* ``budget`` ∈ (0, 1] is the kept fraction. After prefill a layer keeps
  ``k_b = clamp(round(budget · n_b), min_keep, n_b)`` entries of sample ``b``'s ``n_b``-token prompt.
* Policies that evict while decoding (``local``, ``h2o``, ``elastic``) hold every layer at
  ``≤ round(budget · N_b)`` entries, ``N_b`` = tokens processed so far, so the cache keeps the
  same fraction as generation proceeds; one-shot policies (``snapkv``) only append after prefill.
* ``budget = 1`` never evicts anything, so it reproduces the full cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.cache import KVCache, LayerKV
from vlkv.runtime.policies.ranking import drop_one_each, kept_but, rank_entries
from vlkv.runtime.prompt import Spans

POSITION_MODES = ("original", "compacted")


@dataclass
class LayerEdit:
    """What to do with one layer's cache.

    Attributes:
        index: ``(B, H_kv, K)`` int64 slots to keep (anchors when merging), ascending within
            ``[:keep_len[b]]``; the tail is padding (any valid slot).
        keep_len: ``(B,)`` int64 entries kept per sample.
        assign: optional ``(B, H_kv, S)`` int64, for merging: for each of the first ``S`` slots the
            kept entry (index into ``[0, K)``) it is averaged into, or -1 to drop it.
        counts: ``(B, H_kv, K)`` int64 sources per kept entry (with ``assign``).
        holes: optional ``(B, H_kv, K)`` bool (selection only): listed columns that become holes for
            that KV head, so heads keep different numbers of entries (see :class:`LayerKV`).
        kept: optional ``keep_len``'s values on the host, where the policy knew them (the cache then
            reads nothing back to learn them).
        dropped: optional ``(B, H_kv, m)`` int64 table columns the edit drops, ascending, where the
            selection knew them (every sample holds the same count and drops ``m``): the cache frees
            them without searching ``index`` for the columns it does not list.
    """

    index: Tensor
    keep_len: Tensor
    assign: Tensor | None = None
    counts: Tensor | None = None
    holes: Tensor | None = None
    kept: list[int] | None = None
    dropped: Tensor | None = None

    def __post_init__(self) -> None:
        if self.dropped is not None and (
            self.dropped.dim() != 3 or tuple(self.dropped.shape[:2]) != tuple(self.index.shape[:2])
        ):
            raise ValueError(
                f"dropped must be (B, H_kv, m) = {tuple(self.index.shape[:2])} + (m,), got {tuple(self.dropped.shape)}"
            )
        if self.kept is not None and len(self.kept) != self.keep_len.shape[0]:
            raise ValueError(f"kept: one count per sample ({self.keep_len.shape[0]}), got {len(self.kept)}")
        if self.holes is not None:
            if self.assign is not None:
                raise ValueError("an edit either merges (assign) or punches holes, not both")
            if tuple(self.holes.shape) != tuple(self.index.shape):
                raise ValueError(
                    f"holes must be shaped like index {tuple(self.index.shape)}, got {tuple(self.holes.shape)}"
                )

    def built_index(self) -> Tensor | None:
        """``index`` where the edit holds it; None where it is built on first read (:class:`DropOneEdit`)."""
        return self.index


class DropOneEdit(LayerEdit):
    """A :class:`LayerEdit` whose rows each drop one known column ``dropped (B, H_kv, 1)`` of
    ``[0, width)`` (a per-step eviction's, H2O's). Its ``index``, every other column
    (``(B, H_kv, width - 1)`` int64: ~20 MB a step at h2o 0.5 over 8k × 4), is built on first read:
    the cache's one-call drop (``kv.drops``) closes the gaps from ``dropped`` alone and never reads it."""

    def __init__(self, width: int, keep_len: Tensor, kept: list[int] | None, dropped: Tensor):
        self.width = width
        super().__init__(None, keep_len, kept=kept, dropped=dropped)

    def __post_init__(self) -> None:
        if self.dropped.dim() != 3 or self.dropped.shape[2] != 1:
            raise ValueError(f"dropped must be (B, H_kv, 1), got {tuple(self.dropped.shape)}")
        if self.kept is not None and len(self.kept) != self.keep_len.shape[0]:
            raise ValueError(f"kept: one count per sample ({self.keep_len.shape[0]}), got {len(self.kept)}")

    @property
    def index(self) -> Tensor:
        if self._index is None:
            self._index = kept_but(self.dropped, self.width)
        return self._index

    @index.setter
    def index(self, value: Tensor | None) -> None:
        self._index = value

    def built_index(self) -> Tensor | None:
        return self._index


@dataclass
class CutEdit:
    """Delete a run of entries per sample, the later ones moving left in order (Elastic Cache's
    FIFO past its fixed point ``P``, StreamingLLM's oldest entries after the sinks). The cache copies
    only the columns after the cut (:meth:`LayerKV.cut`), where a :class:`LayerEdit` names every
    entry it keeps.

    Attributes:
        start: ``(B,)`` int64 first table column deleted from each sample.
        count: ``(B,)`` int64 entries deleted from ``start`` on (0: the sample is left as it is).
        host: optional ``(starts, counts)``, the same values on the host where the policy read them
            (the cache then reads nothing back: a per-step cut reads once per step, not per layer).
    """

    start: Tensor
    count: Tensor
    host: tuple[list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.start.dim() != 1 or self.start.shape != self.count.shape:
            raise ValueError(
                f"start and count must both be (B,), got {tuple(self.start.shape)} and {tuple(self.count.shape)}"
            )
        if self.host is not None and any(len(h) != self.start.shape[0] for h in self.host):
            raise ValueError(f"host: (starts, counts), one per sample ({self.start.shape[0]}) each")


@dataclass
class FactorEdit:
    """Hold some of one layer's entries as low-rank factors (AttentionPack), applied by the engine
    (:func:`vlkv.runtime.kv.lowrank.apply_factor_edit`: the factoring, then the ranks by importance,
    which ``runtime/edits.py`` sets for many layers and requests at once) on the table as it is when
    the edit is applied.

    Attributes:
        rank: components kept for keys and values, >= 1.
        modalities: :class:`~vlkv.runtime.cache.Modality` codes whose dense entries are factored (None =
            every entry).
        threshold: a sample is factored only once it holds at least this many such dense entries in
            one KV head (1 at prefill; the recompression cadence while decoding), >= 1.
        importance: name of a per-entry running score (``LayerKV.scores``) that ranks each sample's
            factor rows: the ``top_fraction`` best are reconstructed with ``rank`` components, the rest
            with ``rank_lo`` (keys too when ``lo_keys``); None = every row at ``rank``.
        exact: exact SVD instead of the randomized one.
        post_rope: factor keys after RoPE, for attention in the rank space (path (b)); default
            before RoPE, reconstructed and rotated on read (path (a)).
        due: which samples are due (one bool per sample of the cache it is applied to), decided on the
            host by the policy; None = the engine counts each sample's entries against ``threshold``,
            a read back of the layer's table.
    """

    rank: int
    modalities: frozenset[int] | None = None
    threshold: int = 1
    importance: str | None = None
    rank_lo: int | None = None
    top_fraction: float = 1.0
    lo_keys: bool = True
    exact: bool = False
    post_rope: bool = False
    due: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.rank < 1 or self.threshold < 1:
            raise ValueError(f"rank and threshold must be >= 1, got {self.rank} and {self.threshold}")
        if self.importance is not None and not (
            self.rank_lo is not None and 1 <= self.rank_lo <= self.rank and 0.0 < self.top_fraction <= 1.0
        ):
            raise ValueError("an importance ranking needs rank_lo in [1, rank] and top_fraction in (0, 1]")


@dataclass
class PolicyContext:
    """Batch facts a policy may read.

    Attributes:
        spans: modality spans per sample.
        prompt_lengths: ``(B,)`` int64.
        num_heads, num_kv_heads: attention layout (GQA group = num_heads // num_kv_heads).
        step: 0 at prefill, t at the t-th decode step.
    """

    spans: list[Spans]
    prompt_lengths: Tensor
    num_heads: int
    num_kv_heads: int
    step: int = 0


def check_range(name: str, value: float, low: float, high: float, low_open: bool = True) -> None:
    """Raise ``ValueError`` naming the field and its allowed range."""
    ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise ValueError(f"{name} must be in {lo}{low}, {high}], got {value}")


@dataclass
class Policy:
    """Base policy: keeps everything. Subclasses override the hooks they need.

    Attributes:
        budget: kept fraction in (0, 1] (see the module docstring).
        positions: ``"original"`` — new tokens continue the prompt's original numbering;
            ``"compacted"`` — a new token's position is the current cache length (plus the
            M-RoPE offset), as Elastic Cache's reference code does.
    """

    budget: float = 1.0
    positions: str = "original"

    name: ClassVar[str] = "base"
    evicts_during_decode: ClassVar[bool] = False
    # its decode hook splits into observe() (every step) + decode_edits(), so a cadence wrapper
    # may skip the edits on some steps without losing statistics
    can_defer_edits: ClassVar[bool] = False
    # budget = 1 reproduces the full cache exactly; False for policies that compress by another
    # knob (attnpack's rank), whose lossless setting is their own
    exact_at_full_budget: ClassVar[bool] = True
    # its decode hook may run once over several requests' caches stacked (``policies.cohort``): it
    # reads only the layers' lengths, capacity and running scores, the cache's ``processed`` and the
    # ``policy_state`` entries named in ``cohort_state`` (name -> sample dim). ``"any_step"``: requests
    # at different steps share a run; ``"same_step"``: the hook reads ``ctx.step``; None: never batched
    cohort_decode: ClassVar[str | None] = None
    cohort_state: ClassVar[dict[str, int]] = {}
    cohort_readonly: ClassVar[frozenset[str]] = frozenset()  # score tables the decode hook only reads

    def __post_init__(self) -> None:
        check_range("budget", self.budget, 0.0, 1.0)
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")

    # hooks ------------------------------------------------------------------
    def prefill_request(self, ctx: PolicyContext, rows: int) -> StatsRequest | None:
        """Statistics needed from the prefill step (``rows`` = padded prompt length)."""
        return None

    def decode_request(self, cache: KVCache, ctx: PolicyContext) -> StatsRequest | None:
        return None

    def after_prefill(self, cache: KVCache, stats: list, ctx: PolicyContext) -> list[LayerEdit | None] | None:
        return None

    def after_decode(self, cache: KVCache, stats: list, ctx: PolicyContext) -> list[LayerEdit | None] | None:
        if not self.can_defer_edits:
            return None
        self.observe(cache, stats, ctx)
        return self.decode_edits(cache, ctx)

    def observe(self, cache: KVCache, stats: list, ctx: PolicyContext) -> None:
        """Fold a decode step's statistics into the running scores (no edit)."""

    def decode_edits(self, cache: KVCache, ctx: PolicyContext) -> list[LayerEdit | None] | None:
        """The decode-time edits from the running scores (after :meth:`observe`)."""
        return None

    def prefill_filter(self, cache: KVCache, ctx: PolicyContext):
        """Rows to drop inside the prefill layer loop (A-VL's filter P), or None."""
        return None

    def decode_attend(self, cache: KVCache, ctx: PolicyContext):
        """Per layer, the past entries the next decode step attends to (None = all), or None."""
        return None

    # shared arithmetic ------------------------------------------------------
    def prompt_keep(self, n: Tensor, min_keep: int = 1) -> Tensor:
        """``(B,)`` entries kept after prefill for prompt lengths ``n (B,)``."""
        k = torch.round(n.double() * self.budget).long()
        return torch.minimum(torch.clamp(k, min=min_keep), n)

    def decode_target(self, cache: KVCache, min_keep: int = 1) -> Tensor:
        """``(B,)`` most entries a decode-evicting policy may hold now."""
        return torch.round(cache.processed.double() * self.budget).long().clamp(min=min_keep)


# ---------------------------------------------------------------- helpers
def per_kv_head(colsum: Tensor, num_kv_heads: int) -> Tensor:
    """``(B, H, S)`` per-query-head scores → ``(B, H_kv, S)`` summed over each GQA group."""
    b, h, s = colsum.shape
    return colsum.view(b, num_kv_heads, h // num_kv_heads, s).sum(2)


def layer_wide(colsum: Tensor, num_kv_heads: int) -> Tensor:
    """``(B, H, S)`` → ``(B, H_kv, S)``: the head mean, shared by every KV head."""
    return colsum.mean(1, keepdim=True).expand(-1, num_kv_heads, -1)


def valid_slots(layer: LayerKV, width: int) -> Tensor:
    """``(B, 1, width)`` bool, True where the slot holds a valid entry."""
    return (torch.arange(width, device=layer.lengths.device)[None, :] < layer.lengths[:, None])[:, None]


def evict_to(cache: KVCache, target: Tensor, score, force) -> list[LayerEdit | None]:
    """Per layer, keep at most ``target[b]`` entries: the best by ``score(layer, width)``
    (``(B, H_kv, width)``), with ``force(layer, width, keep)`` (``(B, 1 or H_kv, width)`` bool) always in.
    Layers already within the target get no edit. See :func:`select_top` (the same, per-layer targets)."""
    layers = cache.layers
    return select_top(cache, [target] * len(layers), lambda i, width: score(layers[i], width), force)


def select_top(cache: KVCache, targets: list[Tensor], score, force) -> list[LayerEdit | None]:
    """Per layer ``i``, keep at most ``targets[i][b]`` entries: the best by ``score(i, width)``
    (``(B, H_kv, width)``, higher = keep), with ``force(layer, width, keep)`` (``(B, 1 or H_kv, width)``
    bool, or None) always in, counted within the target. Layers already within it get no edit.

    ``force`` may depend on a layer only through its lengths: layers holding the same lengths and
    targets (every layer of a uniform per-step policy) are ranked in one :func:`top_entries` call over
    their stacked scores, with one ``force`` mask — the same picks as one call per layer, at one call's
    cost."""
    edits: list[LayerEdit | None] = [None] * len(cache.layers)
    lengths = [layer.host_lengths() for layer in cache.layers]  # kept on the host by the cache
    if all(t is targets[0] for t in targets):  # one target for every layer (a per-step policy)
        wants = [targets[0].tolist()] * len(targets)  # the one read back
    else:
        wants = torch.stack([t.to(cache.layers[0].device) for t in targets]).tolist()
    groups: dict[tuple, list[int]] = {}
    for i, (row, want) in enumerate(zip(lengths, wants)):
        if any(n > w for n, w in zip(row, want)):
            groups.setdefault((tuple(row), tuple(want)), []).append(i)
    for (row, want), members in groups.items():
        first = cache.layers[members[0]]
        width = max(row)
        kept = [min(n, w) for n, w in zip(row, want)]
        keep = torch.minimum(targets[members[0]].to(first.lengths.device), first.lengths)
        per = [score(i, width) for i in members]  # (B, H_kv, width) each
        valid, forced = valid_slots(first, width), force(first, width, keep)
        index, keep_len, dropped = rank_layers(
            per, valid, forced, keep, kept, rows=list(row), per_row=getattr(first, "per_row_edits", False)
        )
        group_edits(edits, members, width, kept, index, keep_len, dropped)
    return edits


def rank_layers(
    per: list[Tensor],
    valid: Tensor,
    forced: Tensor | None,
    keep: Tensor,
    kept: list[int],
    one_len: Tensor | None = None,
    rows: list[int] | None = None,
    per_row: bool = False,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """One group of layers holding the same lengths and targets, ranked together.

    Args:
        per: the layers' ``(B, H_kv, width)`` scores.
        valid: ``(B, H_kv, width)`` bool, the live slots; ``forced``: the same shape, always kept (or None).
        keep: ``(B,)`` entries each sample keeps; ``kept``: the same on the host.
        one_len: ``(B,)`` each sample's kept count when every row drops its one lowest (default: its
            live entries, at most ``keep``).
        rows: the entries each sample holds (host), where the samples may hold different counts: each
            row dropping one of its own (``kept[b] == rows[b] - 1``) is then a one-column drop too.
        per_row: the edits are split per sample before they are applied (a scheduler cohort,
            ``policies.cohort``): samples keeping all they hold may sit beside the ones dropping one
            (their dropped column is not read).

    Returns ``(index, keep_len, dropped)`` over the ``G·B`` stacked rows: where every row drops its one
    lowest (H2O's step) one pass over the tables where they lie, ``index`` None (built where read,
    :class:`DropOneEdit`) and ``keep_len`` ``one_len`` per layer; else one :func:`rank_entries` call.
    """
    g = len(per)
    dropped = drop_one_each(per, valid, forced, kept, rows, per_row)
    if dropped is not None:
        if one_len is None:
            one_len = torch.minimum(keep, valid[:, 0].sum(-1))
        return None, one_len.repeat(g), dropped
    scores = torch.cat(per)  # (G·B, H_kv, width)
    if g > 1:
        valid = valid.repeat(g, 1, 1)
        forced = None if forced is None else forced.repeat(g, 1, 1)
    return rank_entries(scores, valid, keep.repeat(g), forced, kept * g)


def group_edits(
    edits: list, members: list[int], width: int, kept: list[int], index, keep_len: Tensor, dropped
) -> None:
    """Each member layer's edit from :func:`rank_layers`'s stacked result, into ``edits``; each layer's
    rows as views (one split per tensor, not a slice per layer and tensor)."""
    b = len(kept)
    gone = [None] * len(members) if dropped is None else dropped.split(b)
    rows = [None] * len(members) if index is None else index.split(b)
    for i, idx, lens, cols in zip(members, rows, keep_len.split(b), gone):
        if idx is None:
            edits[i] = DropOneEdit(width, lens, kept, cols)
        else:
            edits[i] = LayerEdit(idx, lens, kept=kept, dropped=cols)


def recent_mask(lengths: Tensor, width: int, recent: Tensor) -> Tensor:
    """``(B, 1, width)`` bool: the last ``recent[b]`` valid slots of each sample."""
    j = torch.arange(width, device=lengths.device)[None, :]
    return ((j >= (lengths - recent)[:, None]) & (j < lengths[:, None]))[:, None]


def sink_mask(lengths: Tensor, width: int, sinks: int) -> Tensor:
    """``(B, 1, width)`` bool: the first ``sinks`` slots."""
    j = torch.arange(width, device=lengths.device)[None, :]
    return ((j < sinks) & (j < lengths[:, None]))[:, None]
