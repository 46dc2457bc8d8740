"""The GPU check's ``kernels`` part: each vlkv kernel against its reference and the plain PyTorch form it
replaces (SDPA, gather + SDPA), timed on one device, with the largest difference recorded beside the times."""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.nn.functional as F
from gpu_lowrank_split import kernel_lowrank_split
from gpu_timing import Sink, timed_ms


def _kernel_sizes(args) -> dict:
    if args.tiny:
        return {"heads": 4, "kv_heads": 2, "dim": 16, "keys": [64, 128], "select_keys": 128, "stat_rows": 8}
    return {
        "heads": 32,
        "kv_heads": 8,
        "dim": 128,
        "keys": [2048, 8192, 32768],
        "select_keys": 8192,
        "stat_rows": 64,
    }


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def kernel_stats(args, dtype, sizes) -> list[dict]:
    from bench_kernels import sdpa_rows

    from vlkv.plugins import ops, reference

    rows = []
    for num_k in sizes["keys"]:
        q = torch.randn(1, sizes["heads"], sizes["stat_rows"], sizes["dim"], device=args.device, dtype=dtype)
        k = torch.randn(1, sizes["kv_heads"], num_k, sizes["dim"], device=args.device, dtype=dtype)
        v = torch.randn_like(k)
        scale = sizes["dim"] ** -0.5
        got = ops.attn_stats(q, k, scale, threshold=0.01)
        ref = reference.attn_stats_reference(q, k, scale, threshold=0.01)
        t_stats = timed_ms(partial(ops.attn_stats, q, k, scale, threshold=0.01), args.device, args.repeats)
        t_sdpa = timed_ms(partial(sdpa_rows, q, k, v), args.device, args.repeats)
        rows.append(
            {
                "keys": num_k,
                "stats_ms": t_stats,
                "sdpa_ms": t_sdpa,
                "ratio": t_stats / t_sdpa,
                "colsum_max_err": _err(got.colsum, ref.colsum),
            }
        )
    return rows


def kernel_selected(args, dtype, sizes, keep: float = 0.3) -> dict:
    from vlkv.plugins import ops, reference

    n, hkv, d = sizes["select_keys"], sizes["kv_heads"], sizes["dim"]
    sel = max(1, round(keep * n))
    q = torch.randn(1, sizes["heads"], 1, d, device=args.device, dtype=dtype)
    k = torch.randn(1, hkv, n, d, device=args.device, dtype=dtype)
    v = torch.randn_like(k)
    idx = torch.stack([torch.randperm(n, device=args.device)[:sel] for _ in range(hkv)])[None]
    lengths = torch.full((1, hkv), sel, device=args.device, dtype=torch.int64)
    scale = d**-0.5

    def gather_sdpa():
        g = idx[..., None].expand(-1, -1, -1, d)
        return F.scaled_dot_product_attention(q, k.gather(2, g), v.gather(2, g), scale=scale, enable_gqa=True)

    got = ops.selected_attention(q, k, v, idx, lengths, scale)
    err = _err(got, reference.selected_attention_reference(q, k, v, idx, lengths, scale))
    t_sel = timed_ms(lambda: ops.selected_attention(q, k, v, idx, lengths, scale), args.device, args.repeats)
    t_gather = timed_ms(gather_sdpa, args.device, args.repeats)
    t_full = timed_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        args.device,
        args.repeats,
    )
    return {
        "keys": n,
        "selected": sel,
        "selected_ms": t_sel,
        "gather_sdpa_ms": t_gather,
        "full_sdpa_ms": t_full,
        "speedup_vs_gather": t_gather / t_sel,
        "max_err": err,
    }


