"""Micro-benchmark: arrangements of torch calls for the CPU decode attention read (issue #28).

One decode row per request, smollm2-llava's shapes (9 query heads, 3 KV heads, head dim 64, fp32),
``--batch`` requests of ``--tokens`` entries each, one contiguous run of a head-major pool
``(H_kv, S, D)`` per request (as ``runtime/kv/pool.py`` lays it out), ``--layers`` layers of buffers
(≫ cache, so every read comes from memory). Times, in interleaved rounds, one decode step's attention
over every layer for each form, and the machine's read bandwidth (``sum``) in the same rounds:

- ``op``: ``paged_cpu.paged_attention_cpu`` with a prebuilt plan (the shipped read);
- ``fused``: the same with ``FUSED_KERNEL`` (the C++ kernel of ``paged_cpu_kernel``);
- ``opqk``: the same with ``SCORES_QK`` (``q @ K^T``);
- ``kq`` / ``qk``: ``bmm`` of the pool view with the folded query (``K @ q^T`` / ``q @ K^T``),
  softmax, ``bmm`` with V, per request (the op's core without its bookkeeping);
- ``sdpa``: ``scaled_dot_product_attention`` on the pool views, GQA folded (the G query heads of a
  KV head as its query rows), one call per request;
- ``mv``: ``torch.mv`` per query row and head (BLAS gemv for the scores and for ``V^T p``);
- ``bd``: a slot-major pool ``(S, H_kv·D)`` (NOT vlkv's layout): one GEMM of the run against a
  block-diagonal ``(H_kv·D, H_kv·G)`` query for every head's scores, one for the output (3× flops);
- ``dense``: the spec's folded GQA on a contiguous ``(B, H_kv, T, D)`` copy (its 102 ms reference).

Run: ``python scripts/bench_attn_forms.py --tokens 8192 --threads 1``. Prints a markdown table:
best and median ms per step, effective GB/s (K+V bytes / best), ratio to ``op`` (median of the
per-round ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vlkv.plugins import paged_cpu, paged_cpu_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--forms", default="op,fused,opqk,qk,sdpa,mv,bd,dense")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, Hq, Hk, D, T, L = args.batch, 9, 3, 64, args.tokens, args.layers
    G, S = Hq // Hk, args.batch * args.tokens
    scale = D**-0.5
    forms = args.forms.split(",")
    kp = [torch.randn(Hk, S, D) for _ in range(L)]
    vp = [torch.randn(Hk, S, D) for _ in range(L)]
    q = torch.randn(B, Hq, 1, D)
    table = (torch.arange(B)[:, None, None] * T + torch.arange(T)).expand(B, Hk, T).contiguous()
    lengths = torch.full((B, Hk), T)
    plan = paged_cpu.plan_for(q, kp[0], table, lengths, inplace_min=1)
    assert plan.gathered is None and all(len(r.views) == 1 for r in plan.inplace.reads)
    qf = q.view(B, Hk, G, D) * scale  # (B, H_kv, G, D)
    qt = qf.transpose(-1, -2).contiguous()  # (B, H_kv, D, G)
    ks = vs = kd = vd = None
    if "bd" in forms:  # slot-major copies: (S, H_kv·D)
        ks = [k.transpose(0, 1).reshape(S, Hk * D).contiguous() for k in kp]
        vs = [v.transpose(0, 1).reshape(S, Hk * D).contiguous() for v in vp]
    qbd = torch.zeros(B, Hk * D, Hk * G)
    for h in range(Hk):
        qbd[:, h * D : (h + 1) * D, h * G : (h + 1) * G] = qt[:, h]
    if "dense" in forms:
        kd = [k.view(Hk, B, T, D).transpose(0, 1).contiguous() for k in kp]
        vd = [v.view(Hk, B, T, D).transpose(0, 1).contiguous() for v in vp]
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB for the bandwidth probe

    def op():
        return [
            paged_cpu.paged_attention_cpu(q, kp[i], vp[i], table, lengths, scale, plan=plan) for i in range(L)
        ]

    def opqk():
        paged_cpu.SCORES_QK = True
        try:
            return op()
        finally:
            paged_cpu.SCORES_QK = False

    def fused():
        paged_cpu.FUSED_KERNEL = True
        try:
            return op()
        finally:
            paged_cpu.FUSED_KERNEL = False

    def kq():
        for i in range(L):
            for b in range(B):
                k, v = kp[i][:, b * T : (b + 1) * T], vp[i][:, b * T : (b + 1) * T]
                s = torch.bmm(k, qt[b]).transpose(1, 2)  # (H_kv, G, T)
                torch.bmm(torch.softmax(s, -1), v)

    def qk():
        for i in range(L):
            for b in range(B):
                k, v = kp[i][:, b * T : (b + 1) * T], vp[i][:, b * T : (b + 1) * T]
                torch.bmm(torch.softmax(torch.bmm(qf[b], k.transpose(1, 2)), -1), v)

    def sdpa():
        for i in range(L):
            for b in range(B):
                k, v = kp[i][:, b * T : (b + 1) * T], vp[i][:, b * T : (b + 1) * T]
                F.scaled_dot_product_attention(qf[b : b + 1], k[None], v[None], scale=1.0)

    def mv():
        for i in range(L):
            for b in range(B):
                for h in range(Hk):
                    k, v = kp[i][h, b * T : (b + 1) * T], vp[i][h, b * T : (b + 1) * T]
                    for g in range(G):
                        torch.mv(v.t(), torch.softmax(torch.mv(k, qf[b, h, g]), 0))

    def bd():
        for i in range(L):
            for b in range(B):
                k, v = ks[i][b * T : (b + 1) * T], vs[i][b * T : (b + 1) * T]
                p = torch.softmax(k @ qbd[b], 0)  # (T, H_kv·G)
                o = p.t() @ v  # (H_kv·G, H_kv·D): keep the diagonal blocks
                torch.stack([o[h * G : (h + 1) * G, h * D : (h + 1) * D] for h in range(Hk)])

    def dense():
        for i in range(L):
            torch.softmax(qf @ kd[i].transpose(-1, -2), -1) @ vd[i]

    fns = {
        "op": op,
        "opqk": opqk,
        "fused": fused,
        "kq": kq,
        "qk": qk,
        "sdpa": sdpa,
        "mv": mv,
        "bd": bd,
        "dense": dense,
    }
    # every form computes the same attention (checked once, before timing)
    ref = op()[0]
    assert paged_cpu_kernel.kernel() is not None, "the fused kernel could not be built"
    paged_cpu.FUSED_KERNEL = True
    torch.testing.assert_close(
        paged_cpu.paged_attention_cpu(q, kp[0], vp[0], table, lengths, scale, plan=plan), ref
    )
    paged_cpu.FUSED_KERNEL = False
    got_sdpa = torch.cat(
        [
            F.scaled_dot_product_attention(
                qf[b : b + 1],
                kp[0][None, :, b * T : (b + 1) * T],
                vp[0][None, :, b * T : (b + 1) * T],
                scale=1.0,
            )
            for b in range(B)
        ]
    ).reshape(B, Hq, 1, D)
    torch.testing.assert_close(got_sdpa, ref, rtol=1e-4, atol=1e-5)
    times: dict[str, list[float]] = {f: [] for f in forms}
    bw = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
        for f in forms:
            t = time.perf_counter()
            fns[f]()
            times[f].append(time.perf_counter() - t)
    kv_bytes = 2 * L * B * Hk * T * D * 4
    print(
        f"T={T} B={B} L={L} threads={args.threads} K+V={kv_bytes / 1e9:.2f} GB "
        f"sum bandwidth best {max(bw):.1f} median {statistics.median(bw):.1f} GB/s"
    )
    print("| form | best ms | median ms | GB/s (best) | vs op (median of per-round ratios) |")
    print("|---|---:|---:|---:|---:|")
    for f in forms:
        ratio = (
            statistics.median(a / b for a, b in zip(times["op"], times[f], strict=True))
            if "op" in times
            else 0
        )
        print(
            f"| {f} | {min(times[f]) * 1e3:.0f} | {statistics.median(times[f]) * 1e3:.0f} | "
            f"{kv_bytes / min(times[f]) / 1e9:.1f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
