"""The entry table of one layer's cache: per sample and KV head, what each table column holds.

A layer's cache lists its entries as columns of per-entry tables ``(B, H_kv, C)`` (``C`` = table
capacity), left-aligned in ``[0, lengths[b])``; table columns past that are spare. Every KV head of a
sample holds the same number of entries but may hold *different* tokens (per-head selection), so
positions and modality are stored per head. :class:`EntryTable` owns those tables and the edits of
the tables alone (growing them, gathering kept columns, installing a rebuilt set); what the columns
name in the pool (slots, their K/V) is :class:`~vlkv.runtime.kv.layer.LayerKV`'s business.

Every property and query here reads only: nothing is written on a read.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

from vlkv.runtime.kv.pool import GROW_SLOTS


class Modality(IntEnum):
    """What produced a cache entry."""

    TEXT = 0  # prompt text before the first image (system / instruction prefix)
    IMAGE = 1  # image tokens (incl. LLaVA-1.6 newline tokens)
    POST_TEXT = 2  # prompt text after the first image
    GENERATED = 3  # tokens produced by decoding


def gather_columns(t: Tensor, index: Tensor) -> Tensor:
    """Columns ``index (B, H_kv, K)`` of a per-entry table ``t (B, H_kv, C)`` or ``(B, H_kv, C, P)``."""
    return t.gather(2, index if t.dim() == 3 else index[..., None].expand(-1, -1, -1, t.shape[-1]))


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), None for an inference-mode tensor
    (which keeps none: its host copy is never trusted)."""
    try:
        return t._version
    except RuntimeError:
        return None


