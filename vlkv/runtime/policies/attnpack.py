"""``attnpack`` (AttentionPack): image K/V held as joint-head low-rank factors, decompressed by importance.

After prefill every layer's image entries (per sample) become rank-``rank`` factors of their pre-RoPE
keys and values (:mod:`vlkv.runtime.kv.lowrank`); text stays dense. Each step the last query row's
attention onto the cache, averaged over heads, updates an EMA importance ``I ← α·I + (1 − α)·a``;
the ``top_fraction`` most important factored rows are reconstructed with ``rank`` components, the
others with ``rank_lo`` (values always, keys too when ``lo_keys``). With ``compress_text`` the text
is factored as well, and every ``recompress_every`` new dense tokens the held rows and the new ones
are factored again together (the appendix's Algorithm 1).

Composition with eviction: ``evict=NAME`` (a registered per-entry policy at this ``budget``) evicts
first and the survivors are factored (at prefill); later decode evictions drop factor rows no head
names any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from vlkv.runtime.backend import StatsRequest
from vlkv.runtime.cache import KVCache, Modality
from vlkv.runtime.kv.lowrank import factorable_counts
from vlkv.runtime.policies.base import FactorEdit, Policy, check_range, layer_wide

SCORE = "attnpack"
EXTRA = "attnpack"
# cache.policy_state key: per layer, per sample (host ints) an upper bound on the most dense entries of
# the factored modalities one KV head holds after this step's edits; absent = unknown (counted)
STATE_DENSE = "attnpack_dense"


@dataclass
class AttnPackPolicy(Policy):
    """Attributes:
    rank: components kept (and used for the important rows), >= 1.
    rank_lo: components the unimportant rows are reconstructed with, in [1, rank]; default rank // 4
        (16 at rank 64); ``rank_lo = rank`` turns attention-aware decompression off.
    top_fraction: share of factored rows reconstructed with ``rank``, in (0, 1].
    alpha: EMA weight of the old importance, in [0, 1).
    recompress_every: new dense compressible tokens that trigger a re-factoring, >= 1.
    lo_keys: apply ``rank_lo`` to keys too (the authors' code) or to values only (the appendix).
    compress_text: factor text and generated tokens too (the paper does not, for image QA).
    evict: a registered eviction policy run first at ``budget`` ("" = none).
    exact: exact SVD instead of the randomized one (slower; tests).
    path: ``a`` — pre-RoPE factors, reconstructed and rotated every step (the authors' choice);
        ``b`` — post-RoPE factors, decode attention computed in the rank space (never rebuilding
        the dense image K/V); prefill and multi-row steps reconstruct.
    """

    rank: int = 64
    rank_lo: int | None = None
    top_fraction: float = 0.25
    alpha: float = 0.5
    recompress_every: int = 256
    lo_keys: bool = True
    compress_text: bool = False
    evict: str = ""
    exact: bool = False
    path: str = "a"
    inner: Policy | None = field(default=None, init=False, repr=False)

    name: ClassVar[str] = "attnpack"
    # it compresses by rank: full rank (not budget 1) is the lossless setting
    exact_at_full_budget: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.rank_lo is None:
            self.rank_lo = max(1, self.rank // 4)
        if not 1 <= self.rank_lo <= self.rank:
            raise ValueError(f"rank_lo must be in [1, rank={self.rank}], got {self.rank_lo}")
        check_range("top_fraction", self.top_fraction, 0.0, 1.0)
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")
        if self.path not in ("a", "b"):
            raise ValueError(f"path must be 'a' (reconstruct) or 'b' (rank space), got {self.path!r}")
        if self.recompress_every < 1:
            raise ValueError(f"recompress_every must be >= 1, got {self.recompress_every}")
        if self.evict:
            if self.evict == self.name:
                raise ValueError("evict must name an eviction policy, not attnpack")
        elif self.budget != 1.0:
            raise ValueError(f"budget must be 1 without evict=NAME, got {self.budget}")

    def inner_spec(self) -> tuple[str, dict] | None:
        """The eviction policy run first (``evict=NAME`` at this ``budget``); the registry builds it."""
        return (self.evict, {"budget": self.budget}) if self.evict else None

    @property
    def evicts_during_decode(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self.inner.evicts_during_decode

    # statistics ------------------------------------------------------------
    def _with_inner(self, mine: StatsRequest, theirs: StatsRequest | None) -> StatsRequest:
        if self.inner is None:
            return mine
        theirs = theirs or StatsRequest()
        return StatsRequest(theirs.rows, theirs.threshold, theirs.layers, {**theirs.extra, EXTRA: mine})

    def _mine(self, stats: list) -> list:
        return stats.extra[EXTRA] if self.inner is not None else stats

    def prefill_request(self, ctx, rows):
        n = ctx.prompt_lengths
        last = torch.arange(rows, device=n.device)[None, :] == (n - 1)[:, None]
        inner = self.inner.prefill_request(ctx, rows) if self.inner is not None else None
        return self._with_inner(StatsRequest(rows=last), inner)

    def decode_request(self, cache, ctx):
        inner = self.inner.decode_request(cache, ctx) if self.inner is not None else None
        return self._with_inner(StatsRequest(), inner)

    def _observe(self, cache: KVCache, stats: list, ctx, first: bool) -> None:
        for layer, st in zip(cache.layers, self._mine(stats)):
            score = layer.ensure_score(SCORE)
            a = layer_wide(st.colsum.float(), ctx.num_kv_heads)
            s = min(a.shape[-1], score.shape[-1])
            score[:, :, :s] = (
                a[..., :s] if first else self.alpha * score[:, :, :s] + (1 - self.alpha) * a[..., :s]
            )

    # factoring -------------------------------------------------------------
    def _factor_edit(self, threshold: int) -> FactorEdit:
        """What to factor (the engine applies it): image entries, or every entry with ``compress_text``;
        importance-ranked reconstruction ranks from the EMA score."""
        return FactorEdit(
            rank=self.rank,
            modalities=None if self.compress_text else frozenset({int(Modality.IMAGE)}),
            threshold=threshold,
            importance=SCORE,
            rank_lo=self.rank_lo,
            top_fraction=self.top_fraction,
            lo_keys=self.lo_keys,
            exact=self.exact,
            post_rope=self.path == "b",
        )

    # hooks -----------------------------------------------------------------
    def _each_layer(self, cache: KVCache, edits, factor_first: bool, due=None) -> list[tuple]:
        """Per layer, the inner eviction's edit and the factoring, in the order they apply; ``due[l]``
        the samples due in layer ``l`` where decided on the host (None: counted when applied)."""
        f = self._factor_edit(1 if not factor_first else self.recompress_every)
        edits = edits or [None] * len(cache.layers)
        fs = [f] * len(edits) if due is None else [replace(f, due=d) for d in due]
        return [(fl, e) if factor_first else (e, fl) for fl, e in zip(fs, edits)]

    def _decode_due(self, cache: KVCache) -> list[tuple[bool, ...]]:
        """Per layer, which samples this decode step's factoring is due in, known on the host.

        The bound of :data:`STATE_DENSE` grows by the one entry a decode step appends, where its
        modality (generated) is factored at all (``compress_text``); image-only factoring never grows
        it. While every bound is under ``recompress_every`` nothing is due and nothing is read; else
        every layer's counts come back in one read (not one per layer), and the bound is exact again:
        0 where the edit factors, the count elsewhere."""
        edit = self._factor_edit(self.recompress_every)
        mods, thr = edit.modalities, edit.threshold
        grow = int(mods is None or int(Modality.GENERATED) in mods)
        shape = [layer.batch for layer in cache.layers]
        bound = cache.policy_state.get(STATE_DENSE)
        if bound is not None and [len(row) for row in bound] == shape:
            bound = [[n + grow for n in row] for row in bound]
            if all(n < thr for row in bound for n in row):
                cache.policy_state[STATE_DENSE] = bound
                return [(False,) * b for b in shape]
        counts = factorable_counts(cache.layers, mods)  # the step's one read back
        due = [tuple(n >= thr for n in row) for row in counts]
        cache.policy_state[STATE_DENSE] = [
            [0 if d else n for n, d in zip(row, ds)] for row, ds in zip(counts, due)
        ]
        return due

    def after_prefill(self, cache, stats, ctx):
        self._observe(cache, stats, ctx, first=True)  # stats index the prefill table: before edits
        inner = self.inner.after_prefill(cache, stats, ctx) if self.inner is not None else None
        # factoring at threshold 1 applies last in every layer: it leaves no dense factorable entry
        cache.policy_state[STATE_DENSE] = [[0] * layer.batch for layer in cache.layers]
        return self._each_layer(cache, inner, factor_first=False)  # evict first: survivors are factored

    def after_decode(self, cache, stats, ctx):
        self._observe(cache, stats, ctx, first=False)
        due = self._decode_due(cache)  # the table the factoring applies to: it applies first
        inner = self.inner.after_decode(cache, stats, ctx) if self.inner is not None else None
        if any(_densifies(e) for e in inner or []):
            # a merge densifies the layer's factors after the factoring: the bound no longer holds
            cache.policy_state.pop(STATE_DENSE, None)
        return self._each_layer(cache, inner, factor_first=True, due=due)


def _densifies(item) -> bool:
    """Whether a layer's edit (or tuple of edits) writes factored entries back dense: a merge does
    (``LayerEdit.assign``); a selection or a cut only drops entries."""
    if isinstance(item, tuple):
        return any(_densifies(e) for e in item)
    return getattr(item, "assign", None) is not None
