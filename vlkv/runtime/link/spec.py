"""What a request asks of linking (:class:`LinkSpec`) and what one link step did (:class:`LinkStats`).

Their own module so that the linker, CacheBlend, the request and the server share them without
importing the linker.
"""

from __future__ import annotations

from dataclasses import dataclass

LINK_METHODS = ("none", "prefix", "full-reuse", "cacheblend", "mpic")
DEVIATIONS = ("k", "v")
PICKS = ("first", "ramp")  # MPIC's choice of recomputed tokens (vlkv.runtime.link.picks)


def link_label(
    method: str,
    k: int,
    r: float | None = None,
    pick: str = "first",
    store_budget: float = 1.0,
    store_rank: int = 0,
    store_scorer: str | None = None,
    deviation: str | None = None,
) -> str:
    """The one name of a linking method in reports, saved checks and refusals: ``mpic-32``,
    ``mpic-ramp-32``, ``cacheblend-r0.15`` (``-v`` when it checks values), ``prefix``, with the records'
    compression — ``(records at 0.5, keynorm)``, ``(records at rank 8)`` — when there is any.
    ``store_scorer`` / ``deviation``: left out where the caller does not know them (a saved check)."""
    if method == "mpic":
        name = f"mpic-{k}" if pick == "first" else f"mpic-{pick}-{k}"
    elif method == "cacheblend":
        name = f"cacheblend-r{r:g}" + ("-v" if deviation == "v" else "")
    else:
        name = method
    if store_budget < 1.0:
        name += f" (records at {store_budget:g}" + (f", {store_scorer})" if store_scorer else ")")
    return name if not store_rank else f"{name} (records at rank {store_rank})"


@dataclass(frozen=True)
class LinkSpec:
    """How a request reuses stored K/V.

    Attributes:
        method: one of :data:`LINK_METHODS`.
        k: MPIC's recomputed leading tokens per image, >= 0.
        r: CacheBlend's recomputed fraction of the stored image tokens, in [0, 1].
        deviation: CacheBlend's check — ``"k"`` (keys, as LMCache) or ``"v"`` (values, as the
            CacheBlend repository).
        store_budget: fraction of an image's entries kept in the records this request writes, in
            (0, 1]; below 1 the records are compressed (:mod:`vlkv.runtime.link.compress`).
        store_scorer: how a compressed record chooses its entries (``keynorm`` or ``stride``).
        pick: MPIC's choice of the recomputed tokens (:mod:`vlkv.runtime.link.picks`): ``first``
            (each image's first ``k``, MPIC) or ``ramp`` (``k`` per image on average, more for later
            images).
        store_rank: 0 (dense records) or the rank R of low-rank records: each layer's kept
            pre-RoPE K and V (``(m, H_kv·D)``, heads concatenated) held as truncated-SVD factors
            (AttentionPack's joint-head layout), so a hit from disk or a remote tier moves
            ``2·R·(m + H_kv·D)`` numbers per layer instead of ``2·m·H_kv·D``.
    """

    method: str = "mpic"
    k: int = 32
    r: float = 0.15
    deviation: str = "k"
    store_budget: float = 1.0
    store_scorer: str = "keynorm"
    store_rank: int = 0
    pick: str = "first"

    def __post_init__(self) -> None:
        if self.method not in LINK_METHODS:
            raise ValueError(f"unknown link method {self.method!r}; known: {', '.join(LINK_METHODS)}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"link k must be an integer >= 0, got {self.k!r}")
        if isinstance(self.r, bool) or not isinstance(self.r, (int, float)) or not 0.0 <= self.r <= 1.0:
            raise ValueError(f"link r must be a fraction in [0, 1], got {self.r!r}")
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"link deviation must be one of {', '.join(DEVIATIONS)}, got {self.deviation!r}")
        if self.pick not in PICKS:
            raise ValueError(f"unknown MPIC pick {self.pick!r}; known: {', '.join(PICKS)}")
        b = self.store_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b <= 1.0:
            raise ValueError(f"store budget must be a fraction in (0, 1], got {b!r}")
        r = self.store_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"store rank must be an integer >= 0 (0: dense records), got {r!r}")
        from vlkv.runtime.link.compress import RECORD_SCORERS

        if self.store_scorer not in RECORD_SCORERS:
            raise ValueError(
                f"unknown record scorer {self.store_scorer!r}; known: {', '.join(RECORD_SCORERS)}"
            )

    @property
    def label(self) -> str:
        """:func:`link_label` of this request's linking."""
        r = self.r if self.method == "cacheblend" else None
        return link_label(
            self.method,
            self.k,
            r,
            self.pick,
            self.store_budget,
            self.store_rank,
            self.store_scorer,
            self.deviation,
        )

    def record_variant(self) -> dict | None:
        """What makes this request's records differ from a dense record of the same image (part of
        the record key, so a compressed record is never linked where a dense one, or another budget,
        was asked for); None for dense records (their keys are unchanged)."""
        out: dict = {}
        if self.store_budget < 1.0:
            out |= {"budget": float(self.store_budget), "scorer": self.store_scorer}
        if self.store_rank:
            out["rank"] = int(self.store_rank)
        return out or None


@dataclass
class LinkStats:
    """What one link step reused and recomputed."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    bytes_linked: int = 0
    bytes_loaded: int = 0
    dropped_tokens: int = 0  # image rows a compressed record left out (neither linked nor recomputed)

    def add(self, other: LinkStats) -> None:
        names = ("hits", "misses", "reused_tokens", "recomputed_tokens", "bytes_linked", "bytes_loaded")
        for name in (*names, "dropped_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
