"""What a paged read of a layer that holds low-rank factors (AttentionPack) takes from its cache.

:func:`~vlkv.runtime.kv.paged.paged_tables` gives the slot table, lengths and linked (pre-RoPE) rows of a
layer; a factored column there is a negative slot (``-(1 + factor row)``, :mod:`vlkv.runtime.kv.lowrank`),
which the plain paged read would skip as a hole. :func:`paged_lowrank_tables` adds the
``vlkv.plugins.paged_lowrank`` arguments: ``frow`` (the factor row of each factored column in the stack of
every request's rows, ``-1`` elsewhere, holes included), the stacked factors and per-request bases
(:class:`~vlkv.plugins.paged_lowrank.PagedFactors`), and, with pre-RoPE factored columns, the rotary
keywords in the table form (rows of the model's rotary table by position, ``Rope.table``; linked entries
included): no boolean-mask gather, no read back of a position. Reads no K/V.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors
from vlkv.runtime.kv.paged import PagedHost, linked_prerope, paged_tables, rope_by_position


def stack_factors(samples: list, frow: Tensor, dtype: torch.dtype) -> PagedFactors:
    """:class:`PagedFactors` of ``samples`` (one :class:`~vlkv.runtime.kv.lowrank.Factors` or None per
    request, at least one not None): rows stacked in request order, bases zero-padded to the largest
    rank, ``frow (B, H_kv, C)`` already naming rows of the stack; ``post_rope`` each request's path (b)
    flag (its factored keys read unrotated, in the rank space)."""
    held = [f for f in samples if f is not None]
    if not held:
        raise ValueError("stack_factors: no sample holds factors (paged_lowrank_tables returns None then)")
    rk = max((f.kbar.shape[1] for f in held), default=1)
    rv = max((f.vbar.shape[1] for f in held), default=1)
    dev = frow.device
    batch, width_k, width_v = len(samples), held[0].dk.shape[1], held[0].dv.shape[1]
    dk = torch.zeros(batch, rk, width_k, dtype=dtype, device=dev)
    dv = torch.zeros(batch, rv, width_v, dtype=dtype, device=dev)
    kbar, vbar, rank_k, rank_v = [], [], [], []
    for b, f in enumerate(samples):
        if f is None:
            continue
        dk[b, : f.dk.shape[0]] = f.dk
        dv[b, : f.dv.shape[0]] = f.dv
        kbar.append(torch.nn.functional.pad(f.kbar.to(dtype), (0, rk - f.kbar.shape[1])))
        vbar.append(torch.nn.functional.pad(f.vbar.to(dtype), (0, rv - f.vbar.shape[1])))
        rank_k.append(f.rank_k)
        rank_v.append(f.rank_v)
    # path (a) and path (b) requests share the launch: the flag is per request, as the bases are
    post = torch.tensor([f is not None and f.post_rope for f in samples], dtype=torch.bool, device=dev)
    return PagedFactors(
        frow,
        torch.cat(kbar),
        dk,
        torch.cat(vbar),
        dv,
        torch.cat(rank_k).long(),
        torch.cat(rank_v).long(),
        post,
    )


def paged_lowrank_tables(layer) -> tuple[Tensor, Tensor, Tensor, dict, PagedHost, PagedFactors | None]:
    """``(table, lengths, attended, rope, host, factors)``: :func:`paged_tables`' five (the table's
    factored and hole columns ``-1``) for ``layer`` (a ``LayerKV`` or a batch view), and its
    :class:`PagedFactors` (None when no request holds factors; then the five are :func:`paged_tables`'
    own; so too where ``LowRank.prune`` left every sample None). The pre-RoPE keywords cover linked
    entries and factored columns whose keys were factored before RoPE, in the rotary table form (then
    :func:`paged_tables`' row form is not built: no mask read back); ``attended`` counts factored columns
    (they are attended, not holes)."""
    low = layer.lowrank
    if low is None or all(f is None for f in low.samples):
        return (*paged_tables(layer), None)
    prerope = [f is not None and not f.post_rope for f in low.samples]  # known on the host
    table, lengths, attended, rope, host = paged_tables(layer, rope=not any(prerope))
    n = table.shape[2]
    dev = table.device
    raw = layer.table(n)
    fac = (raw < 0) & (torch.arange(n, device=dev) < lengths[..., None])
    open_ = layer.open_mask(n)
    if open_ is not None:
        fac = fac & open_
    offsets, start = [], 0
    for f in low.samples:
        offsets.append(start)
        start += 0 if f is None else f.rows
    offset = torch.tensor(offsets, dtype=torch.long, device=dev)[:, None, None]
    frow = torch.where(fac, -raw.long() - 1 + offset, -1)
    factors = stack_factors(low.samples, frow, layer.pool.spec.dtype)
    if any(prerope):
        pre = fac & torch.tensor(prerope, device=dev)[:, None, None]
        if any(r.linked for r in getattr(layer, "rows", [layer])):
            pre = pre | linked_prerope(layer, table, lengths)
        # the Triton kernels' table form: rows by position, M-RoPE by section (no read back)
        rope = rope_by_position(layer, pre, sec_form=True)
    table = torch.where(fac, -1, table)
    return table, lengths, attended, rope, host, factors
