"""AttentionPack's low-rank factors in a static decode step (``runtime/static_step.py``): fixed buffers.

The eager step reads a layer's factors (pre-RoPE, path (a), or post-RoPE, path (b)) through
``plugins.triton_paged_lowrank`` with tables built per step (``kv/paged_factors.paged_lowrank_tables``: ``frow``, the batch's factor rows
stacked, per-request bases). A static step's device half may read only buffers at fixed addresses and
shapes, so here:

- the **stacks** are fixed-capacity buffers per layer, ``kbar (L, N, R_k)``, ``vbar (L, N, R_v)``,
  ``rank_k, rank_v (L, N)``, the bases ``dk (L, B, R_k, H_kv·D)``, ``dv (L, B, R_v, H_kv·D_v)``, each
  request's first row ``offset (L, B)`` and each row's positions ``fpos (L, N + 1, P)`` (row ``N``: where
  the scatter drops what names no row). The host half (:meth:`StaticFactors.fill`) copies a request's
  factors into them only when they changed since the last copy (tensor identity: the policy's factor
  edit, ``kv/lowrank.apply_factor_edit``, replaces a sample's rank tensors when it sets ranks and its
  :class:`~vlkv.runtime.kv.lowrank.Factors` when it factors again). The edit itself runs in the
  scheduler's commit, eagerly, outside the step (and outside a graph);
- ``frow (B, H_kv, C)`` is written in the device half (:meth:`StaticFactors.read`) from the read table
  the append kernel wrote: a factored column's slot is ``-(1 + row)`` there (the request's own table;
  a request with factors has no per-head holes, whose ``-1`` would read as row 0: refused), so
  ``frow = offset - 1 - slot`` where the request holds factors, the slot is negative and the column is
  below the length; ``-1`` elsewhere. Each pre-RoPE factored column's positions go into the layer's
  ``rot`` twin from ``fpos`` (the append kernel writes ``rot`` for pool slots only), so the low-rank
  kernel rotates the rebuilt keys by the rotary table like any linked entry. A post-RoPE request's
  factored columns (path (b), flagged in ``post``) get no position: the kernel reads them in the rank
  space, unrotated.

Buffers are keyed by :func:`factors_key` (``N``, ``R_k``, ``R_v``): a batch whose factors outgrow them
gets new ones (a new graph), as a wider read table does. The kernel's launch stays fixed with them: its
split count comes from the read table's capacity and its factored span's chunk
(``paged_lowrank.factored_chunk``) from the stacks' ranks; which split walks which columns is decided in
the kernel from ``frow`` (``paged_lowrank.split_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors

# the stacks' rows grow in steps of this many (a capture per size)
ROWS_STEP = 256


def factored(cache) -> list:
    """Every request's per-layer :class:`~vlkv.runtime.kv.lowrank.LowRank` holders: ``[(layer, row)]``
    of the batch view's rows that hold factors."""
    return [(i, r) for i, la in enumerate(cache.layers) for r in la.rows if r.lowrank is not None]


def factors_refusal(cache, inputs) -> str | None:
    """Why a step whose requests hold factors cannot take the static forward (None: it can, or none
    holds factors). Host attributes only."""
    from vlkv.runtime import step_context

    held = factored(cache)
    if not held:
        return None
    if not step_context.PAGED_FACTORS:
        return "low-rank factors read densely (VLKV_PAGED_FACTORS=0)"
    if inputs.attend is not None:
        return "selected attention beside low-rank factors"
    for _, r in held:
        if r.holes is not None:
            return "low-rank factors beside per-head holes in one request"
    return None


