"""Paged attention on CPU: read a long request's K/V where it lies; gather the rest together, once.

The pool hands a request's entries out as ascending runs of slots (a prompt takes one run, decode
appends continue it), the same run in every KV head until a per-head edit. A run is a strided view
of the pool, so attention can read it in place: no gather, no scratch copy. Per step and layer:

- a request of at least ``inplace_min`` entries whose heads hold the same ascending runs (no holes, no
  pre-RoPE keys): each run of at least ``run_min`` slots is a view, read by one batched
  ``(H_kv, n, D) @ (H_kv, D, G·Q)`` for the scores and ``(H_kv, G·Q, n) @ (H_kv, n, D_v)`` for the
  output; the columns of shorter runs (decode appends interleaved with other requests' in a fixed pool)
  are gathered into one more segment;
- every other request (short, holes, per-head tables, ragged head lengths, pre-RoPE keys): all of them
  gathered into one padded scratch copy (``index_select`` on the flattened pool into a reused buffer)
  and attended by one masked SDPA call, GQA folded — a few calls however many requests.

The score matmul is ``K @ q^T`` on purpose: on this CPU (MKL, 2 threads) ``q @ K^T`` over a strided
pool view was 6x slower (it copies the view), ``K @ q^T`` reads it as it lies (docs/benchmarks).
GQA is folded: the ``G`` query heads (and ``Q`` rows) of a KV head are the rows of one matmul.
Scores, softmax and the weighted sum are float32 whatever the pool's dtype.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.plugins.paged_reference import check_paged_args, rotate_keys

# a run of at least this many slots is read in place: each run costs two small matmul calls (~10 µs),
# a gathered entry ~0.1 µs
RUN_MIN = 128
# a request is read in place (one request at a time) from this many entries; shorter requests are
# gathered and attended together: per request and layer the in-place path costs ~20 calls, ~0.2 ms at
# one thread, the gather ~0.15 µs per entry (scripts/bench_paged.py: 32 × 300 entries and 4 × 8206)
INPLACE_MIN = 1024


def shared_runs(row: Tensor) -> list[tuple[int, int, int]] | None:
    """``[(first column, end column, first slot), …]`` when every head's ``row (H_kv, n)`` holds the
    same slots, as ascending runs; None otherwise (the caller gathers)."""
    first = row[0]
    if row.shape[0] > 1 and not bool((row == first).all()):
        return None
    if bool((first < 0).any()):
        return None
    breaks = (first[1:] - first[:-1] != 1).nonzero().flatten().add_(1).tolist()
    bounds = [0, *breaks, first.numel()]
    starts = first[bounds[:-1]].tolist() if len(bounds) > 2 else [int(first[0])]
    return [(c0, c1, s) for c0, c1, s in zip(bounds[:-1], bounds[1:], starts, strict=True)]


def _causal_mask(n: int, num_q: int, group: int, lengths: Tensor) -> Tensor | None:
    """``(H_kv, G·Q, n)`` bool of the columns each query row sees (every head ``n`` long, no holes),
    or None for one decode row (it sees all ``n``)."""
    if num_q == 1:
        return None
    cols = torch.arange(n, device=lengths.device)
    limit = lengths[:, None] - num_q + 1 + torch.arange(num_q, device=lengths.device)  # (H_kv, Q)
    return (cols < limit[..., None]).repeat(1, group, 1)  # (H_kv, G·Q, n)


def _attend(
    qg: Tensor, segments: list[tuple[int, int, Tensor, Tensor]], n: int, vis: Tensor | None, dim_v: int
) -> Tensor:
    """Softmax attention of ``qg (H_kv, G·Q, D)`` (float32, pre-scaled) over K/V given as column
    segments ``(c0, c1, k (H_kv, c1-c0, D), v (H_kv, c1-c0, D_v))``; returns ``(H_kv, G·Q, D_v)`` float32."""
    kv_heads, rows, _ = qg.shape
    qt = qg.transpose(1, 2)  # (H_kv, D, G·Q)
    scores = torch.empty(kv_heads, n, rows, device=qg.device)
    for c0, c1, k, _ in segments:
        k = k if k.dtype == torch.float32 else k.float()
        torch.matmul(k, qt, out=scores[:, c0:c1])
    scores = scores.transpose(1, 2).contiguous()  # (H_kv, G·Q, n): softmax along contiguous memory
    if vis is not None:
        scores.masked_fill_(~vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if vis is not None:
        probs.masked_fill_(~vis.any(-1, keepdim=True), 0.0)  # a row that sees nothing: zeros
    out = torch.zeros(kv_heads, rows, dim_v, device=qg.device)
    for c0, c1, _, v in segments:
        v = v if v.dtype == torch.float32 else v.float()
        out.baddbmm_(probs[:, :, c0:c1], v)
    return out


_LOCAL = threading.local()


def _scratch(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat buffer of at least ``n`` elements, reused by this thread's gathers: a fresh multi-MB tensor
    per request and layer costs more in page faults than the copy (the pool's scratch read says so too)."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
        buf = _LOCAL.buf = torch.empty(n, dtype=dtype, device=device)
    return buf


def _gather(pool: Tensor, flat: Tensor, out: Tensor | None = None) -> Tensor:
    """``(N, D)`` rows ``flat (N,)`` (slot + head · S) of ``pool (H_kv, S, D)``, into ``out`` (a flat
    buffer) when given. ``index_select`` copies whole rows, ~5x faster on CPU than 2-D advanced indexing;
    a strided pool would be copied whole by a reshape, so it takes the indexing."""
    cap, dim = pool.shape[1], pool.shape[2]
    if not pool.is_contiguous():
        return pool[flat // cap, flat % cap]
    if out is None:
        return pool.view(-1, dim).index_select(0, flat)
    return torch.index_select(pool.view(-1, dim), 0, flat, out=out[: flat.numel() * dim].view(-1, dim))


def _with_gathered_rest(
    views: list[tuple[int, int, Tensor, Tensor]],
    runs: list[tuple[int, int, int]],
    row: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    n: int,
    run_min: int,
    heads_off: Tensor,
) -> tuple[list[tuple[int, int, Tensor, Tensor]], Tensor]:
    """Segments laid out as the long runs' views, then one gathered segment of every short run's columns;
    returns them (column ranges in that order) and ``perm (n,)``: the table column at each position
    (softmax ignores column order; causal masks are permuted alike)."""
    cols, segs, at = [], [], 0
    for c0, c1, k, v in views:
        segs.append((at, at + c1 - c0, k, v))
        cols.append(torch.arange(c0, c1, device=row.device))
        at += c1 - c0
    rest = torch.cat([torch.arange(c0, c1, device=row.device) for c0, c1, _ in runs if c1 - c0 < run_min])
    flat = (row[:, rest] + heads_off).reshape(-1)
    h, m = row.shape[0], rest.numel()
    segs.append((at, n, _gather(k_pool, flat).view(h, m, -1), _gather(v_pool, flat).view(h, m, -1)))
    return segs, torch.cat([*cols, rest])


def paged_attention_cpu(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    run_min: int | None = None,
    inplace_min: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> Tensor:
    """The CPU form of ``paged_reference.paged_attention_reference``: same arguments and result, plus

    inplace_min: a request's rows of at least this many entries, the same runs
    in every head, are read in place one request at a time (None = ``INPLACE_MIN``); every other request
    is attended together with the rest in one gather. run_min: inside such a request, the shortest run
    of slots read in place (shorter ones gathered; None = ``RUN_MIN``); a request that is one run is read
    in place whatever its length. A request holding any pre-RoPE key (``rot`` row >= 0) is gathered, its
    rotated keys computed into the copy.
    """
    group, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    run_min = RUN_MIN if run_min is None else run_min
    inplace_min = INPLACE_MIN if inplace_min is None else inplace_min
    batch, heads, num_q, dim = q.shape
    kv_heads, cap, dim_v = k_pool.shape[0], k_pool.shape[1], v_pool.shape[-1]
    out = torch.zeros(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    lengths = lengths.clamp(0, table.shape[-1])
    host = lengths.tolist()
    heads_off = torch.arange(kv_heads, device=q.device)[:, None] * cap
    together = []  # requests attended through one gather
    for b in range(batch):
        n = max(host[b])
        if n == 0:
            continue
        if n < inplace_min or min(host[b]) != n or (rope and bool((rot[b, :, :n] >= 0).any())):
            together.append(b)  # decided from host values: a short request costs no tensor op here
            continue
        row = table[b, :, :n]
        runs = shared_runs(row)
        long = [] if runs is None else runs if len(runs) == 1 else [r for r in runs if r[1] - r[0] >= run_min]
        if not long:
            together.append(b)
            continue
        # long runs are pool views; the short ones' columns (decode appends interleaved with other
        # requests' in a fixed pool, a linked record's pieces) are gathered into one more segment
        segs = [(c0, c1, k_pool[:, s : s + c1 - c0], v_pool[:, s : s + c1 - c0]) for c0, c1, s in long]
        vis = _causal_mask(n, num_q, group, lengths[b])
        if len(long) < len(runs):
            segs, perm = _with_gathered_rest(segs, runs, row, k_pool, v_pool, n, run_min, heads_off)
            vis = None if vis is None else vis[:, :, perm]
        qg = q[b].reshape(kv_heads, group * num_q, dim).float() * scale
        out[b] = _attend(qg, segs, n, vis, dim_v).view(heads, num_q, dim_v).to(q.dtype)
    if len(together) == batch:  # every request (the common case of short ones): no subset copies
        n = max(max(h) for h in host)
        full = all(min(h) == n for h in host)
        return _attend_gathered(
            q, k_pool, v_pool, table[:, :, :n], lengths, scale, heads_off, rot, cos, sin, full
        )
    if together:
        n = max(max(host[b]) for b in together)
        full = all(min(host[b]) == n for b in together)
        idx = torch.tensor(together, device=q.device)
        sub_rot = rot[idx] if rope else None
        out[idx] = _attend_gathered(
            q[idx], k_pool, v_pool, table[idx, :, :n], lengths[idx], scale, heads_off, sub_rot, cos, sin, full
        )
    return out


def _attend_gathered(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    heads_off: Tensor,
    rot: Tensor | None,
    cos: Tensor | None,
    sin: Tensor | None,
    full: bool,
) -> Tensor:
    """Requests' K/V gathered into one padded ``(R, H_kv, n, D)`` scratch copy and attended in one pass
    (few calls for any number of requests: many short requests cost no per-request overhead).

    q: (R, H_q, Q, D). table: (R, H_kv, n). lengths: (R, H_kv). heads_off: (H_kv, 1) head · S.
    rot: None or (R, H_kv, ≥n) with cos, sin. full: every row holds ``n`` columns (no padding).
    Returns (R, H_q, Q, D_v) in q's dtype.
    """
    reqs, heads, num_q, dim = q.shape
    kv_heads, n, dim_v = table.shape[1], table.shape[2], v_pool.shape[-1]
    group = heads // kv_heads
    cols = torch.arange(n, device=q.device)
    # rows that are all held (no padding, no hole) need neither a mask nor a guarded gather
    held = None if full and not bool((table < 0).any()) else (table >= 0) & (cols < lengths[..., None])
    flat = ((table if held is None else torch.where(held, table, 0)) + heads_off[None]).reshape(-1)
    buf = _scratch(flat.numel() * (dim + dim_v), k_pool.dtype, k_pool.device)
    k = _gather(k_pool, flat, buf).view(reqs, kv_heads, n, dim)
    v = _gather(v_pool, flat, buf[flat.numel() * dim :]).view(reqs, kv_heads, n, dim_v)
    if rot is not None:
        spin = rot[:, :, :n] if held is None else torch.where(held, rot[:, :, :n], -1)
        if bool((spin >= 0).any()):
            k = rotate_keys(k, spin, cos, sin)
    k = k if k.dtype == torch.float32 else k.float()
    v = v if v.dtype == torch.float32 else v.float()
    # GQA folded: the G query heads (and Q rows) of a KV head are the rows of one SDPA call, which reads
    # each K/V head once under a (R, H_kv, G·Q or 1, n) mask
    qg = q.reshape(reqs, kv_heads, group * num_q, dim).float()
    if num_q == 1 and held is None:
        vis = None  # one decode row over full rows: SDPA's unmasked path
    elif num_q == 1:
        vis = held[:, :, None, :]  # one decode row sees every held column
    else:
        limit = lengths[..., None] - num_q + 1 + torch.arange(num_q, device=q.device)  # (R, H_kv, Q)
        vis = cols < limit[..., None]
        vis = (vis if held is None else held[:, :, None, :] & vis).repeat(1, 1, group, 1)  # (R, H_kv, G·Q, n)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=vis, scale=scale)
    if vis is not None:  # a row that sees nothing is NaN from SDPA: the op defines it as zeros
        out = out.masked_fill_(~vis.any(-1, keepdim=True), 0.0)
    return out.reshape(reqs, heads, num_q, dim_v).to(q.dtype)  # SDPA may return a strided layout (CUDA)
