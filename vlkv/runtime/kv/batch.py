"""A step's batch view over several requests' caches that share one pool.

The scheduler keeps one single-sample :class:`~vlkv.runtime.kv.cache.KVCache` per request (so each
request's policy edits only its own entries) and runs a decode step over all running requests at
once. :class:`CacheBatch` presents their caches to a backend as one batch — the same interface a
backend reads from a ``KVCache`` (``layers[i].append / attention_kv / lengths / max_length``,
``lengths()``, ``processed``) — without copying any per-entry state: appends go to each request's
own table, and attention reads gather every request's slots from the shared pool in one call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.appends import append_one_each
from vlkv.runtime.kv.cache import KVCache
from vlkv.runtime.kv.layer import LayerKV


class LayerBatch:
    """One layer of a :class:`CacheBatch`: the rows are the requests' single-sample layers."""

    def __init__(self, rows: list[LayerKV], memo: dict | None = None):
        pools = {id(r.pool) for r in rows}
        if len(pools) != 1 or len({r.layer for r in rows}) != 1:
            raise ValueError("a batch view needs every row on the same pool layer")
        self.rows = rows
        self.pool, self.layer = rows[0].pool, rows[0].layer
        # per-step values every layer of a batch view shares (see ``_step_rows``)
        self._memo = {} if memo is None else memo

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` int64 valid entries per request."""
        return torch.cat([r.lengths for r in self.rows])

    @property
    def max_length(self) -> int:
        return max(r.max_length for r in self.rows)

    def append(
        self,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        modality: Tensor,
        new_len: Tensor,
        order: Tensor | None = None,
        one_each: bool | None = None,
    ) -> Tensor:
        """Append row ``b`` of ``k, v (B, H_kv, q, D)`` etc. to request ``b``; returns ``(B,)`` past lengths.
        ``one_each``: as :meth:`LayerKV.append` takes it (None: read once per step, see :meth:`_one_each`)."""
        if (
            k.shape[2] == 1
            and all(r.batch == 1 for r in self.rows)
            and (self._one_each(new_len) if one_each is None else one_each)
        ):
            return self._append_one(k, v, positions, modality, order)
        out = []
        for b, r in enumerate(self.rows):
            row = slice(b, b + 1)
            own = None if order is None else order[row]
            out.append(r.append(k[row], v[row], positions[row], modality[row], new_len[row], own))
        return torch.cat(out)

    def _append_one(
        self, k: Tensor, v: Tensor, positions: Tensor, modality: Tensor, order: Tensor | None = None
    ) -> Tensor:
        """One new entry per request (a decode step), see :func:`~vlkv.runtime.kv.appends.append_one_each`.

        ``k, v (B, H_kv, 1, D)``, ``positions (B, 1, P)``, ``modality (B, 1)``, ``order`` None or
        ``(B, 1)`` sequence indices; returns ``(B,)`` past lengths.
        """
        past = append_one_each(self.rows, k, v, *self._step_rows(positions, modality, order))
        return torch.tensor(past, device=self.pool.spec.device)

    def _one_each(self, new_len: Tensor) -> bool:
        """Whether every request appends a row (``new_len (B,)`` all nonzero): read once per step, the
        first layer's answer kept for the others (every layer appends the same ``new_len``)."""
        if self._memo.get("decode"):  # the plan built this view for a decode step: one row each
            return True
        memo = self._memo.get("one_each")
        if memo is None or memo[0] is not new_len:
            memo = self._memo["one_each"] = (new_len, bool(new_len.all()))
        return memo[1]

    def _step_rows(
        self, positions: Tensor, modality: Tensor, order: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
        """The step's new rows per request, split once per step (every layer appends the same rows):
        ``positions (B, 1, P)`` → ``(P,)`` rows and ``modality (B, 1)`` → ``()`` codes on the pool's
        device, ``order (B, 1)`` → ``()`` indices there (None each when not given): written as they
        are, nothing read back."""
        memo = self._memo.get("rows")
        if memo is not None and memo[0] is positions and memo[1] is modality and memo[2] is order:
            return memo[3]
        dev = self.pool.spec.device
        rows = (
            list(positions[:, 0].to(device=dev, dtype=torch.long)),
            list(modality[:, 0].to(device=dev, dtype=torch.int8)),
            [None] * len(self.rows) if order is None else list(order[:, 0].to(device=dev, dtype=torch.long)),
        )
        self._memo["rows"] = (positions, modality, order, rows)
        return rows

    def open_mask(self, width: int) -> Tensor | None:
        """``(B, H_kv, width)`` bool, False at any request's holes; None when no request has holes."""
        if all(r.holes is None for r in self.rows):
            return None
        ones = torch.ones(1, self.pool.spec.kv_heads, width, dtype=torch.bool, device=self.pool.spec.device)
        return torch.cat([ones if r.holes is None else r.open_mask(width) for r in self.rows])

    @property
    def lowrank(self):
        """The requests' low-rank factors as one :class:`~vlkv.runtime.kv.lowrank.LowRank` (one
        sample per request), or None when no request holds factors."""
        if all(r.lowrank is None for r in self.rows):
            return None
        from vlkv.runtime.kv.lowrank import LowRank

        view = LowRank(len(self.rows))
        view.samples = [None if r.lowrank is None else r.lowrank.samples[0] for r in self.rows]
        return view

    def table(self, width: int) -> Tensor:
        """``(B, H_kv, width)`` slot table of every request, 0 past each one's columns."""
        return torch.cat([r.table(width) for r in self.rows])

    def valid_mask(self, width: int | None = None) -> Tensor:
        """``(B, width)`` bool, True at each request's valid columns (``width`` default: the widest)."""
        n = self.max_length if width is None else width
        return torch.arange(n, device=self.pool.spec.device)[None, :] < self.lengths[:, None]

    def attention_kv(
        self, upto: int | None = None, view: bool = False, fill: bool = True
    ) -> tuple[Tensor, Tensor]:
        """``(B, H_kv, upto, D)`` K/V of every request, padded past each one's length (``view``,
        ``fill``: as :meth:`LayerKV.attention_kv`)."""
        n = self.max_length if upto is None else upto
        if any(r.lowrank is not None or r.linked for r in self.rows):
            # factored or pre-RoPE entries need their own read (reconstruct / rotate)
            kv = [r.attention_kv(min(n, r.capacity), fill=fill) for r in self.rows]

            def pad(t: Tensor) -> Tensor:
                return torch.cat([t, t.new_zeros(*t.shape[:2], n - t.shape[2], t.shape[3])], dim=2)

            return torch.cat([pad(k) for k, _ in kv]), torch.cat([pad(v) for _, v in kv])
        if len(self.rows) == 1 and self.rows[0].capacity >= n:
            return self.rows[0].attention_kv(n, view)
        tables = []
        for r in self.rows:
            t = r.slots[:, :, :n]
            if t.shape[2] < n:
                t = torch.cat([t, t.new_zeros(*t.shape[:2], n - t.shape[2])], dim=2)
            tables.append(t)
        if n == 0 or self.pool.capacity(self.layer) == 0:
            spec = self.pool.spec
            z = torch.zeros(
                len(self.rows), spec.kv_heads, n, spec.head_dim, dtype=spec.dtype, device=spec.device
            )
            return z, z.clone()
        return self.pool.read(self.layer, torch.cat(tables), scratch=view)


class CacheBatch:
    """Several requests' caches seen by a backend as one batch (one row per request).

    ``decode``: the view of a decode step's plan, whose every request appends one row (its
    ``new_len`` all ones): the appends take that from the plan instead of reading it back."""

    def __init__(self, caches: list[KVCache], decode: bool = False):
        if not caches:
            raise ValueError("a batch view needs at least one cache")
        self.caches = caches
        memo: dict = {"decode": decode}
        self.layers = [LayerBatch([c.layers[i] for c in caches], memo) for i in range(len(caches[0].layers))]

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    def lengths(self) -> Tensor:
        """``(L, B)`` int64 valid entries per layer and request."""
        return torch.stack([layer.lengths for layer in self.layers])

    @property
    def processed(self) -> Tensor:
        return torch.cat([c.processed for c in self.caches])

    @processed.setter
    def processed(self, value: Tensor) -> None:
        # backends write ``cache.processed += new_len``: hand each request its own count back
        for b, c in enumerate(self.caches):
            c.processed = value[b : b + 1].clone()
