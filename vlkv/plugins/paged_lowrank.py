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
  masked), at most ``R``;
- ``post_rope (B,)`` bool or None (none): request ``b``'s keys were factored after RoPE (AttentionPack
  path (b)). Per request, as the bases are: a batch mixes path (a) and path (b) requests in one launch.

A factored key is stored pre-RoPE (path (a)) and rebuilt, then rotated by its ``rot`` row like any
pre-RoPE entry (RoPE does not factor through the rank space: each row is rebuilt first); a factored
key with ``rot = -1`` is read as rebuilt, unrotated. Rounding follows ``LowRank.fill`` (path (a)): a
row is rebuilt in float32 and rounded to the pool's dtype (the entry the pool would hold), then rotated
in float32 and rounded. A post-RoPE request's factored columns (path (b)) are never rotated (their
``rot`` is ignored) nor rounded: the eager read attends to them in the rank space in float32
(``attention_rows._rank_space_one_row``: scores ``(q·D_kᵀ)·K̄ᵀ``, values ``(p·V̄)·D_v``), and so does
the Triton kernel; this reference rebuilds them in float32 (``q·(K̄·D_k)ᵀ``, the same sums reordered).
Values: ``v = (v̄ ⊙ mask)·D_v``, rounded likewise in this reference for path (a) (the Triton kernel
accumulates ``Σ p·v̄`` in the rank space instead and multiplies by ``D_v`` once: no rounding, within the
dtype's tolerance).
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
        post_rope: ``(B,)`` bool, request b's keys factored after RoPE (path (b)); None: none is.
    """

    frow: Tensor
    kbar: Tensor
    dk: Tensor
    vbar: Tensor
    dv: Tensor
    rank_k: Tensor
    rank_v: Tensor
    post_rope: Tensor | None = None

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
        post = self.post_rope
        if post is not None and (post.shape != (batch,) or post.dtype != torch.bool):
            raise ValueError(
                f"PagedFactors.post_rope: must be bool ({batch},), got {tuple(post.shape)} {post.dtype}"
            )

    def post_flags(self, device: torch.device | str) -> Tensor:
        """``(B,)`` bool on ``device``: the requests holding post-RoPE factors (all False without the
        field)."""
        if self.post_rope is None:
            return torch.zeros(self.frow.shape[0], dtype=torch.bool, device=device)
        return self.post_rope.to(device)

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


# a split of the factored span walks at least BASES_SHARE times the columns whose dense K/V weigh as much as
# the basis slices it loads (R_k·D + R_v·D_v): its one basis load then costs at most 1/BASES_SHARE of the
# dense bytes its columns replace (4: rows of AttentionPack's default ranks are ~0.22 of dense, so the
# whole read stays under half the dense K/V)
BASES_SHARE = 4


def factored_chunk(rank_k: int, rank_v: int, dim: int, dim_v: int) -> int:
    """The columns a split of a row's factored span walks on average, at least (:data:`BASES_SHARE`; rounding
    to the tile can leave one split shorter); the padded ranks
    ``R_k, R_v`` and head dims: shapes only (a static step's capacities), never data."""
    return max(1, -(-BASES_SHARE * (rank_k * dim + rank_v * dim_v) // max(dim + dim_v, 1)))


def split_layout(
    span: Tensor, lengths: Tensor, num_splits: int, block_n: int, chunk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """How the kernel cuts a decode row's columns among its ``num_splits`` programs (its launch grid, a
    function of shapes): ``(splits_f (B, H_kv), start, stop (B, H_kv, S), holds (B, H_kv, S))``.

    A row's columns are walked in a *virtual* order: its factored span ``[a, e)`` (``span (B, H_kv, 2)``,
    :func:`factored_span`, clipped to the length) first, then the dense rest (``[0, a)`` then ``[e,
    length)``; :func:`virtual_columns`). The span gets ``splits_f = clamp(min(⌊(e − a) / chunk⌋,
    round(S·(e − a) / length)), 1, S − 1)`` splits (``0`` without factored columns, ``1`` with one
    split): each walks about ``(e − a) / splits_f >= chunk`` columns (:func:`factored_chunk`: one basis
    load amortised), and no more of the ``S`` than the span's share of the columns (a long conversation
    after a small image keeps its splits for the dense columns); the other ``S − splits_f`` splits take
    the dense columns. Each part is cut in ``block_n``-rounded pieces; the last split also walks
    whatever is left (with one split: every column). ``holds``: the split walks factored columns and
    loads the bases (the only programs that do). ``[start, stop)`` are virtual positions."""
    n = lengths.long().clamp_min(0)
    a = torch.minimum(span[..., 0].long().clamp_min(0), n)
    e = torch.minimum(torch.maximum(span[..., 1].long(), a), n)
    n_f = e - a
    share = (2 * num_splits * n_f + n) // (2 * n).clamp_min(1)  # the span's share of the splits, rounded
    splits_f = torch.where(n_f > 0, torch.minimum(n_f // chunk, share).clamp(1, max(num_splits - 1, 1)), 0)
    per_f = _round_up(-(-n_f // splits_f.clamp_min(1)), block_n)[..., None]
    per_d = _round_up(-(-(n - n_f) // (num_splits - splits_f).clamp_min(1)), block_n)[..., None]
    split = torch.arange(num_splits, device=n.device)
    on_f = split < splits_f[..., None]
    start = torch.where(on_f, split * per_f, n_f[..., None] + (split - splits_f[..., None]) * per_d)
    stop = torch.where(
        on_f, torch.minimum(start + per_f, n_f[..., None]), torch.minimum(start + per_d, n[..., None])
    )
    holds = on_f & (start < stop)
    stop = torch.where(split == num_splits - 1, n[..., None], stop)
    return splits_f, start, stop, holds


def virtual_columns(span: Tensor, lengths: Tensor, virtual: Tensor) -> Tensor:
    """The table columns at :func:`split_layout`'s virtual positions ``virtual (B, H_kv, …)``: the span
    ``[a, e)`` first, then ``[0, a)``, then ``[e, length)`` (the kernel's mapping)."""
    n = lengths.long().clamp_min(0)
    a = torch.minimum(span[..., 0].long().clamp_min(0), n)
    n_f = torch.minimum(torch.maximum(span[..., 1].long(), a), n) - a
    shape = (*n_f.shape, *([1] * (virtual.dim() - n_f.dim())))
    a, n_f = a.view(shape), n_f.view(shape)
    return torch.where(virtual < n_f, a + virtual, torch.where(virtual < n_f + a, virtual - n_f, virtual))


def _round_up(x: Tensor, block: int) -> Tensor:
    return (x + block - 1) // block * block


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
    """What :func:`paged_lowrank_reference` attends: ``k, v (B, H_kv, C, D)`` in the pool's dtype (float32
    where a request holds post-RoPE factors), every
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
    post = fac & factors.post_flags(dev)[:, None, None]  # path (b)'s factored columns
    if rope:  # only held entries (dense or factored pre-RoPE) rotate
        held = held_columns(table, lengths) & ~post
        k = rotate_keys(k, torch.where(held, rot.to(dev), -1), cos.to(dev), sin.to(dev))
    if factors.post_rope is not None and bool(factors.post_rope.any()):  # path (b): float32, unrounded
        kf = rebuild(factors.kbar, factors.rank_k, factors.dk, frow, torch.float32)
        vf = rebuild(factors.vbar, factors.rank_v, factors.dv, frow, torch.float32)
        k = torch.where(post[..., None], kf, k.float())
        v = torch.where(post[..., None], vf, v.float())
    return k, v, vis


def factored_read_bytes(
    factors: PagedFactors,
    lengths: Tensor,
    head_dim: int,
    dim_v: int,
    num_splits: int = 1,
    block_n: int = 16,
    chunk: int | None = None,
) -> tuple[int, int]:
    """``(kernel, dense)``: bytes the low-rank kernel loads for the factored columns of one decode call
    cut in ``num_splits`` splits (:func:`split_layout`, the launch's cut with its ``block_n`` and ``chunk``,
    None: :func:`factored_chunk`, as the launcher's ``chunk``), against the bytes the same columns would read as dense pool entries (``(D +
    D_v)`` a column and head).

    Counted per (column, head), as each KV head's program loads them (no sharing across heads assumed):
    a factored column reads its row's ``rank_k + rank_v`` components (loads past a row's rank are
    masked); each (request, head, split) program that walks factored columns (``holds``) loads its basis
    slices, ``R_k·D + R_v·D_v`` (the keys' permuted partner slice re-reads the same bytes); one row tile
    of query heads per program (``G <= 64``). ``lengths (B, H_kv)``."""
    fac = factored_columns(factors, lengths)  # (B, H_kv, C)
    item = factors.kbar.element_size()
    rows = factors.frow[fac]
    components = int((factors.rank_k[rows] + factors.rank_v[rows]).sum())
    rank_k, rank_v = factors.ranks
    if chunk is None:
        chunk = factored_chunk(rank_k, rank_v, head_dim, dim_v)
    _, _, _, holds = split_layout(factored_span(factors, lengths), lengths, num_splits, block_n, chunk)
    kernel = (components + int(holds.sum()) * (rank_k * head_dim + rank_v * dim_v)) * item
    return kernel, int(fac.sum()) * (head_dim + dim_v) * item
