"""Attention math the PyTorch backend's layer step calls, kept apart from its transformers glue.

One decode row per sample: its softmax probabilities over a cache (``_one_row_probs``), the output
from them (``_one_row_out``), the statistics policies read from them (``_one_row_stats``), attention
over AttentionPack's post-RoPE factors in the rank space (``_rank_space_one_row``), a decode row read
from the pool through the slot tables, with or without its probabilities (``_paged_one_row``); the general
chunked statistics pass (``_stats``) and the slot list of a selected-attention decode row
(``_with_new_slot``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins.paged_cpu_plan import PagedCpuPlan
from vlkv.runtime.backend import AttendIndex
from vlkv.runtime.kv.paged import PagedHost


def _with_new_slot(index: AttendIndex, past: Tensor) -> tuple[Tensor, Tensor]:
    """Append each sample's new-entry slot ``past[b]`` after its listed past slots.

    Returns ``indices (B, H_kv, K + 1)`` and ``lengths (B, H_kv)``.
    """
    idx, lens = index.indices.to(past.device), index.lengths.to(past.device)
    b, h, _ = idx.shape
    idx = torch.cat([idx, idx.new_zeros(b, h, 1)], dim=2)
    idx.scatter_(2, lens[..., None], past[:, None, None].expand(b, h, 1))
    return idx, lens + 1


def _mask_invisible(scores: Tensor, past: Tensor, open_: Tensor | None) -> Tensor | None:
    """Set to -inf the columns of ``scores (B, H_kv, G, S)`` a one-row query does not see: past its
    ``past (B,)`` column, or closed in ``open_`` (``(B, H_kv, S)`` bool, optional). Returns the
    ``(B, 1 or H_kv, 1, S)`` visibility mask, or None when every column is visible."""
    s = scores.shape[-1]
    if open_ is None and int(past.min()) + 1 == s:
        return None
    vis = (torch.arange(s, device=scores.device)[None, :] <= past[:, None])[:, None, None, :]
    if open_ is not None:
        vis = vis & open_[:, :, None, :]
    scores.masked_fill_(~vis, float("-inf"))
    return vis


def _one_row_probs(
    q: Tensor, k: Tensor, scale: float, past: Tensor, open_: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """A decode step's attention probabilities: one new row per sample at slot ``past[b]``.

    ``q (B, H, 1, D)``, ``k (B, H_kv, S, D)``, ``past (B,)``, ``open_ (B, H_kv, S)`` or None →
    ``probs (B, H_kv, G, S)`` float32 (the softmax each query head takes) and the visibility
    ``(B, 1 or H_kv, 1, S)`` bool, or None when every row sees every column.
    """
    b, h, _, d = q.shape
    hkv = k.shape[1]
    # the G query heads of a KV head are G rows of one matmul: each K head is read once
    scores = torch.matmul(q.reshape(b, hkv, h // hkv, d).float(), k.float().transpose(-1, -2)).mul_(scale)
    vis = _mask_invisible(scores, past, open_)
    return torch.softmax(scores, dim=-1), vis


def _one_row_out(probs: Tensor, v: Tensor, q: Tensor) -> Tensor:
    """A decode step's attention output from its probabilities: ``probs (B, H_kv, G, S)`` float32,
    ``v (B, H_kv, S, D)``, ``q (B, H, 1, D)`` (shape and dtype of the result) → ``(B, H, 1, D)``.
    The probabilities go to ``v``'s dtype first, as a fused attention kernel feeds them to P·V."""
    return torch.matmul(probs.to(v.dtype), v).reshape(q.shape).to(q.dtype)


