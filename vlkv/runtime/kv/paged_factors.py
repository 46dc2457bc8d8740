"""What a paged read of a layer that holds low-rank factors (AttentionPack) takes from its cache.

:func:`~vlkv.runtime.kv.paged.paged_tables` gives the slot table, lengths and linked (pre-RoPE) rows of a
layer; a factored column there is a negative slot (``-(1 + factor row)``, :mod:`vlkv.runtime.kv.lowrank`),
which the plain paged read would skip as a hole. :func:`paged_lowrank_tables` adds the
``vlkv.plugins.paged_lowrank`` arguments: ``frow`` (the factor row of each factored column in the stack of
every request's rows, ``-1`` elsewhere, holes included), the stacked factors and per-request bases
(:class:`~vlkv.plugins.paged_lowrank.PagedFactors`), and, with pre-RoPE factored columns, the rotary
keywords in the table form (rows of the model's rotary table by position, ``Rope.table``; linked entries
included): no boolean-mask gather, no read back of a position. Reads no K/V.

The stacks built from the factor tensors are kept per pool layer (:class:`_Stacks`) and reused while the
batch's factor tensors are the same objects: a decode step then stacks only the ranks (which the factor
edit sets every step), not every request's padded rows and bases in every layer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.plugins.paged_lowrank import PagedFactors
from vlkv.runtime.kv.paged import PagedHost, linked_prerope, paged_tables, rope_by_position


@dataclass(frozen=True, slots=True)
class _Stacks:
    """What :func:`stack_factors` builds from a batch's factor tensors alone (not their ranks), kept per
    pool layer between steps (:data:`_KEPT`) while the same tensors are read.

    Attributes:
        held: per request ``(kbar, dk, vbar, dv, post_rope)`` or None: the tensors stacked, compared by
            identity (a factor edit that factors again or prunes replaces them; setting ranks does not
            touch them), and the path flag by value.
        dtype: the stacks' dtype.
        kbar: ``(N, R_k)`` every request's rows, zero-padded to the largest rank; ``vbar (N, R_v)`` alike.
        dk: ``(B, R_k, H_kv·D)`` the bases, zero-padded; ``dv (B, R_v, H_kv·D_v)`` alike.
        post: ``(B,)`` bool each request's path (b) flag.
        offset: ``(B, 1, 1)`` int64 each request's first row in the stack.
        prerope: ``(B, 1, 1)`` bool the requests whose factored keys are pre-RoPE (path (a)).
    """

    held: tuple
    dtype: torch.dtype
    kbar: Tensor
    dk: Tensor
    vbar: Tensor
    dv: Tensor
    post: Tensor
    offset: Tensor
    prerope: Tensor

    def __post_init__(self) -> None:
        batch = len(self.held)
        if self.dk.shape[0] != batch or self.post.shape != (batch,) or self.offset.shape != (batch, 1, 1):
            raise ValueError(
                f"_Stacks: dk (B, ...), post (B,), offset (B, 1, 1) with B = {batch}, got "
                f"{tuple(self.dk.shape)}, {tuple(self.post.shape)}, {tuple(self.offset.shape)}"
            )
        if self.kbar.shape[0] != self.vbar.shape[0]:
            raise ValueError(
                f"_Stacks: kbar and vbar must have the same rows, got {self.kbar.shape} / {self.vbar.shape}"
            )

    def same(self, held: tuple, dtype: torch.dtype) -> bool:
        """Whether these stacks were built from exactly ``held`` (identity) at ``dtype``."""
        if dtype != self.dtype or len(held) != len(self.held):
            return False
        for a, b in zip(held, self.held):
            if (a is None) != (b is None):
                return False
            if a is not None and (any(x is not y for x, y in zip(a[:4], b[:4])) or a[4] != b[4]):
                return False
        return True


# per pool (weakly) and pool layer, the last stacks built: an eager step's layers each read their own
# factors, and a request's factor tensors change only when an edit replaces them, so the next step
# reuses the stacks instead of padding and copying every request's factors again (~6 ops a request
# and layer). Holds the last batch's factor tensors until that pool layer is read with factors again.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _held(samples: list) -> tuple:
    return tuple(None if f is None else (f.kbar, f.dk, f.vbar, f.dv, bool(f.post_rope)) for f in samples)


def _build(samples: list, held: tuple, dtype: torch.dtype, dev) -> _Stacks:
    """:class:`_Stacks` of ``samples`` (at least one not None) on ``dev``."""
    some = [f for f in samples if f is not None]
    rk = max((f.kbar.shape[1] for f in some), default=1)
    rv = max((f.vbar.shape[1] for f in some), default=1)
    batch, width_k, width_v = len(samples), some[0].dk.shape[1], some[0].dv.shape[1]
    dk = torch.zeros(batch, rk, width_k, dtype=dtype, device=dev)
    dv = torch.zeros(batch, rv, width_v, dtype=dtype, device=dev)
    kbar, vbar, offsets, start = [], [], [], 0
    for b, f in enumerate(samples):
        offsets.append(start)
        if f is None:
            continue
        start += f.rows
        dk[b, : f.dk.shape[0]] = f.dk
        dv[b, : f.dv.shape[0]] = f.dv
        kbar.append(torch.nn.functional.pad(f.kbar.to(dtype), (0, rk - f.kbar.shape[1])))
        vbar.append(torch.nn.functional.pad(f.vbar.to(dtype), (0, rv - f.vbar.shape[1])))
    # path (a) and path (b) requests share the launch: the flag is per request, as the bases are
    post = torch.tensor([f is not None and f.post_rope for f in samples], dtype=torch.bool, device=dev)
    pre = torch.tensor([f is not None and not f.post_rope for f in samples], dtype=torch.bool, device=dev)
    offset = torch.tensor(offsets, dtype=torch.long, device=dev)[:, None, None]
    return _Stacks(held, dtype, torch.cat(kbar), dk, torch.cat(vbar), dv, post, offset, pre[:, None, None])


def _stacks(samples: list, dtype: torch.dtype, dev, keep: tuple | None) -> _Stacks:
    """The stacks of ``samples``: the kept ones where ``keep`` (``(pool, layer)``) last built them from
    the same tensors, else built (and kept under ``keep``)."""
    held = _held(samples)
    if keep is None:
        return _build(samples, held, dtype, dev)
    pool, layer = keep
    per_pool = _KEPT.setdefault(pool, {})
    got = per_pool.get(layer)
    if got is None or not got.same(held, dtype) or got.kbar.device != torch.device(dev):
        got = per_pool[layer] = _build(samples, held, dtype, dev)
    return got


def stack_factors(samples: list, frow: Tensor, dtype: torch.dtype, keep: tuple | None = None) -> PagedFactors:
    """:class:`PagedFactors` of ``samples`` (one :class:`~vlkv.runtime.kv.lowrank.Factors` or None per
    request, at least one not None): rows stacked in request order, bases zero-padded to the largest
    rank, ``frow (B, H_kv, C)`` already naming rows of the stack; ``post_rope`` each request's path (b)
    flag (its factored keys read unrotated, in the rank space). ``keep``: ``(pool, layer)`` under which
    the stacks of the factor tensors (not the ranks, which every step's factor edit sets) are kept and
    reused while the same tensors come (:class:`_Stacks`); None: built each call."""
    if all(f is None for f in samples):
        raise ValueError("stack_factors: no sample holds factors (paged_lowrank_tables returns None then)")
    st = _stacks(samples, dtype, frow.device, keep)
    held = [f for f in samples if f is not None]
    return PagedFactors(
        frow,
        st.kbar,
        st.dk,
        st.vbar,
        st.dv,
        torch.cat([f.rank_k for f in held]).long(),
        torch.cat([f.rank_v for f in held]).long(),
        st.post,
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
    # paged_tables' table is the slot table with -1 at holes only: a factored column (a negative slot
    # inside the length, not a hole) holds the same slot there as in ``layer.table(n)``
    fac = (table < 0) & (torch.arange(n, device=dev) < lengths[..., None])
    open_ = layer.open_mask(n)
    if open_ is not None:
        fac = fac & open_
    stacks = _stacks(low.samples, layer.pool.spec.dtype, dev, (layer.pool, layer.layer))
    frow = torch.where(fac, -table.long() - 1 + stacks.offset, -1)
    factors = stack_factors(low.samples, frow, layer.pool.spec.dtype, keep=(layer.pool, layer.layer))
    if any(prerope):
        pre = fac & stacks.prerope
        if any(r.linked for r in getattr(layer, "rows", [layer])):
            pre = pre | linked_prerope(layer, table, lengths)
        # the Triton kernels' table form: rows by position, M-RoPE by section (no read back)
        rope = rope_by_position(layer, pre, sec_form=True)
    table = torch.where(fac, -1, table)
    return table, lengths, attended, rope, host, factors
