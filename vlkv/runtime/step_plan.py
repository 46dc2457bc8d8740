"""What one scheduler step runs, decided once: the :class:`StepPlan` between scheduler and runner.

nano-vllm's step is ``schedule() → run() → postprocess()``: the schedule says which sequences run
and what their attention reads, in flat tensors built once, and the model runner never asks the
scheduler anything. Here a plan is either one admitted request's prefill (each prefill is planned
alone: its policy's compression decides what the next admission finds) or one decode step of every
running request, split into :class:`DecodeGroup` s whose read paths can share a backend call
(:mod:`vlkv.runtime.step_groups`). Each group carries, built once as tensors:

- the new tokens, positions, modality codes (its :class:`StepInputs`);
- each request's capabilities: its policy's statistics rows (merged into one
  :class:`StatsRequest`), its attend lists (one :class:`AttendIndex` per layer over the group), its
  :class:`ReadPath` (selected attention, per-head holes, rank-space factors);
- the tables it reads: ``lengths (L, B)``, entries each request's layers hold before the step
  (the columns of its slot tables the step reads; the step appends at column ``lengths``), with
  each layer's next sequence index and the processed counts: all a failed step needs to be undone.

Building a plan reads no tensor value back to the host: every per-request, per-layer quantity stays
on the device until the commit reads what it needs in one transfer per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs
from vlkv.runtime.cache import Modality
from vlkv.runtime.kv.batch import CacheBatch
from vlkv.runtime.step_groups import Entry, ReadPath


@dataclass
class StepMarks:
    """What a decode step changes in its requests' caches, taken before it runs (see :func:`undo`).

    Attributes:
        lengths: ``(L, B)`` int64 entries per layer and request before the step.
        processed: ``(B,)`` int64 the requests' processed counts (a copy: one ``cat``, not a clone per
            request).

    The layers' next sequence indices are not taken: a decode step's entries take the next index
    each (no order named), so undoing ``n`` of them steps it back by ``n``; reading it here would
    also write a layer's queued decode entries every step (:meth:`LayerKV.put_one`).
    """

    lengths: Tensor
    processed: Tensor


@dataclass
class DecodeGroup:
    """One backend call of a decode step.

    Attributes:
        entries: the requests' :class:`Entry` (request, policy context, statistics request, attend
            lists, read path), in batch order.
        inputs: the step's :class:`StepInputs` (``(B, 1)`` tokens, ``(B, 1, P)`` positions...).
        stats: the merged :class:`StatsRequest` (``rows (B, 1)`` bool), or None when no row asks.
        batch: the :class:`CacheBatch` view the backend reads and appends to.
        marks: :class:`StepMarks` to undo the step with.
    """

    entries: list[Entry]
    inputs: StepInputs
    stats: StatsRequest | None
    batch: CacheBatch
    marks: StepMarks

    @property
    def requests(self) -> list:
        return [e.request for e in self.entries]

    @property
    def paths(self) -> list[ReadPath]:
        return [e.path for e in self.entries]


@dataclass
class StepPlan:
    """One scheduler step: a prefill of ``prefill`` (one request) or the decode ``groups``.

    An empty plan (no prefill, no groups) is a decode step with nothing running. ``built_s``: wall
    seconds spent building the decode groups (the scheduler counts them as decode time).
    """

    prefill: list = field(default_factory=list)
    groups: list[DecodeGroup] = field(default_factory=list)
    built_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill and self.groups:
            raise ValueError("prefill: a plan prefills or decodes, not both")
        if len(self.prefill) > 1:
            raise ValueError(f"prefill: one request per plan, got {len(self.prefill)}")

    @property
    def is_decode(self) -> bool:
        return not self.prefill

    @property
    def requests(self) -> list:
        return list(self.prefill) or [r for g in self.groups for r in g.requests]


def decode_group(engine, entries: list[Entry]) -> DecodeGroup:
    """The :class:`DecodeGroup` of ``entries`` (one backend call), built without host syncs."""
    reqs = [e.request for e in entries]
    caches = [r.cache for r in reqs]
    dev = caches[0].device
    b = len(reqs)
    tokens = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.long, device=dev)
    if all(r.policy.positions == "original" for r in reqs) and all(c.batch_size == 1 for c in caches):
        # every request continues its own numbering: one ``cat`` of the next positions, not a view per
        # request (``Engine.decode_positions`` of each)
        positions = torch.cat([c.next_position for c in caches]).unsqueeze(1)
    else:
        positions = torch.cat([engine.decode_positions(r.policy, c) for r, c in zip(reqs, caches)])
    inputs = StepInputs(
        tokens[:, None],
        positions,
        torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8, device=dev),
        torch.ones(b, dtype=torch.long, device=dev),
        attend=merge_attend([e.attend for e in entries], caches),
        new_len_host=(1,) * b,  # one new row each, known here: the backend reads nothing back for it
    )
    marks = StepMarks(
        torch.cat([c.lengths() for c in caches], dim=1), torch.cat([c.processed for c in caches])
    )
    stats = merge_stats([e.stats for e in entries], dev)
    return DecodeGroup(entries, inputs, stats, CacheBatch(caches, decode=True), marks)


def merge_stats(requests: list[StatsRequest | None], device) -> StatsRequest | None:
    """One :class:`StatsRequest` over a group: ``rows (B, 1)`` True where a request asked (a device
    reduction per request, no host read), or None where every request asked for every row (so the
    backend knows it without a read); the union of the layers asked; the extra row sets by name;
    ``exact_output`` where any request asked it."""
    wanted = [s for s in requests if s is not None]
    if not wanted:
        return None
    yes = torch.ones((), dtype=torch.bool, device=device)
    no = torch.zeros((), dtype=torch.bool, device=device)

    def rows(sel) -> Tensor | None:  # (B, 1) bool: the row of every request that asked
        if all(s is not None and s.rows is None for s in sel):
            return None
        parts = [no if s is None else yes if s.rows is None else s.rows.to(device).any() for s in sel]
        return torch.stack(parts)[:, None]

    layers = None
    if all(s.layers is not None for s in wanted):
        layers = frozenset().union(*(s.layers for s in wanted))
    extra = {}
    for name in {n for s in wanted for n in s.extra}:
        subs = [None if s is None else s.extra.get(name) for s in requests]
        first = next(x for x in subs if x is not None)
        extra[name] = StatsRequest(rows(subs), first.threshold)
    # one request's budget-1 exactness holds the group's output to the plain attention (see StatsRequest)
    exact = any(s.exact_output for s in wanted)
    return StatsRequest(rows(requests), wanted[0].threshold, layers, extra, exact_output=exact)


def merge_attend(attends: list, caches: list) -> list[AttendIndex | None] | None:
    """Per layer, one :class:`AttendIndex` over the group; requests without one attend to everything
    (their whole table, ``arange(max_length)`` with their own lengths)."""
    if all(a is None for a in attends):
        return None
    merged: list[AttendIndex | None] = []
    for li in range(len(caches[0].layers)):
        per = [None if a is None else a[li] for a in attends]
        if all(p is None for p in per):
            merged.append(None)
            continue
        parts = []
        for p, c in zip(per, caches):
            if p is None:
                layer = c.layers[li]
                n = layer.max_length
                idx = torch.arange(n, device=layer.device)[None, None].expand(1, layer.kv_heads, n)
                p = AttendIndex(idx, layer.lengths[:, None].expand(1, layer.kv_heads).clone())
            parts.append(p)
        width = max(p.indices.shape[2] for p in parts)
        idx = torch.cat([torch.nn.functional.pad(p.indices, (0, width - p.indices.shape[2])) for p in parts])
        merged.append(AttendIndex(idx, torch.cat([p.lengths for p in parts])))
    return merged


def undo(group: DecodeGroup, i: int) -> None:
    """Take back what the group's step that raised had written to request ``i``'s cache: the entry it
    appended to each layer it reached (its slot goes back to the pool), the sequence index that
    entry took, and the processed count. Reads the marks back (a failure path, not a hot one)."""
    cache = group.entries[i].request.cache
    before = group.marks.lengths[:, i].tolist()
    for layer, n in zip(cache.layers, before):
        grew = int(layer.lengths[0]) - n
        if grew > 0:
            dev = layer.lengths.device
            layer.cut(torch.tensor([n], device=dev), torch.tensor([grew], device=dev))
            layer.next_order = layer.next_order - grew
    cache.processed = group.marks.processed.narrow(0, i, 1).clone()