def _rank_space_one_row(
    q: Tensor, k: Tensor, v: Tensor, scale: float, past: Tensor, open_: Tensor | None, layer
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A decode step over a cache whose factored columns hold post-RoPE low-rank rows (path (b)).

    ``q (B, H, 1, D)``; ``k/v (B, H_kv, S, D)`` as read without filling the factored columns (their
    content is arbitrary). Factored scores are ``(q·D_kᵀ)·K̄ᵀ`` and their share of the output
    ``(p·V̄)·D_v``: the dense image K/V are never rebuilt. Returns ``out (B, H, 1, D)`` in ``q``'s
    dtype, ``probs (B, H_kv, G, S)`` float32 in table-column layout (the statistics read them) and
    the visibility as :func:`_one_row_probs`.
    """
    b, h, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.reshape(b, hkv, g, d).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # dense columns
    ids = layer.table(s).to(q.device)
    factored = (ids < 0) & layer.valid_mask(s)[:, None, :].to(q.device)  # (B, H_kv, S)
    picks = []
    for sb, f in enumerate(layer.lowrank.samples):
        if f is None:
            continue
        hs, cs = torch.nonzero(factored[sb], as_tuple=True)
        if hs.numel() == 0:
            continue
        kbar, vbar = f.bars_at_rank()
        # the G query heads of every KV head projected onto that head's slice of D_k: (H_kv, G, R)
        qd = torch.einsum("jgd,rjd->jgr", qg[sb], f.dk.float().view(-1, hkv, d))
        rows = -ids[sb, hs, cs] - 1
        # (N, G): column (h, c) scores its factor row against head h's projected queries
        scores[sb, hs, :, cs] = torch.einsum("ngr,nr->ng", qd[hs], kbar[rows]) * scale
        picks.append((sb, f, hs, cs, rows, vbar))
    vis = _mask_invisible(scores, past, open_)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.masked_fill(factored[:, :, None, :], 0.0), v.float())  # (B, H_kv, G, D)
    for sb, f, hs, cs, rows, vbar in picks:
        # probability mass per factor row and head, then through V̄ and D_v: (H_kv, G, R_v) → (H_kv, G, D)
        mass = torch.zeros(hkv, f.rows, g, device=q.device)
        mass.index_put_((hs, rows), probs[sb, hs, :, cs], accumulate=True)
        pv = torch.einsum("jtg,tr->jgr", mass, vbar)
        out[sb] += torch.einsum("jgr,rjd->jgd", pv, f.dv.float().view(-1, hkv, d))
    return out.view(b, h, 1, d).to(q.dtype), probs, vis


def _paged_one_row(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    rope: dict,
    host: PagedHost,
    stats: bool,
    exact: bool,
    last_plan: PagedCpuPlan | None,
    factors=None,
) -> tuple[Tensor, Tensor | None, Tensor | None, PagedCpuPlan | None]:
    """A decode step's attention read from one layer's pool through the slot tables (``paged_tables``:
    ``table (B, H_kv, C)``, ``lengths (B, H_kv)``, pre-RoPE keywords ``rope``, ``host`` its
    :class:`~vlkv.runtime.kv.paged.PagedHost`); ``q (B, H, 1, D)``, ``k_pool / v_pool (H_kv, S, D)``.

    Returns ``out (B, H, 1, D)`` in q's dtype, with ``stats`` the probabilities ``(B, H_kv, G, C)`` and
    visibility of ``paged_probs`` (else None, None), and the CPU read plan to keep for the next layer
    (``last_plan`` reused while the tables are the same: one plan per step). A statistics step reads
    K once for both: with the Triton kernel (CUDA or forced Triton) or the fused CPU kernel (fp32 CPU
    pools), no pre-RoPE keys, its output and probabilities come from one in-place read of each head's
    own table row; otherwise the two halves of
    ``paged_probs`` (probabilities, then P·V). ``exact``: the output is the plain read's, bit for bit.
    ``factors``: the layer's :class:`~vlkv.plugins.paged_lowrank.PagedFactors` (``paged_lowrank_tables``),
    read with the pool by the Triton low-rank kernel (:func:`_factors_one_row`)."""
    from vlkv.plugins import paged_attention
    from vlkv.plugins.ops import use_triton

    if factors is not None:
        return (
            *_factors_one_row(q, k_pool, v_pool, table, lengths, scale, rope, factors, stats, exact),
            last_plan,
        )

    plan = last_plan

    def plain() -> Tensor:  # the step's attention without statistics
        nonlocal plan
        # one plan per step for layers sharing tables (the CPU read's; the Triton kernel takes none)
        if not rope and q.device.type == "cpu" and not use_triton(q, k_pool, v_pool):
            from vlkv.plugins.paged_cpu import plan_reused

            plan = plan_reused(last_plan, q, k_pool, table, lengths, host.lengths, host.holes)
        return paged_attention(q, k_pool, v_pool, table, lengths, scale, plan=None if rope else plan, **rope)

    if not stats:
        return plain(), None, None, plan
    from vlkv.plugins.paged_probs import (
        decode_route,
        fused_decode_probs,
        paged_decode_out,
        paged_decode_probs,
        triton_decode_probs,
    )

    # one read of K and V for both: the Triton kernel (CUDA; pre-RoPE keys rotated as they load), else
    # the fused CPU kernel (no pre-RoPE keys)
    fused = triton_decode_probs(q, k_pool, v_pool, table, lengths, scale, host.lengths, host.holes, **rope)
    if fused is None and not rope:
        fused = fused_decode_probs(q, k_pool, v_pool, table, lengths, scale, host.lengths, host.holes)
    if fused is not None:
        out, probs, vis = fused
        return (plain() if exact else out), probs, vis, plan
    # routed from the cache's host lengths, once for both halves: no read back per layer
    route = decode_route(table, lengths, host=host.lengths, holes=host.holes)
    probs, vis = paged_decode_probs(q, k_pool, table, lengths, scale, **rope, route=route)
    if exact:
        out = paged_attention(q, k_pool, v_pool, table, lengths, scale, **rope)
    else:
        out = paged_decode_out(probs, v_pool, table, lengths, route=route).view(q.shape).to(q.dtype)
    return out, probs, vis, plan


def _factors_one_row(q, k_pool, v_pool, table, lengths, scale, rope, factors, stats, exact):
    """:func:`_paged_one_row` of a layer holding low-rank factors (same arguments): ``(out, probs, vis)``
    from ``triton_paged_lowrank`` (with ``stats`` its statistics form, one read for both; ``exact``: the
    output of the plain kernel, as a step without statistics computes it)."""
    from vlkv.plugins.triton_paged_lowrank import paged_lowrank_probs_triton, paged_lowrank_triton

    if not stats:
        return paged_lowrank_triton(q, k_pool, v_pool, table, lengths, scale, factors, **rope), None, None
    out, probs, vis = paged_lowrank_probs_triton(q, k_pool, v_pool, table, lengths, scale, factors, **rope)
    if exact:
        out = paged_lowrank_triton(q, k_pool, v_pool, table, lengths, scale, factors, **rope)
    return out, probs, vis


def _one_row_stats(probs: Tensor, vis: Tensor | None, rows: Tensor | None, threshold: float | None):
    """:func:`vlkv.plugins.attn_stats` of a decode step from its probabilities.

    ``probs (..., B, H_kv, G, S)``, ``vis (..., B, 1 or H_kv, 1, S)`` or None (all visible), ``rows (B, 1)``
    bool (samples whose row is requested; None: every sample's) → :class:`~vlkv.plugins.AttnStats` over
    ``S`` columns, ``colsum (..., B, H, S)``, ``below`` / ``visible (..., B, H)`` (leading dims: e.g. every
    layer of a static step at once). With ``rows`` None, ``colsum`` is a view of ``probs``.
    """
    from vlkv.plugins import AttnStats

    *lead, b, hkv, g, s = probs.shape
    on = None if rows is None else rows.reshape(b).to(probs.device)
    colsum = probs.reshape(*lead, b, hkv * g, s)
    if on is not None:
        colsum = colsum * on[:, None, None]
    if vis is None:
        seen = torch.full((*lead, b, hkv * g), s, dtype=torch.int64, device=probs.device)
    else:
        seen = vis.sum(-1, dtype=torch.int64).expand(*lead, b, hkv, g).reshape(*lead, b, hkv * g)
    below = None
    if threshold is not None:
        low = probs < threshold * probs.amax(-1, keepdim=True)
        if vis is not None:
            low &= vis
        below = low.sum(-1).reshape(*lead, b, hkv * g)
        if on is not None:
            below = below * on[:, None]
    return AttnStats(colsum=colsum, below=below, visible=seen if on is None else seen * on[:, None])


def _stats(q, k, scale, rows, threshold, past, new_len, selected, open_=None):
    """:func:`vlkv.plugins.attn_stats` over the full cache, or over the selected slots only.

    With ``selected = (indices (B, H_kv, K), lengths (B, H_kv))`` the softmax runs over the
    selected keys (what the step really attended) and ``colsum`` is scattered back to slots.
    With holes (``open_ (B, H_kv, S)`` False there), causality is expressed as an order mask (key
    ``j`` has order ``j``, row ``i`` order ``past + i``) so each KV head skips its own holes.
    """
    from vlkv.plugins import AttnStats, attn_stats

    if selected is None and open_ is not None:
        s, nq = k.shape[2], q.shape[2]
        key_order = torch.arange(s, device=k.device)[None, None, :].expand(k.shape[0], k.shape[1], s)
        key_order = key_order.masked_fill(~open_, torch.iinfo(torch.long).max)
        query_order = past[:, None] + torch.arange(nq, device=past.device)[None, :]
        return attn_stats(
            q,
            k,
            scale,
            query_rows=rows,
            causal=False,
            threshold=threshold,
            key_lengths=past + new_len,
            key_order=key_order,
            query_order=query_order,
        )
    if selected is None:
        return attn_stats(
            q,
            k,
            scale,
            query_rows=rows,
            causal=True,
            threshold=threshold,
            key_lengths=past + new_len,
            q_offset=past,
        )
    idx, lens = selected
    b, h, s = q.shape[0], q.shape[1], k.shape[2]
    hkv, width = idx.shape[1], idx.shape[2]
    g = h // hkv
    ok = torch.arange(width, device=idx.device)[None, None, :] < lens[..., None]
    idx = torch.where(ok, idx, torch.zeros_like(idx))
    k_sel = k.gather(2, idx[..., None].expand(-1, -1, -1, k.shape[-1]))
    if q.shape[2] == 1:  # a decode row (A-VL's core step): batched, nothing read back per layer
        from vlkv.plugins import selected_row_stats

        parts = [selected_row_stats(q, k_sel, lens, scale, query_rows=rows, threshold=threshold)]
    elif bool((lens == lens[:, :1]).all()):
        parts = [
            attn_stats(
                q, k_sel, scale, query_rows=rows, causal=False, threshold=threshold, key_lengths=lens[:, 0]
            )
        ]
    else:  # KV heads attend to different numbers of entries: one call per GQA group
        parts = [
            attn_stats(
                q[:, j * g : (j + 1) * g],
                k_sel[:, j : j + 1],
                scale,
                query_rows=rows,
                causal=False,
                threshold=threshold,
                key_lengths=lens[:, j],
            )
            for j in range(hkv)
        ]
    colsum_sel = torch.cat([p.colsum for p in parts], dim=1)  # (B, H, K)
    colsum = torch.zeros(b, h, s, dtype=colsum_sel.dtype, device=colsum_sel.device)
    colsum.scatter_add_(2, idx.repeat_interleave(g, dim=1), colsum_sel * ok.repeat_interleave(g, dim=1))
    below = None if threshold is None else torch.cat([p.below for p in parts], dim=1)
    return AttnStats(colsum=colsum, below=below, visible=torch.cat([p.visible for p in parts], dim=1))
