"""The fixed buffers a static decode step (``runtime/static_step.py``) reads and writes: allocated once per
batch size, read-table capacity and mode, so a CUDA graph captured against them replays at their
addresses (``runtime/cuda_graph.py``).

A step's mode (the buffers' key beside the batch size) is its statistics mode (None, ``"probs"``,
``"exact"``: ``static_step.stats_mode``) and what its reads take (``reads``, ``static_step.reads_of``):

- ``"holes"``: some request has per-head holes (kvzip's or an adaptive head budget's: entries a KV head
  gave up while the others kept them). The read table already holds ``-1`` at each head's holes (the
  append kernel writes it from the request's hole table; every paged read masks negative slots); what a
  hole step adds is :attr:`StaticBuffers.held`, per layer the columns each KV head attends, written in
  the device half, from which the entries each row attended (a mean over heads, as the eager step counts
  them) and the statistics' visible columns come.
- ``"select"``: selected attention (A-VL's core steps: ``StepInputs.attend``, per layer the past columns
  each KV head reads). The selection is a fixed-size buffer, :attr:`StaticBuffers.select` ``(L, B, H_kv,
  C)``: per layer each list then the new column, padded (past :attr:`StaticBuffers.select_len`: never
  read), a layer without a list holding every column. Each layer's read gathers its read table through
  it into :attr:`StaticBuffers.read` (one op) and reads that to the list's length; a statistics step's
  probabilities are then over the list's positions, scattered back to columns after the forward.
- ``"rope"`` / ``"holes+rope"``: some request holds linked entries (keys stored pre-RoPE, rotated on
  read), beside holes or not. Each layer's append also writes :attr:`StaticBuffers.rot` ``(B, H_kv, C,
  P)``, the read table's twin: each pre-RoPE column's positions (``-1`` elsewhere), by which every paged
  read of the layer rotates those keys with rows of :attr:`StaticBuffers.rope`, the model's rotary table
  (``runtime/kv/rope_table.py``), as it loads them. ``"select+rope"``: beside a selection, the twin is
  gathered through the layer's list like the read table (into :attr:`StaticBuffers.rot_read`).
- None: none of these (every head attends every column below its length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.kv.rope_table import RopeTable
from vlkv.runtime.kv.step_tables import AFTER, FIELDS
from vlkv.runtime.static_factors import StaticFactors

# the read table's width grows in steps of this many columns (a capture per batch size and width: at
# 1024 a decode recaptures once every 1024 steps; the paged read loops to the lengths, never to C)
CAPACITY_STEP = 1024
READS = (None, "holes", "select", "rope", "holes+rope", "select+rope")


def reads_key(base: str | None, linked: bool) -> str | None:
    """The :data:`READS` key of a step whose reads take ``base`` (``"holes"``, ``"select"`` or None) and,
    with ``linked``, pre-RoPE entries rotated on read."""
    if not linked:
        return base
    return "rope" if base is None else f"{base}+rope"


def reads_parts(reads: str | None) -> tuple[bool, bool, bool]:
    """``(holes, select, linked)`` of a :data:`READS` key; one line naming it if it is not one."""
    if reads not in READS:
        raise ValueError(f"reads must be one of {READS}, got {reads!r}")
    parts = set((reads or "").split("+"))
    return "holes" in parts, "select" in parts, "rope" in parts


@dataclass(slots=True)
class StaticBuffers:
    """Every per-step input of ``static_step.forward`` for ``batch`` requests at read-table capacity
    ``capacity``.

    Attributes:
        batch, capacity, layers, kv_heads: ``B``, ``C``, ``L``, ``H_kv``.
        token_ids: ``(B, 1)`` int64 the new tokens.
        positions: ``(B, 1, P)`` int64 their RoPE positions.
        modality: ``(B,)`` int8, order: ``(B,)`` int64: the new table column's modality and sequence index.
        ints: ``(L·B·FIELDS + L·H_kv·B,)`` int64, the one host-to-device copy of a step: ``meta`` then
            ``ids``.
        meta: ``(L, B, FIELDS)`` view of ``ints``: per layer and request the append's row
            (``kv/step_tables``: table addresses, capacity, new column, length after, hole table).
        ids: ``(L, H_kv, B)`` view of ``ints``: each new entry's slot per layer and KV head.
        lengths: ``(L, B, H_kv)`` view of ``meta``'s lengths after the append (stride 0 over heads).
        table: ``(B, H_kv, C)`` int64, the read table each layer's append writes (``-1`` at holes) and
            its paged read reads.
        probs: ``(L, B, H_kv, G, C)`` float32 every layer's softmax rows (a statistics step's buffers),
            or None (a plain step's).
        exact: a statistics step whose attention output is the plain paged read's (``exact_output``).
        held: ``(L, B, H_kv, 1, C)`` bool per layer the columns each KV head attends (inside the length,
            not a hole), written by the device half: a hole step's buffers; None where no request has holes
            (every head then attends the columns below the length).
        columns: ``(C,)`` int64 ``0..C-1`` (a hole or selection step's).
        select: ``(L, B, H_kv, C)`` int64 per layer the columns each head reads, in order, the new one
            last (a selection step's; else None), filled by the host half.
        select_len: ``(L, B, H_kv)`` int64 how many of ``select`` each head reads (new one included).
        read: ``(B, H_kv, C)`` int64 a layer's read table gathered through its ``select`` row.
        rot: ``(B, H_kv, C, P)`` int64 a layer's pre-RoPE columns' positions, ``-1`` elsewhere (written by
            its append: a linked step's buffers, else None).
        rope: the :class:`~vlkv.runtime.kv.rope_table.RopeTable` the reads rotate by (with ``rot``).
        rot_read: ``(B, H_kv, C, P)`` int64 ``rot`` gathered through a layer's ``select`` row (a linked
            selection step's, else None).
        factors: the low-rank factor stacks (:class:`~vlkv.runtime.static_factors.StaticFactors`) of a
            step whose requests hold AttentionPack's pre-RoPE factors (with ``rot``), else None.
    """

    batch: int
    capacity: int
    layers: int
    kv_heads: int
    token_ids: Tensor
    positions: Tensor
    modality: Tensor
    order: Tensor
    ints: Tensor
    meta: Tensor
    ids: Tensor
    lengths: Tensor
    table: Tensor
    probs: Tensor | None = None
    exact: bool = False
    held: Tensor | None = None
    columns: Tensor | None = None
    select: Tensor | None = None
    select_len: Tensor | None = None
    read: Tensor | None = None
    rot: Tensor | None = None
    rope: RopeTable | None = None
    rot_read: Tensor | None = None
    factors: StaticFactors | None = None

    def __post_init__(self) -> None:
        if self.batch < 1 or self.capacity < 1 or self.layers < 1 or self.kv_heads < 1:
            raise ValueError(
                f"StaticBuffers: batch, capacity, layers, kv_heads must be >= 1, got {self.batch}, "
                f"{self.capacity}, {self.layers}, {self.kv_heads}"
            )
        if self.table.shape != (self.batch, self.kv_heads, self.capacity):
            raise ValueError(f"StaticBuffers.table: {tuple(self.table.shape)} is not (B, H_kv, C)")
        if self.meta.shape != (self.layers, self.batch, FIELDS):
            raise ValueError(f"StaticBuffers.meta: {tuple(self.meta.shape)} is not (L, B, {FIELDS})")
        if self.probs is not None and (
            self.probs.shape[:3] != (self.layers, self.batch, self.kv_heads)
            or self.probs.shape[4] != self.capacity
            or not self.probs.is_contiguous()
        ):
            raise ValueError(f"StaticBuffers.probs: {tuple(self.probs.shape)} is not (L, B, H_kv, G, C)")
        if self.exact and self.probs is None:
            raise ValueError("StaticBuffers.exact: an exact output is a statistics step's (probs needed)")
        want = (self.layers, self.batch, self.kv_heads, 1, self.capacity)
        if self.held is not None and (
            self.held.shape != want or self.held.dtype != torch.bool or not self.held.is_contiguous()
        ):
            raise ValueError(f"StaticBuffers.held: {tuple(self.held.shape)} is not contiguous bool {want}")
        if self.held is not None and self.select is not None:
            raise ValueError(
                "StaticBuffers: holes and a selection are not read together (refused, as eagerly)"
            )
        if (self.held is None and self.select is None) != (self.columns is None):
            raise ValueError("StaticBuffers.columns: a hole or selection step's buffers have it, others not")
        if self.select is not None and (
            self.select.shape != (self.layers, self.batch, self.kv_heads, self.capacity)
            or self.select_len is None
            or self.select_len.shape != (self.layers, self.batch, self.kv_heads)
            or self.read is None
            or self.read.shape != self.table.shape
        ):
            raise ValueError(
                "StaticBuffers.select / select_len / read: not (L, B, H_kv, C) / (L, B, H_kv) / (B, H_kv, C)"
            )
        if (self.rot is None) != (self.rope is None) or (
            self.rot is not None
            and (
                self.rot.shape != (*self.table.shape, self.positions.shape[-1])
                or self.rot.dtype != torch.long
                or (self.select is not None) != (self.rot_read is not None)
            )
        ):
            raise ValueError(
                "StaticBuffers.rot / rope / rot_read: rot and rope both or neither, rot int64 (B, H_kv, C, P), "
                "rot_read beside a selection"
            )
        if self.factors is not None and (
            self.rot is None or self.select is not None or self.factors.frow.shape != self.table.shape
        ):
            raise ValueError(
                "StaticBuffers.factors: pre-RoPE factors rotate on read (rot needed), are not read beside a "
                "selection, and their frow is the read table's shape (B, H_kv, C)"
            )

    @property
    def reads(self) -> str | None:
        """What these buffers' reads take: one of ``READS`` (see the module docstring)."""
        base = "holes" if self.held is not None else "select" if self.select is not None else None
        return reads_key(base, self.rot is not None)

    @classmethod
    def make(
        cls,
        batch: int,
        capacity: int,
        layers: int,
        kv_heads: int,
        pos_dims: int,
        device,
        group: int = 0,
        exact: bool = False,
        reads: str | None = None,
        rope: RopeTable | None = None,
        factors: tuple | None = None,
        dtype: torch.dtype | None = None,
    ):
        """Zeroed buffers on ``device`` (allocated once: a graph replays against these addresses);
        ``group`` > 0: a statistics step's, with ``probs`` for ``G = group`` query heads per KV head;
        ``reads``: ``"holes"`` (with ``held``), ``"select"`` (with ``select``, ``select_len``,
        ``read``), ``"rope"`` / ``"holes+rope"`` / ``"select+rope"`` (with ``rot``, ``rope`` the table;
        beside a selection ``rot_read``) or None; ``factors``: ``static_factors.factors_key``'s key of the
        step's factor stacks, in ``dtype`` (the pool's), or None."""
        holes, select, linked = reads_parts(reads)
        i64 = dict(dtype=torch.long, device=device)
        n_meta = layers * batch * FIELDS
        ints = torch.zeros(n_meta + layers * kv_heads * batch, **i64)
        meta = ints[:n_meta].view(layers, batch, FIELDS)
        return cls(
            batch=batch,
            capacity=capacity,
            layers=layers,
            kv_heads=kv_heads,
            token_ids=torch.zeros(batch, 1, **i64),
            positions=torch.zeros(batch, 1, pos_dims, **i64),
            modality=torch.zeros(batch, dtype=torch.int8, device=device),
            order=torch.zeros(batch, **i64),
            ints=ints,
            meta=meta,
            ids=ints[n_meta:].view(layers, kv_heads, batch),
            lengths=meta[:, :, AFTER, None].expand(layers, batch, kv_heads),
            table=torch.zeros(batch, kv_heads, capacity, **i64),
            probs=(
                torch.zeros(layers, batch, kv_heads, group, capacity, dtype=torch.float32, device=device)
                if group > 0
                else None
            ),
            exact=exact,
            held=(
                torch.zeros(layers, batch, kv_heads, 1, capacity, dtype=torch.bool, device=device)
                if holes
                else None
            ),
            columns=torch.arange(capacity, **i64) if holes or select else None,
            select=torch.zeros(layers, batch, kv_heads, capacity, **i64) if select else None,
            select_len=torch.zeros(layers, batch, kv_heads, **i64) if select else None,
            read=torch.zeros(batch, kv_heads, capacity, **i64) if select else None,
            rot=torch.full((batch, kv_heads, capacity, pos_dims), -1, **i64) if linked else None,
            rope=rope if linked else None,
            rot_read=torch.full((batch, kv_heads, capacity, pos_dims), -1, **i64)
            if linked and select
            else None,
            factors=None
            if factors is None
            else StaticFactors.make(factors, layers, batch, kv_heads, capacity, pos_dims, dtype, device),
        )

    def visible(self) -> Tensor:
        """``(L, B, 1 or H_kv, 1, C)`` bool per layer the columns each row attended, after the forward:
        :attr:`held` (a hole step), else the columns below each request's length."""
        if self.held is not None:
            return self.held
        if self.select is not None:  # the list's positions (the probabilities are over those)
            return (self.columns < self.select_len[..., None])[:, :, :, None, :]
        cols = torch.arange(self.capacity, device=self.meta.device)
        return (cols < self.meta[:, :, AFTER, None])[:, :, None, None, :]

    def attended(self) -> Tensor:
        """``(L, B)`` float64 entries each request's row attended per layer (the mean over KV heads, as
        the eager step's ``kv.paged.attended_entries``); device ops on the buffers, no host read."""
        if self.held is not None:
            return self.held.sum(-1, dtype=torch.float64).mean((2, 3))
        if self.select is not None:
            return self.select_len.double().mean(2)
        return self.meta[:, :, AFTER].double()


def capacity_for(longest: int, step: int = CAPACITY_STEP) -> int:
    """The read table's capacity for a step whose longest request holds ``longest`` entries after it:
    the next multiple of ``step``."""
    return max(step, math.ceil(longest / step) * step)
