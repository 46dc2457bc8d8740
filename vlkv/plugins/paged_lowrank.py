"""Paged attention over a pool *and low-rank factors*: AttentionPack's factored entries read in place.

The paged read (``paged_reference``) takes one more table, ``frow (B, H_kv, C)`` int64: a column whose
``frow`` is ``>= 0`` (inside its row's length) is a factored entry, its key and value rebuilt from factor
row ``frow`` instead of read from a pool slot (its ``table`` slot is ignored); ``-1`` elsewhere, so a
factor row never collides with a hole (a negative *slot* of a column that is not factored).

Factors (:class:`PagedFactors`), AttentionPack's joint-head truncated SVD (``runtime/kv/lowrank.py``):
- ``kbar (N, R_k)``, ``vbar (N, R_v)``: the rows of every request stacked (request ``b``'s rows at
  ``[offset_b, offset_b + T_b)``; ``frow`` names rows of this stack). Stacked, not ``(B, T_max, R)``:
  requests factor different numbers of rows (ragged), and one global row index per column is one
  gather in a kernel, the same as a slot (no per-request offset arithmetic, no padding rows);
- ``dk (B, R_k, H_kv·D)``, ``dv (B, R_v, H_kv·D_v)``: each request's bases (heads concatenated in the
  columns), zero-padded to the largest rank of the batch (zero basis rows add nothing; a request with
  no factors has zero bases, never read). Per request, not per row: a kernel program (request, KV head)
  loads its ``(R, D)`` slice once and keeps it across the columns it walks;
- ``rank_k, rank_v (N,)`` int64: the components each row is rebuilt with (columns ``>=`` its rank
  masked), at most ``R``.

A factored key is stored pre-RoPE (path (a)) and rebuilt, then rotated by its ``rot`` row like any
pre-RoPE entry (RoPE does not factor through the rank space: each row is rebuilt first); a factored
key with ``rot = -1`` was factored post-RoPE and is read as rebuilt. Rounding follows
``LowRank.fill`` (path (a)): a row is rebuilt in float32 and rounded to the pool's dtype (the entry the
pool would hold), then rotated in float32 and rounded. Values: ``v = (v̄ ⊙ mask)·D_v``, rounded
likewise in this reference (the Triton kernel accumulates ``Σ p·v̄`` in the rank space instead and
multiplies by ``D_v`` once: no rounding, within the dtype's tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.plugins.paged_reference import (
    attend_gathered,
    check_paged_args,
    held_columns,
    rotate_keys,
    visible_columns,
)


@dataclass(frozen=True)
class PagedFactors:
    """A batch's low-rank factors as the paged read takes them (shapes in the module docstring).

    Attributes:
        frow: ``(B, H_kv, C)`` int64 factor row of each column, ``-1`` where not factored.
        kbar: ``(N, R_k)``. dk: ``(B, R_k, H_kv·D)``. vbar: ``(N, R_v)``. dv: ``(B, R_v, H_kv·D_v)``.
        rank_k, rank_v: ``(N,)`` int64 each row's reconstruction ranks.
    """

    frow: Tensor
    kbar: Tensor
    dk: Tensor
    vbar: Tensor
    dv: Tensor
    rank_k: Tensor
    rank_v: Tensor

    def __post_init__(self) -> None:
        if self.frow.dim() != 3 or self.frow.dtype != torch.long:
            raise ValueError(f"PagedFactors.frow: must be int64 (B, H_kv, C), got {tuple(self.frow.shape)}")
        rows = self.kbar.shape[0]
        if self.kbar.dim() != 2 or self.vbar.dim() != 2 or self.vbar.shape[0] != rows:
            raise ValueError(
                f"PagedFactors.kbar/vbar: must be (N, R_k) and (N, R_v), got {tuple(self.kbar.shape)} "
                f"and {tuple(self.vbar.shape)}"
            )
        batch = self.frow.shape[0]
        for name, basis, bar in (("dk", self.dk, self.kbar), ("dv", self.dv, self.vbar)):
            if basis.dim() != 3 or basis.shape[:2] != (batch, bar.shape[1]):
                raise ValueError(
                    f"PagedFactors.{name}: must be (B, R, H_kv·D) = ({batch}, {bar.shape[1]}, ·), "
                    f"got {tuple(basis.shape)}"
                )
        for name, rank in (("rank_k", self.rank_k), ("rank_v", self.rank_v)):
            if rank.shape != (rows,) or rank.dtype != torch.long:
                raise ValueError(f"PagedFactors.{name}: must be int64 ({rows},), got {tuple(rank.shape)}")

    @property
    def ranks(self) -> tuple[int, int]:
        """``(R_k, R_v)``: the padded ranks."""
        return self.kbar.shape[1], self.vbar.shape[1]

    def nbytes(self) -> int:
        """Bytes of the factor tensors (rows, bases; not the tables)."""
        return sum(t.numel() * t.element_size() for t in (self.kbar, self.dk, self.vbar, self.dv))


def check_factors(f: PagedFactors, k_pool: Tensor, v_pool: Tensor, table: Tensor) -> None:
    """The factors fit the pool (``H_kv·D`` basis columns, its dtype) and the table (``frow``'s shape)."""
    kv_heads = k_pool.shape[0]
    if f.frow.shape != table.shape:
        raise ValueError(f"frow must be (B, H_kv, C) = {tuple(table.shape)}, got {tuple(f.frow.shape)}")
    if f.dk.shape[2] != kv_heads * k_pool.shape[2] or f.dv.shape[2] != kv_heads * v_pool.shape[2]:
        raise ValueError(
            f"dk/dv columns must be H_kv·D = {kv_heads * k_pool.shape[2]} / {kv_heads * v_pool.shape[2]}, "
            f"got {f.dk.shape[2]} / {f.dv.shape[2]}"
        )
    if not k_pool.dtype == f.kbar.dtype == f.dk.dtype == f.vbar.dtype == f.dv.dtype:
        raise ValueError(f"factors must be in the pool's dtype {k_pool.dtype}, got {f.kbar.dtype}")


def factored_columns(f: PagedFactors, lengths: Tensor) -> Tensor:
    """``(B, H_kv, C)`` bool: the columns inside their row's length that name a factor row."""
    cols = torch.arange(f.frow.shape[-1], device=f.frow.device)
    return (f.frow >= 0) & (cols < lengths.to(f.frow.device)[..., None])


def factored_span(f: PagedFactors, lengths: Tensor) -> Tensor:
    """``(B, H_kv, 2)`` int32: each row's first factored column and one past its last (``C, 0`` where it
    holds none). A kernel program whose columns miss this span loads no basis."""
    fac = factored_columns(f, lengths)
    c = fac.shape[-1]
    if c == 0:  # no columns: nothing held (amin of nothing is an error)
        return torch.zeros(*fac.shape[:2], 2, dtype=torch.int32, device=fac.device)
    cols = torch.arange(c, device=fac.device)
    first = torch.where(fac, cols, c).amin(-1)
    after = torch.where(fac, cols + 1, 0).amax(-1)
    return torch.stack([first, after], -1).to(torch.int32).contiguous()


def split_ranges(lengths: Tensor, num_splits: int, block_n: int) -> tuple[Tensor, Tensor]:
    """``(start, stop)`` each ``(B, H_kv, num_splits)``: the columns each split of a row walks, as the
    kernel cuts a decode row (its length in ``num_splits`` parts, rounded up to ``block_n``)."""
    n = lengths.long().clamp_min(0)[..., None]
    per = (n + num_splits - 1) // num_splits
    per = (per + block_n - 1) // block_n * block_n
    start = torch.arange(num_splits, device=n.device) * per
    return start, torch.minimum(start + per, n)


def rebuild(bar: Tensor, rank: Tensor, basis: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Each column's entry from its factor row: ``bar (N, R)`` rows ``rows (B, H_kv, C)`` (clamped to
    >= 0), masked past ``rank (N,)``, times request b's head-h slice of ``basis (B, R, H_kv·D)``, in
    float32; returns ``(B, H_kv, C, D)`` rounded to ``dtype``."""
    b, h, _ = rows.shape
    r = bar.shape[1]
    idx = rows.clamp_min(0)
    on = torch.arange(r, device=bar.device) < rank[idx][..., None]  # (B, H_kv, C, R)
    coef = torch.where(on, bar.float()[idx], 0.0)
    per_head = basis.float().view(b, r, h, -1).permute(0, 2, 1, 3)  # (B, H_kv, R, D)
    return torch.matmul(coef, per_head).to(dtype)


def paged_lowrank_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    factors: PagedFactors,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> Tensor:
    """``paged_reference.paged_attention_reference`` (same arguments, same result on the unfactored
    columns) where the columns ``factors.frow`` names read rebuilt factor rows (module docstring).

    Returns (B, H_q, Q, D_v) in q's dtype; float32 scores, softmax and weighted sum.
    """
    k, v, vis = paged_lowrank_kv(q, k_pool, v_pool, table, lengths, factors, rot, cos, sin)
    return attend_gathered(q, k, v, vis, scale)


def paged_lowrank_kv(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    factors: PagedFactors,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`paged_lowrank_reference` attends: ``k, v (B, H_kv, C, D)`` in the pool's dtype, every
    held column's key as read (pool or rebuilt, rotated where pre-RoPE), and ``vis (B, H_kv, Q, C)``
    which columns each query row sees (factored columns held whatever their slot)."""
    _, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    check_factors(factors, k_pool, v_pool, table)
    dev = q.device
    lengths = lengths.to(dev)
    fac = factored_columns(factors, lengths)
    # a factored column is held whatever its slot says: the pool read sees slot 0 there (overwritten)
    table = torch.where(fac, 0, table.to(dev))
    vis, slots = visible_columns(table, lengths, q.shape[2])
    rows = torch.arange(k_pool.shape[0], device=dev)[None, :, None]
    k, v = k_pool[rows, slots], v_pool[rows, slots]  # (B, H_kv, C, D)
    frow = factors.frow.to(dev)
    k = torch.where(fac[..., None], rebuild(factors.kbar, factors.rank_k, factors.dk, frow, k.dtype), k)
    v = torch.where(fac[..., None], rebuild(factors.vbar, factors.rank_v, factors.dv, frow, v.dtype), v)
    if rope:  # only held entries (dense or factored) rotate
        held = held_columns(table, lengths)
        k = rotate_keys(k, torch.where(held, rot.to(dev), -1), cos.to(dev), sin.to(dev))
    return k, v, vis


def factored_read_bytes(
    factors: PagedFactors, lengths: Tensor, head_dim: int, dim_v: int, num_splits: int = 1, block_n: int = 16
) -> tuple[int, int]:
    """``(kernel, dense)``: bytes the low-rank kernel loads for the factored columns of one decode call
    cut in ``num_splits`` splits of ``block_n``-rounded columns (the launch's), against the bytes the same
    columns would read as dense pool entries (``(D + D_v)`` a column and head).

    Counted per (column, head), as each KV head's program loads them (no sharing across heads assumed):
    a factored column reads its row's ``rank_k + rank_v`` components (loads past a row's rank are
    masked); each (request, head, split) program whose columns meet the row's factored span
    (:func:`factored_span`, the kernel's test) loads its basis slices, ``R_k·D + R_v·D_v`` (the keys'
    permuted partner slice re-reads the same bytes); one row tile of query heads per program (``G <=
    64``). ``lengths (B, H_kv)``."""
    fac = factored_columns(factors, lengths)  # (B, H_kv, C)
    item = factors.kbar.element_size()
    rows = factors.frow[fac]
    components = int((factors.rank_k[rows] + factors.rank_v[rows]).sum())
    rank_k, rank_v = factors.ranks
    span = factored_span(factors, lengths).long()
    start, stop = split_ranges(lengths, num_splits, block_n)
    programs = int(((span[..., :1] < stop) & (span[..., 1:] > start)).sum())
    kernel = (components + programs * (rank_k * head_dim + rank_v * dim_v)) * item
    return kernel, int(fac.sum()) * (head_dim + dim_v) * item
