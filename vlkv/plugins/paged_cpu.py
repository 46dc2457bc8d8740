"""Paged attention on CPU: read each request's K/V where it lies when its slots form long runs.

The pool hands a request's entries out as ascending runs of slots (a prompt takes one run, decode
appends continue it), the same run in every KV head until a per-head edit. A run is a strided view
of the pool, so attention reads it in place: no gather, no scratch copy. Per request:

- *shared runs* (every head's row the same ascending runs, no holes, one length): each run of at least
  ``run_min`` slots is a view, read by one batched ``(H_kv, n, D) @ (H_kv, D, G·Q)`` for the scores and
  ``(H_kv, G·Q, n) @ (H_kv, n, D_v)`` for the output; the columns of shorter runs (decode appends that
  interleave with other requests' in a fixed pool) are gathered into one more segment;
- otherwise (holes, per-head tables, ragged head lengths, no long run): one gather of the request's
  ``(H_kv, n)`` slots (``index_select`` on the flattened pool into a reused buffer), the same matmuls, masked.

The score matmul is ``K @ q^T`` on purpose: on this CPU (MKL, 2 threads) ``q @ K^T`` over a strided
pool view was 6x slower (it copies the view), ``K @ q^T`` reads it as it lies (docs/benchmarks).
GQA is folded: the ``G`` query heads (and ``Q`` rows) of a KV head are the rows of one matmul.
Scores, softmax and the weighted sum are float32 whatever the pool's dtype.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from vlkv.plugins.paged_reference import check_paged, check_rope, rotate_keys

# a run of at least this many slots is read in place: each run costs two small matmul calls (~10 µs),
# a gathered entry ~0.1 µs
RUN_MIN = 128


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


def _causal_mask(n: int, num_q: int, group: int, lengths: Tensor, held: Tensor | None) -> Tensor | None:
    """``(H_kv, G·Q, n)`` bool of the columns each query row sees, or None when every row sees all
    ``n`` (one decode row, no holes, every head ``n`` long)."""
    if num_q == 1 and held is None:
        return None
    cols = torch.arange(n, device=lengths.device)
    limit = lengths[:, None] - num_q + 1 + torch.arange(num_q, device=lengths.device)  # (H_kv, Q)
    vis = cols < limit[..., None]  # (H_kv, Q, n)
    if held is not None:
        vis = vis & held[:, None, :]
    return vis.repeat(1, group, 1)


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


def _gather(pool: Tensor, flat: Tensor, n: int, out: Tensor | None = None) -> Tensor:
    """``(H_kv, n, D)`` rows ``flat`` (ids + head · S) of ``pool (H_kv, S, D)``, into ``out`` (a flat
    buffer) when given. ``index_select`` copies whole rows, ~5x faster on CPU than 2-D advanced indexing;
    a strided pool would be copied whole by a reshape, so it takes the indexing."""
    kv_heads, cap, dim = pool.shape
    if not pool.is_contiguous():
        return pool[flat.view(kv_heads, n) // cap, flat.view(kv_heads, n) % cap]
    if out is None:
        return pool.view(-1, dim).index_select(0, flat).view(kv_heads, n, dim)
    rows = out[: flat.numel() * dim].view(-1, dim)
    return torch.index_select(pool.view(-1, dim), 0, flat, out=rows).view(kv_heads, n, dim)


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
    m = rest.numel()
    segs.append((at, n, _gather(k_pool, flat, m), _gather(v_pool, flat, m)))
    return segs, torch.cat([*cols, rest])


def paged_attention_cpu(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    run_min: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> Tensor:
    """The CPU form of ``paged_reference.paged_attention_reference`` (same arguments and result).

    q: (B, H_q, Q, D). k_pool: (H_kv, S, D), v_pool: (H_kv, S, D_v). table: (B, H_kv, C) int64.
    lengths: (B, H_kv) int64. run_min: shortest run of slots read in place (shorter ones are gathered;
    None = ``RUN_MIN``); a row that is one run is read in place whatever its length.
    rot (B, H_kv, C) int64, cos/sin (R, D_r): pre-RoPE keys rotated on read (a request holding any is
    gathered, and its rotated keys computed into the copy), as in the reference.
    Returns (B, H_q, Q, D_v) in q's dtype.
    """
    group = check_paged(q, k_pool, v_pool, table, lengths)
    rope = check_rope(table, rot, cos, sin)
    run_min = RUN_MIN if run_min is None else run_min
    batch, heads, num_q, dim = q.shape
    kv_heads, cap, dim_v = k_pool.shape[0], k_pool.shape[1], v_pool.shape[-1]
    out = torch.zeros(batch, heads, num_q, dim_v, dtype=q.dtype, device=q.device)
    lengths = lengths.clamp(0, table.shape[-1])
    host = lengths.tolist()
    heads_off = torch.arange(kv_heads, device=q.device)[:, None] * cap
    for b in range(batch):
        n = max(host[b])
        if n == 0:
            continue
        qg = q[b].reshape(kv_heads, group * num_q, dim).float() * scale
        row = table[b, :, :n]
        spin = None
        if rope:
            held = (row >= 0) & (torch.arange(n, device=row.device) < lengths[b][:, None])
            spin = torch.where(held, rot[b, :, :n], -1)
            spin = spin if bool((spin >= 0).any()) else None
        runs = shared_runs(row) if min(host[b]) == n and spin is None else None
        long = [] if runs is None else runs if len(runs) == 1 else [r for r in runs if r[1] - r[0] >= run_min]
        if long:
            # long runs are pool views; the short ones' columns (decode appends interleaved with other
            # requests' in a fixed pool, a linked record's pieces) are gathered into one more segment
            segs = [(c0, c1, k_pool[:, s : s + c1 - c0], v_pool[:, s : s + c1 - c0]) for c0, c1, s in long]
            vis = _causal_mask(n, num_q, group, lengths[b], None)
            if len(long) < len(runs):
                segs, perm = _with_gathered_rest(segs, runs, row, k_pool, v_pool, n, run_min, heads_off)
                vis = None if vis is None else vis[:, :, perm]
        else:
            held = (row >= 0) & (torch.arange(n, device=row.device) < lengths[b][:, None])
            flat = (torch.where(held, row, 0) + heads_off).reshape(-1)
            buf = _scratch(flat.numel() * (dim + dim_v), k_pool.dtype, k_pool.device)
            k = _gather(k_pool, flat, n, buf)
            v = _gather(v_pool, flat, n, buf[flat.numel() * dim :])
            if spin is not None:
                k = rotate_keys(k, spin, cos, sin)
            segs = [(0, n, k, v)]
            vis = _causal_mask(n, num_q, group, lengths[b], None if bool(held.all()) else held)
        o = _attend(qg, segs, n, vis, dim_v)
        out[b] = o.view(heads, num_q, dim_v).to(q.dtype)
    return out
