"""Which running requests share one batched decode step: their read paths, made explicit.

Every request decodes under its own policy, and a policy decides how the step reads its cache:
through a list of selected entries (A-VL's core attention), over per-head holes (per-head budgets:
kvzip, AdaKV-style allocators), in the rank space of post-RoPE low-rank factors (AttentionPack path
(b)), or plainly. One backend step reads every row of its batch the same way, so two requests whose
read paths exclude each other run in separate steps of the same scheduler iteration; everything
else shares a step. A request's solo run reads its cache the way its group's step does, so a
stream's tokens equal each request's run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlkv.runtime.backend import AttendIndex, StatsRequest


@dataclass(frozen=True)
class ReadPath:
    """How one request's decode step reads its cache (its capabilities in a batched step).

    Attributes:
        selected: the step attends through :class:`AttendIndex` lists (A-VL's core attention); the
            backend then gathers the listed entries of every row, which reads neither holes nor
            factors in the rank space.
        holes: some layer holds per-head holes (heads with their own budgets).
        rank_space: some layer holds post-RoPE low-rank factors, attended in the rank space when
            no row of the step selects entries.
    """

    selected: bool = False
    holes: bool = False
    rank_space: bool = False

    @property
    def needs_open_read(self) -> bool:
        """The step must read whole caches (mask holes, keep the rank-space path): no selection."""
        return self.holes or self.rank_space

    @property
    def plain(self) -> bool:
        """Reads its cache in whichever way the step does (dense, no holes, no selection)."""
        return not (self.selected or self.needs_open_read)


def read_path(cache, attend: list[AttendIndex | None] | None) -> ReadPath:
    """A request's :class:`ReadPath` this step from its cache and its policy's ``decode_attend``."""
    holes = rank = False
    for layer in cache.layers:
        holes = holes or layer.holes is not None
        low = layer.lowrank
        rank = rank or (low is not None and bool(getattr(low, "post_rope", False)))
    selected = attend is not None and any(a is not None for a in attend)
    return ReadPath(selected=selected, holes=holes, rank_space=rank)


@dataclass
class Entry:
    """One running request's part of a step: its policy context, statistics request, attend lists
    (computed once per step, reused if the step is retried) and read path."""

    request: object
    ctx: object
    stats: StatsRequest | None
    attend: list[AttendIndex | None] | None
    path: ReadPath = field(default_factory=ReadPath)


def signature(stats: StatsRequest | None):
    """What two statistics requests must share to merge into one step (None: asks for none)."""
    if stats is None:
        return None
    return (stats.threshold, tuple(sorted((k, v.threshold) for k, v in stats.extra.items())))


def group_entries(entries: list[Entry]) -> list[list[Entry]]:
    """Split a step's entries into groups that can run as one backend step each.

    A group shares one statistics signature and one selection mode (selecting rows never sit beside
    rows with holes or rank-space factors). Requests that ask for no statistics ride along with the
    first group their read path fits, so an all-plain batch is one step.
    """
    groups: dict = {}
    riders = []
    for e in entries:
        if e.stats is None:
            riders.append(e)
        else:
            groups.setdefault((signature(e.stats), e.path.selected), []).append(e)
    out = list(groups.values())
    for e in riders:
        home = next((g for g in out if _fits(g, e.path)), None)
        if home is None:
            out.append([e])
        else:
            home.append(e)
    return out


def _fits(group: list[Entry], path: ReadPath) -> bool:
    """``path`` can share a step with every entry of ``group``."""
    if path.plain:
        return True
    selects = any(e.path.selected for e in group)
    opens = any(e.path.needs_open_read for e in group)
    if path.selected:
        return not opens
    return not selects
