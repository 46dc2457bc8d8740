"""PyTorch launcher for ``paged_lowrank_kernels.py`` (see that module for the algorithm): the paged read of
a pool and AttentionPack's low-rank factor rows in one kernel (no dense copy of the factored entries)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors, check_factors, factored_chunk, factored_span
from vlkv.plugins.paged_lowrank_kernels import paged_lowrank_kernel
from vlkv.plugins.triton_paged_attention import _plan, launch_args, shared_launch
from vlkv.plugins.triton_paged_probs import normalise_probs, stats_buffers
from vlkv.plugins.triton_selected_attention import combine_splits


def rank_block(factors: PagedFactors) -> int:
    """``BLOCK_R``: the padded ranks' larger, a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, triton.next_power_of_2(max(factors.ranks)))


def paged_lowrank_triton(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    factors: PagedFactors,
    num_splits: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Triton version of ``paged_lowrank.paged_lowrank_reference``: same arguments and result (the factors
    in the pool's dtype), plus ``num_splits`` and ``sec`` as ``triton_paged_attention.paged_attention_triton``
    takes them (the M-RoPE table form: ``rot (B, H_kv, C, P)`` positions). ``chunk``: the columns a split
    of a row's factored span walks on average (``paged_lowrank.split_layout``); None: ``factored_chunk``
    (the basis loads at most a quarter of the dense bytes the span replaces); 1 gives the span its share of the
    splits whatever the basis loads cost (to time the two cuts against each other)."""
    batch, heads, num_q, dim = q.shape
    group = heads // max(k_pool.shape[0], 1)
    plan = _plan(
        batch * k_pool.shape[0], group * num_q, dim, v_pool.shape[-1], table.shape[-1], num_splits, q.device
    )
    out = torch.empty(batch, heads, num_q, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    _launch(q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, None, chunk)
    combine_splits(plan, out, k_pool.shape[0], group)
    return out


def paged_lowrank_probs_triton(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    factors: PagedFactors,
    num_splits: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
    probs_out: Tensor | None = None,
    vis_out: Tensor | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A statistics decode step (one query row) of :func:`paged_lowrank_triton`: ``out (B, H_q, 1, D_v)``,
    ``probs (B, H_kv, G, C)`` float32 and the held columns ``vis (B, H_kv, 1, C)`` bool (factored columns
    held), as ``triton_paged_probs.paged_probs_triton`` returns them, from the same one read (the kernel
    keeps the logits; ``paged_probs_kernels.probs_normalise_kernel`` normalises them). ``probs_out`` /
    ``vis_out``: buffers to write ``probs`` / ``vis`` into (a static step's: fixed addresses), contiguous,
    of those shapes (``vis_out`` ``(B, H_kv, 1, C)``). ``chunk``: as :func:`paged_lowrank_triton` takes it."""
    kv_heads, dim_v, cols = k_pool.shape[0], v_pool.shape[-1], table.shape[-1]
    plan, out, probs, vis = stats_buffers(q, kv_heads, dim_v, cols, num_splits, True, probs_out, vis_out)
    if plan is None:  # nothing to read
        return out, probs, vis
    _launch(q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, probs, chunk)
    # the normalise pass marks held columns by slot >= 0: a factored column is held whatever its slot
    held = torch.where(factors.frow.to(q.device) >= 0, 0, table.to(q.device))
    normalise_probs(plan, probs, held, lengths.to(q.device), vis, out, kv_heads)
    return out, probs, vis


def _launch(
    q, k_pool, v_pool, table, lengths, scale, factors, rot, cos, sin, sec, plan, out, probs, chunk
) -> None:
    """One ``paged_lowrank_kernel`` launch on ``plan`` into ``out`` (and the logits into ``probs`` when
    given: ``LOGITS``); arguments as :func:`paged_lowrank_triton` takes them."""
    rope_args = launch_args(q, k_pool, v_pool, table, lengths, rot, cos, sin, sec)
    check_factors(factors, k_pool, v_pool, table)
    dev = q.device
    table, lengths = table.to(dev), lengths.to(dev)
    f = PagedFactors(*(t.to(dev) for t in (factors.frow, factors.kbar, factors.dk, factors.vbar, factors.dv,
                                           factors.rank_k, factors.rank_v)))  # fmt: skip
    if q.shape[0] * k_pool.shape[0] == 0:
        out.zero_()
        return
    rank_k, rank_v = f.ranks
    span = factored_span(f, lengths)  # (B, H_kv, 2): the span's own splits load the bases
    post = factors.post_flags(dev).to(torch.int32)  # (B,): path (b) requests attend in the rank space
    if chunk is None:  # shapes only: a static step's capacities
        chunk = factored_chunk(rank_k, rank_v, q.shape[3], v_pool.shape[-1])
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    args, constexprs = shared_launch(q, k_pool, v_pool, table, lengths, scale, out, plan, rope_args, sec)
    paged_lowrank_kernel[plan.grid](
        *args, out if probs is None else probs, f.frow, f.kbar, f.dk, f.vbar, f.dv, f.rank_k, f.rank_v, span, post,
        *f.frow.stride(), *f.kbar.stride(), *f.dk.stride(), *f.vbar.stride(), *f.dv.stride(),
        span.stride(0), span.stride(1), rank_k, rank_v, chunk,
        LOGITS=probs is not None, BLOCK_R=rank_block(f), **constexprs,
    )  # fmt: skip
