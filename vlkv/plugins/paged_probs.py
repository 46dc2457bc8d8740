"""A paged decode step in two halves, for steps that also want their attention probabilities (statistics).

``paged_decode_probs`` gives one decode row's softmax per request and query head over its table row's
columns; ``paged_decode_out`` multiplies them by the values read through the same table. Both read a
request of at least ``inplace_min`` entries whose heads hold one ascending run of slots in place (a pool
view) and gather every other request into one padded copy (only K for the first half, only V for the
second), as ``paged_cpu`` does. Plain PyTorch: the same code runs on any device.

Arguments as ``paged_reference.paged_attention_reference`` (one query row: q (B, H_q, 1, D)); GQA:
G = H_q // H_kv query heads per KV head.

Where the fused CPU kernel reads the call (fp32 CPU pools, no pre-RoPE keys: ``paged_cpu``'s
conditions), :func:`fused_decode_probs` gives the output and the probabilities together from ONE read
of each (request, KV head)'s own slot row in place: nothing gathered, no second pass over K. On the
Triton path (CUDA, or ``VLKV_FORCE_TRITON=1``) :func:`triton_decode_probs` does the same with the
Triton kernel (``triton_paged_probs``), any float pool dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.plugins import paged_cpu, paged_cpu_kernel
from vlkv.plugins.paged_cpu import INPLACE_MIN, _gather, shared_runs
from vlkv.plugins.paged_reference import check_paged_args, held_columns, rotate_keys

# statistics decode steps on the Triton path read K/V once in place (:func:`triton_decode_probs`); off
# (``VLKV_TRITON_PROBS=0``): the two halves' gathers, as before (a GPU profile's before / after)
TRITON_PROBS = os.environ.get("VLKV_TRITON_PROBS", "1") != "0"


@dataclass(frozen=True)
class DecodeRoute:
    """How both halves read one table, decided once (:func:`decode_route`) and handed to each.

    lengths: ``(B, H_kv)`` clamped to the table's columns. held: ``(B, H_kv, C)`` bool, inside the length
    and not a hole. full: every column of every row is held (no mask). empty: some row holds nothing.
    inplace: ``{request: (first slot, n)}`` read in place (one shared run of ``n >= inplace_min``
    entries). together: the requests gathered together (empty requests are in neither).
    """

    lengths: Tensor
    held: Tensor
    full: bool
    empty: bool
    inplace: dict[int, tuple[int, int]]
    together: list[int]


def decode_route(
    table: Tensor,
    lengths: Tensor,
    inplace_min: int | None = None,
    host: list[list[int]] | None = None,
    holes: bool = True,
) -> DecodeRoute:
    """The :class:`DecodeRoute` of ``table (B, H_kv, C)`` and ``lengths (B, H_kv)``.

    Without ``host`` (a standalone call) everything is read from the device: the lengths, whether every
    row is full or one holds nothing, and per request of at least ``inplace_min`` entries whether its
    heads hold one shared run of slots (read in place).

    With ``host`` (``lengths`` as Python ints, kept by the caller's cache; a decode step's route, built
    per layer) nothing is read back, so a step's host syncs do not grow with its layers: every request
    holding an entry is gathered together (the in-place check costs a few reads per request and layer,
    ~9 per layer at 8k x 4 on a GPU, and a request whose heads share one run is an uncompressed one, the
    plain read's case, not a statistics step's); holes: False when the caller knows no column inside a
    row's length is ``-1``, then "every row full" and "a row holds nothing" are decided from the lengths;
    with holes possible the route keeps the mask and zeroes empty rows (both exact where not needed)."""
    cols = table.shape[2]
    clamped = lengths.clamp(0, cols)
    held = held_columns(table, clamped)
    if host is not None:
        host = [[min(max(n, 0), cols) for n in row] for row in host]
        full = not holes and all(n == cols for row in host for n in row)
        empty = holes or any(n == 0 for row in host for n in row)
        together = [b for b, lens in enumerate(host) if max(lens, default=0) > 0]
        return DecodeRoute(clamped, held, full, empty, {}, together)
    host = clamped.tolist()
    full, empty = bool(held.all()), bool((~held.any(-1)).any())
    floor = INPLACE_MIN if inplace_min is None else inplace_min
    inplace, together = {}, []
    for b, lens in enumerate(host):
        n = max(lens)
        if n == 0:
            continue
        if n >= floor and min(lens) == n:
            runs = shared_runs(table[b, :, :n])
            if runs is not None and len(runs) == 1:
                inplace[b] = (runs[0][2], n)
                continue
        together.append(b)
    return DecodeRoute(clamped, held, full, empty, inplace, together)


def _gathered(pool: Tensor, table: Tensor, held: Tensor, idx: Tensor | None) -> Tensor:
    """``(R, H_kv, C, D)`` rows of ``pool`` for requests ``idx`` (None: every request; slot 0 where not
    held)."""
    kv_heads, cap, dim = pool.shape
    if idx is not None:
        table, held = table[idx], held[idx]
    heads_off = torch.arange(kv_heads, device=table.device)[None, :, None] * cap
    flat = (torch.where(held, table, 0) + heads_off).reshape(-1)
    return _gather(pool, flat).view(table.shape[0], kv_heads, table.shape[2], dim)


def _rows(together: list[int], batch: int, device) -> Tensor | None:
    """The requests ``together`` as an index tensor, or None when they are the whole batch in order
    (then no index is built: a tensor from a list is a host-to-device copy per layer on a GPU)."""
    return None if _every(together, batch) else torch.tensor(together, device=device)


def _every(together: list[int], batch: int) -> bool:
    """``together`` is every request of the batch, in order."""
    return together == list(range(batch))


def paged_decode_probs(
    q: Tensor,
    k_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    inplace_min: int | None = None,
    route: DecodeRoute | None = None,
    sec: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One decode row per request (same arguments as ``paged_reference.paged_attention_reference``, no
    v_pool): ``probs (B, H_kv, G, C)`` float32, the softmax of ``q·k · scale`` over the held columns of its
    row (0 elsewhere; a row holding nothing is all 0), and ``vis (B, H_kv, 1, C)`` bool of the held
    columns, or None when every column of every row is held. route: :func:`decode_route` of this
    ``table`` and ``lengths`` (built here when None; pass the same one to :func:`paged_decode_out`). sec:
    the rotary table form (``ops.paged_attention``), turned into rows here."""
    if sec is not None:
        from vlkv.plugins.paged_reference import rows_of_table

        rot, cos, sin = rows_of_table(rot, cos, sin, sec)
    group, rope = check_paged_args(q, k_pool, None, table, lengths, rot, cos, sin)
    batch, _, num_q, dim = q.shape
    if num_q != 1:
        raise ValueError(f"paged_decode_probs takes one query row per request, got {num_q}")
    if route is None:
        route = decode_route(table, lengths, inplace_min)
    kv_heads, cols = k_pool.shape[0], table.shape[2]
    held = route.held  # (B, H_kv, C)
    vis = None if route.full else held[:, :, None, :]
    qg = q.reshape(batch, kv_heads, group, dim).float()
    together = list(route.together)
    every = not route.inplace and _every(together, batch)
    # every request gathered (a decode step's route): the scores are the one matmul's, no -inf canvas
    scores = None if every else torch.full((batch, kv_heads, group, cols), float("-inf"), device=q.device)
    for b, (start, n) in route.inplace.items():
        if rot is not None and bool((rot[b, :, :n] >= 0).any()):
            together.append(b)  # its pre-RoPE keys are rotated into the gathered copy
            continue
        k = k_pool[:, start : start + n]
        k = k if k.dtype == torch.float32 else k.float()
        scores[b, :, :, :n] = torch.matmul(k, qg[b].transpose(-1, -2)).transpose(-1, -2)  # K @ q^T: in place
    if together:
        idx = _rows(sorted(together), batch, q.device)
        k = _gathered(k_pool, table, held, idx)
        if rope:
            pre = torch.where(held, rot, -1)
            k = rotate_keys(k, pre if idx is None else pre[idx], cos, sin)
        if scores is None:
            scores = torch.matmul(qg, k.float().transpose(-1, -2))
        else:
            scores[idx] = torch.matmul(qg[idx], k.float().transpose(-1, -2))
    scores.mul_(scale)
    if vis is not None:
        scores.masked_fill_(~vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if route.empty:  # softmax of an all -inf row is NaN; the row is defined as 0
        probs.masked_fill_(~held.any(-1)[..., None, None], 0.0)
    return probs, vis


def paged_decode_out(
    probs: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    inplace_min: int | None = None,
    route: DecodeRoute | None = None,
) -> Tensor:
    """``probs (B, H_kv, G, C)`` times the values read through the table → ``(B, H_kv, G, D_v)`` in the
    pool's dtype (the probabilities go to that dtype first, as a fused attention kernel feeds P·V).
    route: the :func:`decode_route` ``paged_decode_probs`` read (built here when None)."""
    batch, kv_heads, group, cols = probs.shape
    if route is None:
        route = decode_route(table, lengths, inplace_min)
    p = probs.to(v_pool.dtype)
    if not route.inplace and _every(route.together, batch):
        return torch.matmul(p, _gathered(v_pool, table, route.held, None))  # every request gathered
    out = torch.zeros(batch, kv_heads, group, v_pool.shape[-1], dtype=v_pool.dtype, device=probs.device)
    for b, (start, n) in route.inplace.items():
        out[b] = torch.matmul(p[b, :, :, :n], v_pool[:, start : start + n])
    if route.together:
        idx = _rows(route.together, batch, probs.device)
        out[idx] = torch.matmul(p[idx], _gathered(v_pool, table, route.held, idx))
    return out


def fused_decode_probs(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    host: list[list[int]] | None = None,
    holes: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """A statistics decode step by the fused CPU kernel: ``out (B, H_q, 1, D_v)`` in q's dtype and
    ``probs (B, H_kv, G, C)`` / ``vis`` as :func:`paged_decode_probs` gives them, from one read of K and
    V through each (request, KV head)'s table row (holes skipped, each head its own length). None where
    the kernel does not read this call (off, not built, not fp32 CPU pools, more than one query row,
    D or G beyond what it was built for): the caller keeps the two halves. No pre-RoPE keys: a caller
    with ``rot`` keeps the halves. host, holes: the lengths as Python ints and whether a row may hold a
    hole (then "every column held" is decided without a read back), as :func:`decode_route` takes them."""
    batch, heads, num_q, dim = q.shape
    kv_heads, cols = k_pool.shape[0], table.shape[2]
    if heads % kv_heads or not paged_cpu._fused_fits(q, k_pool, v_pool, num_q, heads // kv_heads):
        return None
    check_paged_args(q, k_pool, v_pool, table, lengths, None, None, None)
    clamped = lengths.clamp(0, cols)
    held = held_columns(table, clamped)
    full = _known_full(host, holes, cols)
    if full is None:
        full = bool(held.all())
    qs = q.reshape(batch, kv_heads, heads // kv_heads, dim).float() * scale
    out, probs = paged_cpu_kernel.table_attention_probs(qs, k_pool, v_pool, table, clamped)
    vis = None if full else held[:, :, None, :]
    return out.view(batch, heads, 1, v_pool.shape[-1]).to(q.dtype), probs, vis


def _known_full(host: list[list[int]] | None, holes: bool, cols: int) -> bool | None:
    """Whether every column of every row is held, decided from the host lengths where they can tell (a
    row shorter than the table is not full; with no hole possible, rows as long as the table are): None
    when only a read of the table can (no host lengths, or every row full and a hole possible)."""
    if host is None:
        return None
    if not all(n >= cols for row in host for n in row):
        return False
    return None if holes else True


def triton_decode_probs(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    host: list[list[int]] | None = None,
    holes: bool = True,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    sec: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """A statistics decode step by the Triton kernel (``triton_paged_probs``): ``out (B, H_q, 1, D_v)`` in
    q's dtype and ``probs (B, H_kv, G, C)`` / ``vis`` as :func:`paged_decode_probs` gives them, from one
    read of K and V in place through the table (no gather, no fp32 copy). None where it does not apply
    (off: ``TRITON_PROBS``; not CUDA tensors and not forced Triton, as ``ops.paged_attention`` chooses;
    more than one query row; pools of another dtype than q): the caller keeps the two halves. rot, cos,
    sin: pre-RoPE keys rotated as they load (``paged_attention_reference``'s form; since session 16, where
    the halves were kept before), or with ``sec`` the rotary table form. host, holes: as :func:`decode_route` takes
    them (nothing read back: with a hole possible the mask is kept, all True where every column is held)."""
    from vlkv.plugins.ops import use_triton

    if not TRITON_PROBS or q.shape[2] != 1 or not q.dtype == k_pool.dtype == v_pool.dtype:
        return None
    if not use_triton(q, k_pool, v_pool):
        return None
    from vlkv.plugins.triton_paged_probs import paged_probs_triton

    full = _known_full(host, holes, table.shape[2])
    if full is None and host is not None:  # a hole possible: keep the mask (exact either way) rather
        full = False  # than read it back, a host sync per layer on a GPU (as decode_route decides)
    out, probs, vis = paged_probs_triton(
        q,
        k_pool,
        v_pool,
        table,
        lengths,
        scale,
        with_vis=full is not True,
        rot=rot,
        cos=cos,
        sin=sin,
        sec=sec,
    )
    if full is None:
        full = bool(vis.all())
    return out, probs, None if full else vis
