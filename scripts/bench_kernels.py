"""Time the vlkv plugin ops against the attention they sit next to, all ratios from one run.

1. Attention statistics (VL-Cache: column sums + below-threshold counts over the last ``--stat-rows``
   prompt rows) vs SDPA forward for the same rows over the same keys, at 2k / 8k / 32k keys.
2. Selected attention at ``--keep`` of 8k keys (decode, one query row) vs gather + SDPA over the same
   slots, and vs SDPA over the full cache.

``--device cuda`` times ``vlkv.plugins.ops`` (the Triton kernels); ``--device cpu`` times the PyTorch
references, because the kernels need CUDA (the Triton interpreter is a correctness tool, not a backend).

    python scripts/bench_kernels.py --device cpu --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from vlkv.plugins import ops, reference


def timed(fn: Callable[[], object], device: str, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA for the last Q prompt rows over all S keys (causal inside the window), GQA without copies.

    q: (B, H, Q, D). k, v: (B, Hkv, S, D). Returns (B, H, Q, D).
    """
    num_q, num_k = q.shape[2], k.shape[2]
    mask = (
        torch.arange(num_k, device=q.device)[None, :]
        <= (num_k - num_q + torch.arange(num_q, device=q.device))[:, None]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bench_stats(args, device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    stats_fn = ops.attn_stats if device == "cuda" else reference.attn_stats_reference
    for num_k in args.keys:
        q = torch.randn(1, args.heads, args.stat_rows, args.dim, device=device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, num_k, args.dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        scale = args.dim**-0.5
        t_stats = timed(partial(stats_fn, q, k, scale, threshold=0.01), device, args.repeats, args.warmup)
        t_sdpa = timed(partial(sdpa_rows, q, k, v), device, args.repeats, args.warmup)
        rows.append({"keys": num_k, "stats_ms": t_stats, "sdpa_ms": t_sdpa, "ratio": t_stats / t_sdpa})
    return rows


def bench_selected(args, device: str, dtype: torch.dtype) -> dict:
    num_k, kv_heads = args.select_keys, args.kv_heads
    keep = max(1, round(args.keep * num_k))
    q = torch.randn(1, args.heads, 1, args.dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, num_k, args.dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    indices = torch.stack([torch.randperm(num_k, device=device)[:keep] for _ in range(kv_heads)])[None]
    lengths = torch.full((1, kv_heads), keep, device=device, dtype=torch.int64)
    scale = args.dim**-0.5
    select_fn = ops.selected_attention if device == "cuda" else reference.selected_attention_reference

    def gather_sdpa():
        idx = indices[..., None].expand(-1, -1, -1, args.dim)
        return F.scaled_dot_product_attention(
            q, k.gather(2, idx), v.gather(2, idx), scale=scale, enable_gqa=True
        )

    def full_sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    t_sel = timed(lambda: select_fn(q, k, v, indices, lengths, scale), device, args.repeats, args.warmup)
    t_gather = timed(gather_sdpa, device, args.repeats, args.warmup)
    t_full = timed(full_sdpa, device, args.repeats, args.warmup)
    return {
        "keys": num_k,
        "selected": keep,
        "selected_ms": t_sel,
        "gather_sdpa_ms": t_gather,
        "full_sdpa_ms": t_full,
        "ratio_vs_gather": t_sel / t_gather,
        "ratio_vs_full": t_sel / t_full,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "fp16", "bf16", "fp32"], default=None,
                        help="default: float16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--stat-rows", type=int, default=50, help="query rows the statistics cover")
    parser.add_argument("--keys", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--select-keys", type=int, default=8192)
    parser.add_argument("--keep", type=float, default=0.3, help="fraction of keys selected")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not 0 < args.keep <= 1:
        parser.error(f"--keep must be in (0, 1], got {args.keep}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda but CUDA is not available")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.dtype or ("float16" if args.device == "cuda" else "float32")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(name) or getattr(
        torch, name
    )
    if args.device == "cuda":
        machine = torch.cuda.get_device_name()
    else:
        machine = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    path = "Triton kernels (vlkv.plugins.ops)" if args.device == "cuda" else "PyTorch references"
    torch.manual_seed(0)
    stats = bench_stats(args, args.device, dtype)
    selected = bench_selected(args, args.device, dtype)
    print(
        f"# {path} on {machine}, {torch.get_num_threads()} threads, {dtype}, H={args.heads} Hkv={args.kv_heads}"
    )
    print(f"\n## attention statistics over {args.stat_rows} rows vs SDPA for the same rows (median ms)")
    print("| keys | stats | SDPA | stats / SDPA |\n|---:|---:|---:|---:|")
    for row in stats:
        print(f"| {row['keys']} | {row['stats_ms']:.2f} | {row['sdpa_ms']:.2f} | {row['ratio']:.2f} |")
    s = selected
    print(f"\n## selected attention, {s['selected']} of {s['keys']} keys, one decode row (median ms)")
    print("| selected | gather + SDPA | full SDPA | sel / gather | sel / full |\n|---:|---:|---:|---:|---:|")
    print(
        f"| {s['selected_ms']:.3f} | {s['gather_sdpa_ms']:.3f} | {s['full_sdpa_ms']:.3f} "
        f"| {s['ratio_vs_gather']:.2f} | {s['ratio_vs_full']:.2f} |"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        result = {"device": args.device, "machine": machine, "path": path, "dtype": str(dtype)}
        result |= {"threads": torch.get_num_threads(), "config": config, "stats": stats, "selected": selected}
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