class EntryTable:
    """The per-entry tables of one layer's cache for a batch of samples.

    Attributes:
        slots: ``(B, H_kv, C)`` int64 pool slot of each entry (``-(1 + row)`` for a low-rank factor row,
            0 at holes and spare columns).
        lengths: ``(B,)`` int64, valid entries per sample.
        positions: ``(B, H_kv, C, P)`` int64 original positions, ``P`` = 1 (1-D RoPE) or 3 (M-RoPE).
        modality: ``(B, H_kv, C)`` int8 :class:`Modality` codes.
        order: ``(B, H_kv, C)`` int64 index of each entry's token in its request's sequence (prompt
            then generated tokens); causality by position in a selective (link) step reads it.
        next_order: ``(B,)`` int64 order the next appended token gets unless a step names it.
        scores: name → ``(B, H_kv, C)`` float32 running statistics a policy keeps per entry
            (e.g. H2O's accumulated attention); they move with their entry on every edit.
        holes: None, or ``(B, H_kv, C)`` bool: True where a valid column holds no entry for that head
            (evicted with a per-head budget: no pool slot, never attended).
    """

    def __init__(self, batch: int, kv_heads: int, pos_dims: int, capacity: int, device: torch.device | str):
        if batch < 0 or kv_heads < 1 or pos_dims < 1 or capacity < 0:
            raise ValueError(
                f"entry table needs batch >= 0, kv_heads >= 1, pos_dims >= 1, capacity >= 0; got "
                f"batch={batch}, kv_heads={kv_heads}, pos_dims={pos_dims}, capacity={capacity}"
            )
        b, h, c, dev = batch, kv_heads, capacity, device
        self.slots = torch.zeros(b, h, c, dtype=torch.long, device=dev)
        self.set_lengths(torch.zeros(b, dtype=torch.long, device=dev), [0] * b)
        self.positions = torch.zeros(b, h, c, pos_dims, dtype=torch.long, device=dev)
        self.modality = torch.zeros(b, h, c, dtype=torch.int8, device=dev)
        self.order = torch.zeros(b, h, c, dtype=torch.long, device=dev)
        self.next_order = torch.zeros(b, dtype=torch.long, device=dev)
        self.scores: dict[str, Tensor] = {}
        self.holes: Tensor | None = None

    # ------------------------------------------------------------------ lengths
    # A decode step asks each layer's lengths as numbers (table widths, append columns): read back
    # per layer and request they were the step's most frequent host syncs. Every write of the tables
    # here keeps a copy on the host beside the tensor (:meth:`set_lengths`); a write that does not
    # (the plain setter, or an in-place edit of the tensor, seen by its version counter) drops it,
    # and :meth:`host_lengths` reads back until the next write keeps one (a read never writes).
    @property
    def lengths(self) -> Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: Tensor) -> None:
        self._lengths = value
        self._host: tuple[int, list[int]] | None = None

    def set_lengths(self, value: Tensor, host: list[int]) -> None:
        """Set ``lengths`` to ``value (B,)`` int64 whose values ``host`` the caller already knows."""
        self._lengths = value
        self._host = (_version(value), list(host))

    def host_lengths(self) -> list[int]:
        """``lengths`` as Python ints: the copy the last write kept, else read back. Do not modify
        the list."""
        host, version = self._host, _version(self._lengths)
        if host is None or version is None or host[0] != version:
            return self._lengths.tolist()
        return host[1]

    def kept_lengths(self) -> list[int] | None:
        """:meth:`host_lengths` where the host copy is current, else None (never reads back)."""
        host, version = self._host, _version(self._lengths)
        return None if host is None or version is None or host[0] != version else host[1]

    # ------------------------------------------------------------------ shape
    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.slots.shape[1]

    @property
    def capacity(self) -> int:
        return self.slots.shape[2]

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def max_length(self) -> int:
        return max(self.host_lengths(), default=0)

    # ------------------------------------------------------------------ queries (read only)
    def valid_mask(self, width: int | None = None) -> Tensor:
        """``(B, width)`` bool (default: the table's capacity), True at valid table columns."""
        n = self.capacity if width is None else width
        return torch.arange(n, device=self.device)[None, :] < self.lengths[:, None]

    def table(self, width: int) -> Tensor:
        """``(B, H_kv, width)`` slot ids of the first ``width`` columns (0 past the table's capacity)."""
        t = self.slots[:, :, :width]
        if t.shape[2] < width:
            t = torch.cat([t, t.new_zeros(*t.shape[:2], width - t.shape[2])], dim=2)
        return t

    def held_mask(self, width: int | None = None) -> Tensor:
        """``(B, H_kv, width)`` bool: valid columns whose head holds a pool slot (not a hole, not a
        low-rank factor row)."""
        width = self.capacity if width is None else width
        held = self.valid_mask()[:, None, :width] & (self.slots[:, :, :width] >= 0)
        if self.holes is not None:
            held = held & ~self.holes[:, :, :width]
        return held

    def kept_entries(self) -> Tensor:
        """``(B,)`` int64 entries the layer keeps per KV head: ``lengths``, less holes (mean over
        heads, rounded) when heads keep different numbers."""
        if self.holes is None:
            return self.lengths.clone()
        held = self.valid_mask()[:, None, :] & ~self.holes
        return held.sum(2).double().mean(1).round().long()

    def open_mask(self, width: int) -> Tensor | None:
        """``(B, H_kv, width)`` bool, False at holes (columns a head must not attend); None when the
        cache has no holes (every valid column is attended by every head)."""
        if self.holes is None:
            return None
        holes = self.holes[:, :, :width]
        if holes.shape[2] < width:
            holes = torch.cat([holes, holes.new_zeros(*holes.shape[:2], width - holes.shape[2])], dim=2)
        return ~holes

    def meta_bytes(self) -> int:
        """Bytes of the tables (every column, spare ones included)."""
        tensors = [self.slots, self.positions, self.modality, self.order, self.lengths, *self.scores.values()]
        if self.holes is not None:
            tensors.append(self.holes)
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ table edits
    def ensure_score(self, name: str) -> Tensor:
        """A ``(B, H_kv, C)`` float32 running statistic, created as zeros on first use."""
        if name not in self.scores:
            self.scores[name] = torch.zeros(self.slots.shape, dtype=torch.float32, device=self.device)
        return self.scores[name]

    def _reserve(self, needed: int) -> None:
        """Grow every table to at least ``needed`` columns (the new ones zero)."""
        if needed <= self.capacity:
            return
        # the prompt is allocated exactly; decode growth is amortised
        new_cap = needed if self.capacity == 0 else max(needed, self.capacity + GROW_SLOTS)
        extra = new_cap - self.capacity

        def grow(t: Tensor) -> Tensor:
            pad = t.new_zeros(*t.shape[:2], extra, *t.shape[3:])
            return torch.cat([t, pad], dim=2)

        self.slots, self.positions = grow(self.slots), grow(self.positions)
        self.modality, self.order = grow(self.modality), grow(self.order)
        self.scores = {name: grow(s) for name, s in self.scores.items()}
        if self.holes is not None:
            self.holes = grow(self.holes)

    def _entry_tables(self) -> list[Tensor]:
        """The per-entry tables an in-place edit moves together (holes and factors excluded: caches
        holding them are edited by rebuilding, see ``select``)."""
        return [self.slots, self.positions, self.modality, self.order, *self.scores.values()]

    def _listed(self, index: Tensor, keep_len: Tensor) -> Tensor:
        """``(B, H_kv, K)`` bool: positions of ``index`` inside ``[:keep_len[b]]``."""
        ranks = torch.arange(index.shape[2], device=self.device)[None, None, :]
        return (ranks < keep_len.to(self.device)[:, None, None]).expand(index.shape)

    def _kept_mask(self, index: Tensor, keep_len: Tensor) -> Tensor:
        """``(B, H_kv, C)`` bool: table columns listed in ``index[..., :keep_len[b]]``."""
        ok = self._listed(index, keep_len).to(torch.int8)
        kept = torch.zeros(self.slots.shape, dtype=torch.int8, device=self.device)
        return kept.scatter_reduce_(2, index, ok, "amax").bool()

    def _take(self, index: Tensor, slots: int) -> dict[str, Tensor]:
        """Gather per-entry tables; ``index`` is ``(B, H_kv, K)``, padded with any valid column.

        The ``slots - K`` columns past ``index`` (room for appends) are gathered from column 0 like
        padding: past a sample's length a column's content is never read as an entry."""
        if index.shape[2] < slots and self.capacity:
            index = torch.cat([index, index.new_zeros(*index.shape[:2], slots - index.shape[2])], 2)

        def g(t: Tensor) -> Tensor:
            out = gather_columns(t, index)
            if out.shape[2] < slots:  # an empty table: zero columns for appends
                out = torch.cat([out, out.new_zeros(*out.shape[:2], slots - out.shape[2], *out.shape[3:])], 2)
            return out

        return {
            "slots": g(self.slots),
            "positions": g(self.positions),
            "modality": g(self.modality),
            "order": g(self.order),
            **({} if self.holes is None else {"holes": g(self.holes)}),
            **{f"score:{n}": g(s) for n, s in self.scores.items()},
        }

    def _install(self, meta: dict[str, Tensor], lengths: Tensor, host: list[int] | None = None) -> None:
        """Replace the tables by ``meta`` (as :meth:`_take` returns them) holding ``lengths (B,)``
        (``host``: their values, when the caller knows them)."""
        self.slots = meta["slots"].contiguous()
        self.lengths = lengths.to(torch.long).clone()
        if host is not None:
            self.set_lengths(self.lengths, host)
        self.positions, self.modality, self.order = meta["positions"], meta["modality"], meta["order"]
        self.holes = meta.get("holes")
        self.scores = {n[len("score:") :]: t for n, t in meta.items() if n.startswith("score:")}