def factors_key(cache) -> tuple[int, int, int, int, int] | None:
    """``(N, R_k, R_v, W_k, W_v)``: the stacks' row capacity (the most rows a layer's requests hold, in
    steps of :data:`ROWS_STEP`), ranks and basis widths a step's factors need; None without factors.
    Host shapes only."""
    rows, rk, rv, wk, wv = {}, 1, 1, 0, 0
    for i, r in factored(cache):
        for f in r.lowrank.samples:
            if f is None:
                continue
            rows[i] = rows.get(i, 0) + f.rows
            rk, rv = max(rk, f.kbar.shape[1]), max(rv, f.vbar.shape[1])
            wk, wv = f.dk.shape[1], f.dv.shape[1]
    if not rows:
        return None
    top = max(rows.values())
    return -(-top // ROWS_STEP) * ROWS_STEP, rk, rv, wk, wv


@dataclass(slots=True)
class StaticFactors:
    """A static step's factor buffers (shapes in the module docstring; ``B`` requests, ``L`` layers,
    ``C`` read-table columns, ``P`` position components).

    Attributes:
        has: ``(L, B)`` bool per layer the requests holding factors, set by :meth:`fill`.
        post: ``(L, B)`` bool those whose factors are post-RoPE (path (b): read in the rank space, their
            columns given no ``rot`` position), set by :meth:`fill`.
        frow: ``(B, H_kv, C)`` int64 the layer being read's factor rows (device half).
        columns: ``(C,)`` int64 ``0..C-1``.
        held: per (layer, request) the tensors last copied (identity: what :meth:`fill` compares).
    """

    has: Tensor
    post: Tensor
    offset: Tensor
    kbar: Tensor
    vbar: Tensor
    dk: Tensor
    dv: Tensor
    rank_k: Tensor
    rank_v: Tensor
    fpos: Tensor
    frow: Tensor
    columns: Tensor
    held: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers, rows = self.kbar.shape[:2]
        batch = self.has.shape[1]
        if (
            self.has.shape != (layers, batch)
            or self.post.shape != (layers, batch)
            or self.offset.shape != (layers, batch)
            or self.vbar.shape[:2] != (layers, rows)
        ):
            raise ValueError(
                f"StaticFactors: has/post/offset must be (L, B) = ({layers}, {batch}) and vbar (L, N, R_v) with N = "
                f"{rows}, got {tuple(self.offset.shape)} and {tuple(self.vbar.shape)}"
            )
        if self.dk.shape[:2] != (layers, batch) or self.dk.shape[2] != self.kbar.shape[2]:
            raise ValueError(f"StaticFactors.dk: must be (L, B, R_k, ·), got {tuple(self.dk.shape)}")
        if self.rank_k.shape != (layers, rows) or self.fpos.shape[:2] != (layers, rows + 1):
            raise ValueError(
                f"StaticFactors.rank_k / fpos: must be (L, N) / (L, N + 1, P), got "
                f"{tuple(self.rank_k.shape)} / {tuple(self.fpos.shape)}"
            )
        if self.frow.shape[0] != batch or self.columns.shape != (self.frow.shape[2],):
            raise ValueError(
                f"StaticFactors.frow / columns: must be (B, H_kv, C) / (C,), got {tuple(self.frow.shape)}"
            )

    @classmethod
    def make(
        cls, key: tuple, layers: int, batch: int, kv_heads: int, capacity: int, pos_dims: int, dtype, device
    ):
        """Zeroed buffers for :func:`factors_key`'s ``key`` (allocated once: a graph replays against them)."""
        rows, rk, rv, wk, wv = key
        i64 = dict(dtype=torch.long, device=device)
        return cls(
            has=torch.zeros(layers, batch, dtype=torch.bool, device=device),
            post=torch.zeros(layers, batch, dtype=torch.bool, device=device),
            offset=torch.zeros(layers, batch, **i64),
            kbar=torch.zeros(layers, rows, rk, dtype=dtype, device=device),
            vbar=torch.zeros(layers, rows, rv, dtype=dtype, device=device),
            dk=torch.zeros(layers, batch, rk, wk, dtype=dtype, device=device),
            dv=torch.zeros(layers, batch, rv, wv, dtype=dtype, device=device),
            rank_k=torch.zeros(layers, rows, **i64),
            rank_v=torch.zeros(layers, rows, **i64),
            fpos=torch.zeros(layers, rows + 1, pos_dims, **i64),
            frow=torch.full((batch, kv_heads, capacity), -1, **i64),
            columns=torch.arange(capacity, **i64),
        )

    @property
    def rows(self) -> int:
        """``N``."""
        return self.kbar.shape[1]

    def fill(self, cache) -> None:
        """Host half: every layer's factors of the batch view ``cache`` copied into the stacks where they
        changed since the last copy (device copies, no read back), ``has``, ``post`` and ``offset`` set."""
        has, post, offset = [], [], []
        for i, la in enumerate(cache.layers):
            start = 0
            for b, r in enumerate(la.rows):
                offset.append(start)
                f = None if r.lowrank is None else r.lowrank.samples[0]
                has.append(f is not None)
                post.append(f is not None and f.post_rope)
                if f is None:
                    self.held.pop((i, b), None)
                    continue
                self._copy(i, b, start, r, f)
                start += f.rows
        flags = ((self.has, has), (self.post, post), (self.offset, offset))
        for buf, host in ((b, torch.tensor(v)) for b, v in flags):
            if buf.device.type == "cuda":  # pinned: the copy does not wait for the stream
                host = host.pin_memory()
            buf.copy_(host.view(buf.shape), non_blocking=True)

    def _copy(self, i: int, b: int, start: int, r, f) -> None:
        """Request ``b``'s factors ``f`` of layer ``i`` (held by the one-sample cache ``r``) at rows
        ``start …``: the rows, bases and positions when its factors changed; the ranks when they did."""
        was = self.held.get((i, b))
        n = f.rows
        rows = slice(start, start + n)
        if was is None or was[0] is not f.kbar or was[1] != start:
            self.kbar[i, rows].zero_()
            self.kbar[i, rows, : f.kbar.shape[1]].copy_(f.kbar)
            self.vbar[i, rows].zero_()
            self.vbar[i, rows, : f.vbar.shape[1]].copy_(f.vbar)
            self.dk[i, b].zero_()
            self.dk[i, b, : f.dk.shape[0]].copy_(f.dk)
            self.dv[i, b].zero_()
            self.dv[i, b, : f.dv.shape[0]].copy_(f.dv)
            self._positions(i, start, r)
            was = None
        if was is None or was[2] is not f.rank_k or was[3] is not f.rank_v:
            self.rank_k[i, rows].copy_(f.rank_k)
            self.rank_v[i, rows].copy_(f.rank_v)
        self.held[(i, b)] = (f.kbar, start, f.rank_k, f.rank_v)

    def _positions(self, i: int, start: int, r) -> None:
        """``fpos[i]``'s rows of request ``r`` (one-sample cache, its factor rows from ``start``): each
        factored column's positions, scattered by row (no mask read back; other columns to row ``N``)."""
        slots, positions = r.slots, r.positions  # (1, H_kv, W), (1, H_kv, W, P)
        width = slots.shape[2]
        named = (slots < 0) & (torch.arange(width, device=slots.device) < r.lengths[:, None, None])
        at = torch.where(named, start - 1 - slots, self.rows).reshape(-1, 1)
        pos = positions.reshape(-1, positions.shape[-1])
        self.fpos[i].scatter_(0, at.expand(-1, pos.shape[1]).to(self.fpos.device), pos.to(self.fpos))

    def read(self, i: int, table: Tensor, lengths: Tensor, rot: Tensor | None) -> PagedFactors:
        """Device half, layer ``i`` after its append: ``frow`` from the read table ``table (B, H_kv, C)``
        and ``lengths (B, H_kv)`` (module docstring), each factored column's positions into ``rot (B,
        H_kv, C, P)`` (the layer's pre-RoPE twin; None: nothing rotates), and the layer's
        :class:`PagedFactors` over the stacks. No host read."""
        on = (table < 0) & (self.columns < lengths[..., None]) & self.has[i][:, None, None]
        torch.sub(self.offset[i][:, None, None] - 1, table, out=self.frow)
        self.frow.masked_fill_(~on, -1)
        if rot is not None:  # pre-RoPE factored columns only: path (b)'s keys are stored rotated
            at = self.frow.clamp_min(0).reshape(-1)
            got = self.fpos[i].index_select(0, at).view(rot.shape)
            pre = on & ~self.post[i][:, None, None]
            torch.where(pre[..., None], got, rot, out=rot)
        return PagedFactors(
            self.frow,
            self.kbar[i],
            self.dk[i],
            self.vbar[i],
            self.dv[i],
            self.rank_k[i],
            self.rank_v[i],
            self.post[i],
        )


def attend_factors(
    bufs, i: int, q: Tensor, keys: Tensor, values: Tensor, rot: Tensor | None, rope: dict, scale
):
    """Layer ``i``'s paged read in a static step with factors (after its append): the low-rank kernel
    over the pool and the stacks (``triton_paged_lowrank``: the plain read, or with ``bufs.probs`` its
    statistics form into the buffers), ``rope`` the rotary keywords over ``rot``. ``q (B, H, 1, D)`` →
    ``(B, H, 1, D_v)``. A hole step's ``held`` row is the columns each head attends (factored ones
    included). Reads ``bufs`` (a ``StaticBuffers``) only: no host read."""
    from vlkv.plugins.triton_paged_lowrank import paged_lowrank_probs_triton, paged_lowrank_triton

    table, lengths = bufs.table, bufs.lengths[i]
    factors = bufs.factors.read(i, table, lengths, rot)
    held = None if bufs.held is None else bufs.held[i]
    if bufs.probs is None:
        out = paged_lowrank_triton(q, keys, values, table, lengths, scale, factors, **rope)
        if held is not None:  # held: a pool slot or a factor row, below the length (no host read)
            inside = bufs.columns < lengths[..., None]
            torch.logical_and((table >= 0) | (factors.frow >= 0), inside, out=held[:, :, 0])
        return out
    out, _, _ = paged_lowrank_probs_triton(
        q, keys, values, table, lengths, scale, factors, probs_out=bufs.probs[i], vis_out=held, **rope
    )
    if bufs.exact:  # the plain read's output (as the eager step's exact_output)
        out = paged_lowrank_triton(q, keys, values, table, lengths, scale, factors, **rope)
    return out