def _paged_cases(args, dtype, sizes):
    """One decode row per request over a pool where every request's entries lie scattered in 16-slot
    pages: yields ``(tokens, batch, call, k, v)`` per token count, ``call = (q, k_pool, v_pool, table,
    lengths, scale)`` the paged read's arguments and ``k, v (B, H_kv, T, D)`` the same cache contiguous."""
    hq, hkv, d = sizes["heads"], sizes["kv_heads"], sizes["dim"]
    batch = 2 if args.tiny else 4
    for t in sizes["keys"][:2] if not args.tiny else sizes["keys"]:
        page = 16
        pages = batch * (-(-t // page))
        perm = torch.randperm(pages, device=args.device)
        slots = (perm[:, None] * page + torch.arange(page, device=args.device)).reshape(-1)
        table = slots[: batch * (-(-t // page)) * page].view(batch, -1)[:, :t]
        table = table[:, None, :].expand(batch, hkv, t).contiguous()
        k_pool = torch.randn(hkv, pages * page, d, device=args.device, dtype=dtype)
        v_pool = torch.randn_like(k_pool)
        lengths = torch.full((batch, hkv), t, device=args.device, dtype=torch.int64)
        q = torch.randn(batch, hq, 1, d, device=args.device, dtype=dtype)
        k = k_pool[torch.arange(hkv, device=args.device)[None, :, None], table]  # (B, Hkv, T, D)
        v = v_pool[torch.arange(hkv, device=args.device)[None, :, None], table]
        yield t, batch, (q, k_pool, v_pool, table, lengths, d**-0.5), k, v


def kernel_paged(args, dtype, sizes) -> list[dict] | str:
    """The runtime-v3 paged read (``ops.paged_attention``) vs SDPA over a contiguous cache: one decode
    row per request, every request's entries scattered over the pool in 16-slot pages."""
    from vlkv.plugins import ops

    if not hasattr(ops, "paged_attention"):
        return "skipped: vlkv.plugins.ops has no paged_attention yet"
    rows = []
    for t, batch, call, k, v in _paged_cases(args, dtype, sizes):
        q, scale = call[0], call[-1]
        want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        got = ops.paged_attention(*call)
        paged = partial(ops.paged_attention, *call)
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
        t_paged = timed_ms(paged, args.device, args.repeats)
        t_sdpa = timed_ms(sdpa, args.device, args.repeats)
        kv_bytes = 2 * batch * k.shape[1] * t * k.shape[-1] * k.element_size()
        rows.append(
            {
                "tokens": t,
                "batch": batch,
                "paged_ms": t_paged,
                "contiguous_sdpa_ms": t_sdpa,
                "ratio_vs_sdpa": t_paged / t_sdpa,
                "paged_gbps": kv_bytes / t_paged / 1e6,
                "max_err_vs_sdpa": _err(got, want),
            }
        )
    return rows


def _probs_halves(call, host):
    """The two halves a statistics step ran on the GPU before the kernel (routed from host lengths, as
    the engine routes them): ``out (B, H_q, 1, D_v)``, ``probs (B, H_kv, G, C)``."""
    from vlkv.plugins.paged_probs import decode_route, paged_decode_out, paged_decode_probs

    q, k_pool, v_pool, table, lengths, scale = call
    route = decode_route(table, lengths, host=host, holes=False)
    probs, _ = paged_decode_probs(q, k_pool, table, lengths, scale, route=route)
    return paged_decode_out(probs, v_pool, table, lengths, route=route).view(q.shape), probs


def kernel_paged_probs(args, dtype, sizes) -> list[dict]:
    """A statistics decode step's read, the paged read with probabilities: output and softmax from one
    in-place read (``paged_probs.triton_decode_probs``, the Triton kernel; CUDA only) vs the two halves it
    replaced there (gather K, matmul, softmax; gather V, matmul: ``paged_decode_probs`` /
    ``paged_decode_out``, the reference), the plain paged read (no probabilities) and SDPA over a
    contiguous cache. Max errors vs the halves; without the kernel (CPU) only the others are timed."""
    from vlkv.plugins import ops
    from vlkv.plugins.paged_probs import triton_decode_probs

    rows = []
    for t, batch, call, k, v in _paged_cases(args, dtype, sizes):
        q, scale = call[0], call[-1]
        host = call[4].tolist()  # the engine's host lengths: no read back per call
        halves = partial(_probs_halves, call, host)
        kernel = partial(triton_decode_probs, *call, host=host, holes=False)
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
        want_out, want_p = halves()
        row = {
            "tokens": t,
            "batch": batch,
            "halves_ms": timed_ms(halves, args.device, args.repeats),
            "paged_ms": timed_ms(partial(ops.paged_attention, *call), args.device, args.repeats),
            "contiguous_sdpa_ms": timed_ms(sdpa, args.device, args.repeats),
            "halves_out_err_vs_sdpa": _err(want_out, sdpa()),
        }
        got = kernel()
        if got is not None:
            out, probs, _ = got
            row["probs_ms"] = timed_ms(kernel, args.device, args.repeats)
            row["speedup_vs_halves"] = row["halves_ms"] / row["probs_ms"]
            row["ratio_vs_paged"] = row["probs_ms"] / row["paged_ms"]
            row["ratio_vs_sdpa"] = row["probs_ms"] / row["contiguous_sdpa_ms"]
            row["probs_max_err"] = _err(probs, want_p)
            row["out_max_err"] = _err(out, want_out)
        rows.append(row)
    return rows


def kernel_lowrank(args, dtype, sizes) -> dict:
    """AttentionPack's rank-space decode (``ops.lowrank_attention``) over T factored + S dense entries
    vs SDPA over T + S dense entries."""
    from vlkv.plugins import ops
    from vlkv.plugins.lowrank_reference import lowrank_decode_attention

    hq, hkv, d = sizes["heads"], sizes["kv_heads"], sizes["dim"]
    t, s, r, b = (64, 16, 8, 1) if args.tiny else (8192, 512, 64, 1)
    dev = args.device
    q = torch.randn(b, hq, d, device=dev, dtype=dtype)
    kbar = torch.randn(b, t, r, device=dev, dtype=dtype)
    vbar = torch.randn(b, t, r, device=dev, dtype=dtype)
    dk = torch.randn(b, r, hkv * d, device=dev, dtype=dtype) / r**0.5
    dv = torch.randn(b, r, hkv * d, device=dev, dtype=dtype) / r**0.5
    k = torch.randn(b, hkv, s, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    rows = torch.full((b,), t, device=dev, dtype=torch.int64)
    dense = torch.full((b,), s, device=dev, dtype=torch.int64)
    got = ops.lowrank_attention(q, kbar, dk, vbar, dv, rows, k, v, dense)
    err = _err(got, lowrank_decode_attention(q, kbar, dk, vbar, dv, rows, k, v, dense))
    kd = torch.randn(b, hkv, t + s, d, device=dev, dtype=dtype)
    vd = torch.randn_like(kd)
    t_lr = timed_ms(
        lambda: ops.lowrank_attention(q, kbar, dk, vbar, dv, rows, k, v, dense), dev, args.repeats
    )
    t_dense = timed_ms(
        lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True), dev, args.repeats
    )
    return {"factored": t, "dense": s, "rank": r, "lowrank_ms": t_lr, "dense_sdpa_ms": t_dense,
            "ratio_vs_dense": t_lr / t_dense, "max_err": err}  # fmt: skip


def kernel_merge(args, dtype, sizes) -> dict:
    """KV merging (Elastic Cache): segment means of ``S`` rows into ``S/4`` outputs vs the reference."""
    from vlkv.plugins import ops, reference

    s = 128 if args.tiny else 8192
    hkv, d, dev = sizes["kv_heads"], sizes["dim"], args.device
    k = torch.randn(1, hkv, s, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    out = s // 4
    assign = torch.sort(torch.randint(0, out, (1, hkv, s), device=dev), dim=-1).values
    counts = torch.zeros(1, hkv, out, device=dev, dtype=torch.int64).scatter_add_(
        -1, assign, torch.ones_like(assign)
    )
    got = ops.merge_kv(k, v, assign, counts)
    ref = reference.merge_kv_reference(k, v, assign, counts)
    t_k = timed_ms(lambda: ops.merge_kv(k, v, assign, counts), dev, args.repeats)
    t_ref = timed_ms(lambda: reference.merge_kv_reference(k, v, assign, counts), dev, args.repeats)
    return {"rows": s, "outputs": out, "kernel_ms": t_k, "reference_ms": t_ref, "speedup": t_ref / t_k,
            "max_err": max(_err(got[0], ref[0]), _err(got[1], ref[1]))}  # fmt: skip


def run_kernels(args, sink: Sink) -> None:
    from vlkv.plugins import ops

    # the low-rank split entry skips its batch > 1 cells late in the part
    args.part_start = time.perf_counter()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    sizes = _kernel_sizes(args)
    on_gpu = args.device.startswith("cuda") and ops.use_triton(torch.empty(1, device=args.device))
    result: dict = {"dtype": str(dtype), "path": "triton" if on_gpu else "pytorch reference", "sizes": sizes}
    for name, fn in (
        ("stats", kernel_stats),
        ("selected", kernel_selected),
        ("paged", kernel_paged),
        ("paged_probs", kernel_paged_probs),
        ("lowrank", kernel_lowrank),
        ("merge", kernel_merge),
        # last: its compiles are the part's longest, and it keeps each cell as it goes
        (
            "lowrank_split",
            partial(kernel_lowrank_split, emit=lambda rows: sink({**result, "lowrank_split": rows})),
        ),
    ):
        torch.manual_seed(0)
        try:
            result[name] = fn(args, dtype, sizes)
        except Exception as exc:  # one kernel's failure is recorded, the others still run
            result[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        sink(result)
