"""Paged attention on CPU: read a long request's K/V where it lies; gather the rest together, once.

The pool hands a request's entries out as ascending runs of slots (a prompt takes one run, decode
appends continue it), the same run in every KV head until a per-head edit. A run is a strided view
of the pool, so attention can read it in place: no gather, no scratch copy. Per step and layer:

- requests of at least ``inplace_min`` entries whose heads hold the same ascending runs (no holes, no
  pre-RoPE keys): each run of at least ``run_min`` slots is a view, read by one
  ``(H_kv, n, D) @ (H_kv, D, G·Q)`` for its scores and ``(H_kv, G·Q, n) @ (H_kv, n, D_v)`` for its share
  of the output; the columns of shorter runs (decode appends interleaved with other requests') of every
  such request are gathered by one call per K and V; all of them share one scores buffer, one softmax
  and one output buffer, so a request costs its matmuls and little else;
- every other request (short, holes, per-head tables, ragged head lengths, pre-RoPE keys): all of them
  gathered into one padded scratch copy (``index_select`` on the flattened pool into a reused buffer)
  and attended by one masked SDPA call, GQA folded — a few calls however many requests.

Which request goes where, its runs, the gathered rows and the masks are a :class:`PagedCpuPlan`
(``paged_cpu_plan``), decided from the tables alone: a decode step builds it once and every layer
holding the same tables reuses it (``plan=``).

The score matmul is ``K @ q^T`` by default (``SCORES_QK`` picks ``q @ K^T``): inside this op at 2k and
8k columns it was 1.15-1.3x faster on the 2-core EPYC (MKL), though an isolated ``bmm`` loop favoured
the other form (docs/benchmarks/2026-11-26-decode-bound-cpu-x86_64). GQA is folded: the ``G`` query
heads (and ``Q`` rows) of a KV head are the rows of one matmul. Scores, softmax and the weighted sum
are float32 whatever the pool's dtype. ``FUSED_KERNEL`` (default on; ``VLKV_CPU_KERNEL=0`` turns it off) reads
fp32 decode rows with the C++ kernel of ``paged_cpu_kernel`` instead (2.45x at 8k × 4, 1 thread): in-place
requests by their runs, every other request (per-head tables, holes, short requests) through its own
table rows, each KV head's live slots read where they lie — nothing gathered.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.plugins import decode_layer, layer_glue, paged_cpu_heap, paged_cpu_kernel, skinny_gemm
from vlkv.plugins.paged_cpu_plan import GatheredRead, InplaceGroup, PagedCpuPlan, plan_paged_cpu, shared_runs
from vlkv.plugins.paged_reference import check_paged_args, rotate_keys

__all__ = [
    "INPLACE_MIN",
    "RUN_MIN",
    "PagedCpuPlan",
    "paged_attention_cpu",
    "plan_for",
    "plan_paged_cpu",
    "plan_reused",
    "shared_runs",
]

# a run of at least this many slots is read in place: each run costs two small matmul calls (~10 µs),
# a gathered entry ~0.1 µs
RUN_MIN = 128
# a request is read in place (one request at a time) from this many entries; shorter requests are
# gathered and attended together: per request and layer the in-place path costs ~20 calls, ~0.2 ms at
# one thread, the gather ~0.15 µs per entry (scripts/bench_paged.py: 32 × 300 entries and 4 × 8206)
INPLACE_MIN = 1024
# the score matmul's form: ``K @ q^T`` (False, the default: faster inside this op, see the docstring)
# or ``q @ K^T`` (True); both read the pool view in place
SCORES_QK = False
# one decode row per request over fp32 pools: the fused C++ kernel (``paged_cpu_kernel``; 2.45x the bmm
# read at 8k × 4, 1 thread; per-head tables read through their own rows, nothing gathered) instead of
# the matmuls. On by default (``VLKV_CPU_KERNEL=0`` turns it off): a CPU fp32 backend builds it at
# engine start (:func:`warm_up`; 0.5–2 min once per CPU kind, then loaded from torch's extension
# cache); where it cannot be built, one warning and the matmuls run
FUSED_KERNEL = os.environ.get("VLKV_CPU_KERNEL", "1") != "0"


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


def plan_for(
    q: Tensor,
    k_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    run_min: int | None = None,
    inplace_min: int | None = None,
    rot: Tensor | None = None,
    host: list[list[int]] | None = None,
    holes: bool = True,
) -> PagedCpuPlan:
    """The :class:`PagedCpuPlan` of a ``paged_attention_cpu`` call with these arguments (module defaults
    for ``run_min`` / ``inplace_min`` when None); a caller reading several layers through one table
    builds it once and passes it as ``plan=``. host, holes: as ``plan_paged_cpu`` takes them."""
    kv_heads = k_pool.shape[0]
    return plan_paged_cpu(
        table,
        lengths.clamp(0, table.shape[-1]),
        k_pool.shape[1],
        q.shape[2],
        q.shape[1] // kv_heads,
        RUN_MIN if run_min is None else run_min,
        INPLACE_MIN if inplace_min is None else inplace_min,
        rot,
        host,
        holes,
        fused=_fused_fits(q, k_pool, k_pool, q.shape[2], q.shape[1] // kv_heads),
    )


def plan_reused(
    last: PagedCpuPlan | None,
    q: Tensor,
    k_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    host: list[list[int]] | None = None,
    holes: bool = True,
) -> PagedCpuPlan:
    """``last`` when it was planned for the same tables (compared by value; the layers of a decode step
    usually share them), else :func:`plan_for` of this call (module defaults, no ``rot``; host, holes
    as ``plan_paged_cpu`` takes them)."""
    group = q.shape[1] // k_pool.shape[0]
    fused = _fused_fits(q, k_pool, k_pool, q.shape[2], group)
    if last is not None and last.matches(
        table, lengths.clamp(0, table.shape[-1]), k_pool.shape[1], q.shape[2], group, fused
    ):
        return last
    return plan_for(q, k_pool, table, lengths, host=host, holes=holes)


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
    plan: PagedCpuPlan | None = None,
) -> Tensor:
    """The CPU form of ``paged_reference.paged_attention_reference``: same arguments and result, plus

    inplace_min: a request's rows of at least this many entries, the same runs
    in every head, are read in place one request at a time (None = ``INPLACE_MIN``); every other request
    is attended together with the rest in one gather. run_min: inside such a request, the shortest run
    of slots read in place (shorter ones gathered; None = ``RUN_MIN``); a request that is one run is read
    in place whatever its length. A request holding any pre-RoPE key (``rot`` row >= 0) is gathered, its
    rotated keys computed into the copy. plan: :func:`plan_for` of this call's arguments (built here when
    None); it must match ``table`` and ``lengths`` (checked by shape; by value where the caller reuses
    one, see ``PagedCpuPlan.matches``) and is only for calls without ``rot``.
    """
    group, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    if plan is None:
        plan = plan_for(q, k_pool, table, lengths, run_min, inplace_min, rot)
    elif rope or plan.table.shape != table.shape or plan.cap != k_pool.shape[1] or plan.num_q != q.shape[2]:
        raise ValueError("plan was built for other tables (a plan reads calls without rot, same shapes)")
    batch, heads, num_q, _ = q.shape
    if plan.rows is not None and not _fused_fits(q, k_pool, v_pool, num_q, heads // k_pool.shape[0]):
        # planned for the kernel but this call's pools are not its (another V layout): a fresh plan
        plan = plan_paged_cpu(
            plan.table, plan.lengths, plan.cap, num_q, plan.group,
            RUN_MIN if run_min is None else run_min, INPLACE_MIN if inplace_min is None else inplace_min,
        )  # fmt: skip
    gathered = plan.gathered
    if gathered is not None and gathered.index is None:  # every request gathered: no subset copies
        return _attend_gathered(q, k_pool, v_pool, gathered, scale, rot, cos, sin)
    if plan.rows is not None and plan.inplace is None:  # every request read by its own table rows
        return _attend_rows(q, k_pool, v_pool, table, lengths, scale, None)
    if plan.inplace is not None:
        got = _attend_inplace(q, k_pool, v_pool, plan.inplace, scale)
        if gathered is None and plan.rows is None and plan.inplace.index is None:
            return got  # every request in place (long decode rows): no output copy
    out = torch.zeros(batch, heads, num_q, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    if plan.rows is not None:
        out[plan.rows] = _attend_rows(q, k_pool, v_pool, table, lengths, scale, plan.rows)
    if plan.inplace is not None:
        out[plan.inplace.index if plan.inplace.index is not None else slice(None)] = got
    if gathered is not None:
        idx = gathered.index
        sub_rot = rot[idx] if rope else None
        out[idx] = _attend_gathered(q[idx], k_pool, v_pool, gathered, scale, sub_rot, cos, sin)
    return out


def _attend_inplace(q: Tensor, k_pool: Tensor, v_pool: Tensor, grp: InplaceGroup, scale: float) -> Tensor:
    """The in-place requests' attention: ``q (B, H_q, Q, D)`` (their rows picked by ``grp.index``) over
    pool views (and one gathered segment of every request's short runs) → ``(R, H_q, Q, D_v)`` in q's
    dtype. Scores ``K @ q^T`` per view into one buffer; one softmax; ``P @ V`` per view into one output."""
    kv_heads, dim_v = k_pool.shape[0], v_pool.shape[-1]
    qr = q if grp.index is None else q[grp.index]
    reqs, heads, num_q, dim = qr.shape
    rows = heads // kv_heads * num_q
    qs = qr.reshape(reqs, kv_heads, rows, dim).float() * scale  # (R, H_kv, G·Q, D)
    wide = k_pool.dtype == torch.float32
    if _fused_fits(qs, k_pool, v_pool, num_q):
        return _attend_fused(qs, k_pool, v_pool, grp).view(reqs, heads, num_q, dim_v).to(q.dtype)
    kr = vr = None
    if grp.rest is not None:  # decode appends interleaved with other requests': one gather for all
        kr, vr = _gather(k_pool, grp.rest), _gather(v_pool, grp.rest)
        kr, vr = (kr, vr) if wide else (kr.float(), vr.float())
    tail = grp.tail
    segs = []  # (request, at, end, k (H_kv, end - at, D))
    for i, read in enumerate(grp.reads):
        for at, end, s in read.views:
            k = k_pool[:, s : s + end - at]
            segs.append((i, at, end, k if wide else k.float()))
        if read.rest is not None and not tail:
            m, r0 = read.rest.numel() // kv_heads, grp.rest_at[i]
            segs.append((i, read.n - m, read.n, kr[r0 : r0 + kv_heads * m].view(kv_heads, m, dim)))
    width = grp.width
    if SCORES_QK:
        # q @ K^T: the view's transpose is a column-major operand BLAS reads in place
        scores = torch.empty(reqs, kv_heads, rows, width, device=q.device)
        for i, at, end, k in segs:
            torch.bmm(qs[i], k.transpose(1, 2), out=scores[i, :, :, at:end])
        if tail:  # every request's decode appends: one block, one matmul
            scores[..., width - tail :] = torch.matmul(
                qs, kr.view(reqs, kv_heads, tail, dim).transpose(-1, -2)
            )
    else:
        qt = qs.transpose(-1, -2)  # (R, H_kv, D, G·Q)
        scores = torch.empty(reqs, kv_heads, width, rows, device=q.device)
        for i, at, end, k in segs:
            torch.bmm(k, qt[i], out=scores[i, :, at:end])
        if tail:
            scores[:, :, width - tail :] = torch.matmul(kr.view(reqs, kv_heads, tail, dim), qt)
        scores = scores.transpose(-1, -2).contiguous()  # (R, H_kv, G·Q, width): softmax along memory
    if grp.vis is not None:
        scores.masked_fill_(~grp.vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if grp.empty is not None:
        probs.masked_fill_(grp.empty, 0.0)  # a row that sees nothing: zeros
    out = torch.zeros(reqs, kv_heads, rows, dim_v, device=q.device)
    for i, read in enumerate(grp.reads):
        for at, end, s in read.views:
            v = v_pool[:, s : s + end - at]
            out[i].baddbmm_(probs[i, :, :, at:end], v if wide else v.float())
        if read.rest is not None and not tail:
            m, r0 = read.rest.numel() // kv_heads, grp.rest_at[i]
            out[i].baddbmm_(
                probs[i, :, :, read.n - m : read.n], vr[r0 : r0 + kv_heads * m].view(kv_heads, m, dim_v)
            )
    if tail:
        out += torch.matmul(probs[..., width - tail :], vr.view(reqs, kv_heads, tail, dim_v))
    return out.view(reqs, heads, num_q, dim_v).to(q.dtype)


def warm_up(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Build (or load) the fused kernel now, where a CPU fp32 model will decode with it: at engine start,
    not as a 0.5–2 min stall of the first decode step. True when the kernel will read this model's
    decode steps; False when it is off, not for this device/dtype, or cannot be built (one warning,
    then the matmul read). The decode layers' few-row GEMM (``skinny_gemm``) and RMSNorm / RoPE (``layer_glue``) are built here
    too; the fused read's extension holds the decode append in front of it (``paged_append``). On a CPU
    the C heap keeps freed memory from here on (``paged_cpu_heap``, ``VLKV_CPU_HEAP=0``: off)."""
    if torch.device(device).type == "cpu":
        # the statistics steps' probabilities reuse the heap's pages, not fresh faulted ones each step
        paged_cpu_heap.keep_freed()
    if skinny_gemm.warm_up(device, dtype):
        layer_glue.kernel()  # the decode layers' RMSNorm / RoPE, switched with the GEMM
        decode_layer.warm_up()  # their two fused calls, which compile the GEMM's and the glue's kernels
    if not FUSED_KERNEL or torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    # one extension holds the read and the decode append in front of it (``paged_append``)
    return paged_cpu_kernel.kernel() is not None


def _attend_rows(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    idx: Tensor | None,
) -> Tensor:
    """The fused kernel over requests' own table rows (``idx (R,)`` of the batch, None = all): each
    (request, KV head) reads its live slots of ``table (B, H_kv, C)`` in place, within its
    ``lengths (B, H_kv)``, holes skipped. ``q (B, H_q, 1, D)`` → ``(R, H_q, 1, D_v)`` in q's dtype."""
    if idx is not None:
        q, table, lengths = q[idx], table[idx], lengths[idx]
    reqs, heads, _, dim = q.shape
    kv_heads = k_pool.shape[0]
    qs = q.reshape(reqs, kv_heads, heads // kv_heads, dim).float() * scale
    out = paged_cpu_kernel.table_attention(qs, k_pool, v_pool, table, lengths.clamp(0, table.shape[-1]))
    return out.view(reqs, heads, 1, v_pool.shape[-1]).to(q.dtype)


def _fused_fits(qs: Tensor, k_pool: Tensor, v_pool: Tensor, num_q: int, rows: int | None = None) -> bool:
    """The fused kernel reads this call: enabled and built, one decode row, fp32 contiguous pools of a
    head size it was built for (a bf16 pool, prefill chunks and other sizes keep the matmuls). rows:
    the query rows per KV head (default ``qs.shape[-2]``, for ``qs (R, H_kv, G·Q, D)``)."""
    return (
        FUSED_KERNEL
        and num_q == 1
        and k_pool.device.type == "cpu"
        and k_pool.dtype == torch.float32
        and v_pool.dtype == torch.float32
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and qs.shape[-1] == v_pool.shape[-1]
        and qs.shape[-1] <= paged_cpu_kernel.MAX_DIM
        and (qs.shape[-2] if rows is None else rows) <= paged_cpu_kernel.MAX_ROWS
        and paged_cpu_kernel.kernel() is not None
    )


def _attend_fused(qs: Tensor, k_pool: Tensor, v_pool: Tensor, grp: InplaceGroup) -> Tensor:
    """The in-place requests' decode attention by the fused kernel: ``qs (R, H_kv, G, D)`` scaled fp32
    → ``(R, H_kv, G, D)`` fp32. Every view is a kernel segment; the short runs' gathered columns are
    attended by matmuls; a request's parts are merged by their log-sum-exps (exact softmax)."""
    reqs, kv_heads, rows, dim = qs.shape
    owner, start, length = [], [], []
    for i, read in enumerate(grp.reads):
        for at, end, s in read.views:
            owner.append(i)
            start.append(s)
            length.append(end - at)
    dev = qs.device
    seg_owner = torch.tensor(owner, device=dev)
    out, lse = paged_cpu_kernel.segments_attention(
        qs, k_pool, v_pool, seg_owner, torch.tensor(start, device=dev), torch.tensor(length, device=dev)
    )
    one_run = owner == list(range(reqs))
    if grp.rest is None and one_run:
        return out  # one run per request (a prompt, no appends yet): nothing to merge
    if grp.tail and one_run:  # lockstep decode: one run and m appends per request, merged pairwise
        m = grp.tail  # one append: the transposed block is a strided view, hence contiguous()
        kt = (
            _gather(k_pool, grp.rest)
            .view(reqs, kv_heads, m, dim)
            .transpose(0, 1)
            .reshape(kv_heads, reqs * m, dim)
            .contiguous()
        )
        vt = (
            _gather(v_pool, grp.rest)
            .view(reqs, kv_heads, m, dim)
            .transpose(0, 1)
            .reshape(kv_heads, reqs * m, dim)
            .contiguous()
        )
        at = torch.arange(reqs, device=dev)
        out2, lse2 = paged_cpu_kernel.segments_attention(qs, kt, vt, at, at * m, torch.full_like(at, m))
        top = torch.maximum(lse, lse2)
        w1, w2 = (lse - top).exp_(), (lse2 - top).exp_()
        return (out * w1[..., None] + out2 * w2[..., None]).div_((w1 + w2)[..., None])
    outs, lses, owners = [out], [lse], [seg_owner]
    if grp.rest is not None:
        kr, vr = _gather(k_pool, grp.rest), _gather(v_pool, grp.rest)
        if grp.tail:  # lockstep decode appends: one (R, H_kv, m) block
            parts = [(torch.arange(reqs, device=dev), qs, grp.tail, 0)]
        else:
            parts = [
                (torch.tensor([i], device=dev), qs[i : i + 1], r.rest.numel() // kv_heads, grp.rest_at[i])
                for i, r in enumerate(grp.reads)
                if r.rest is not None
            ]
        for who, qp, m, r0 in parts:
            k = kr[r0 : r0 + who.numel() * kv_heads * m].view(who.numel(), kv_heads, m, dim)
            v = vr[r0 : r0 + who.numel() * kv_heads * m].view(who.numel(), kv_heads, m, dim)
            scores = torch.matmul(qp, k.transpose(-1, -2))  # (r, H_kv, G, m)
            outs.append(torch.matmul(torch.softmax(scores, -1), v))
            lses.append(torch.logsumexp(scores, -1))
            owners.append(who)
    out, lse, who = torch.cat(outs), torch.cat(lses), torch.cat(owners)
    top = torch.full((reqs, kv_heads, rows), float("-inf"), device=dev)
    top = top.scatter_reduce_(0, who[:, None, None].expand_as(lse), lse, "amax")
    w = torch.exp(lse - top[who])  # (N, H_kv, G): each part's share of its request's softmax mass
    num = torch.zeros(reqs, kv_heads, rows, dim, device=dev).index_add_(0, who, out * w[..., None])
    den = torch.zeros(reqs, kv_heads, rows, device=dev).index_add_(0, who, w)
    return num / den[..., None]


def _attend_gathered(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    read: GatheredRead,
    scale: float,
    rot: Tensor | None,
    cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:
    """Requests' K/V gathered into one padded ``(R, H_kv, n, D)`` scratch copy and attended in one pass
    (few calls for any number of requests: many short requests cost no per-request overhead).

    q: (R, H_q, Q, D). read: their :class:`GatheredRead`. rot: None or (R, H_kv, ≥n) with cos, sin. Returns (R, H_q, Q, D_v) in q's dtype.
    """
    reqs, heads, num_q, dim = q.shape
    kv_heads, n, dim_v = k_pool.shape[0], read.n, v_pool.shape[-1]
    group = heads // kv_heads
    flat = read.flat
    buf = _scratch(flat.numel() * (dim + dim_v), k_pool.dtype, k_pool.device)
    k = _gather(k_pool, flat, buf).view(reqs, kv_heads, n, dim)
    v = _gather(v_pool, flat, buf[flat.numel() * dim :]).view(reqs, kv_heads, n, dim_v)
    if rot is not None:
        spin = rot[:, :, :n] if read.held is None else torch.where(read.held, rot[:, :, :n], -1)
        if bool((spin >= 0).any()):
            k = rotate_keys(k, spin, cos, sin)
    k = k if k.dtype == torch.float32 else k.float()
    v = v if v.dtype == torch.float32 else v.float()
    # GQA folded: the G query heads (and Q rows) of a KV head are the rows of one SDPA call, which reads
    # each K/V head once under a (R, H_kv, G·Q or 1, n) mask
    qg = q.reshape(reqs, kv_heads, group * num_q, dim).float()
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=read.vis, scale=scale)
    if read.empty is not None:  # a row that sees nothing is NaN from SDPA: the op defines it as zeros
        out = out.masked_fill_(read.empty, 0.0)
    return out.reshape(reqs, heads, num_q, dim_v).to(q.dtype)  # SDPA may return a strided layout (CUDA)
