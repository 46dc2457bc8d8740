"""Time the decode step's attention read over all layers: paged reads against the padded gather the runtime
does today, a contiguous cache, and the machine's memory bandwidth, all from one interleaved run.

Shapes default to ``smollm2-llava`` at 8k tokens × batch 4 (30 layers, 9 query heads, 3 KV heads, head dim
64, fp32). Each configuration is one decode step's attention for every layer (one query row per request):

- ``paged``: ``vlkv.plugins.ops.paged_attention`` on the tables the pool hands out (each request one run
  of slots, the same in every head, requests scattered over the pool): read in place;
- ``paged-fixed-pool``: the same with each request's last 16 entries single slots interleaved with the
  other requests' (a fixed pool's decode appends): the prompt's run in place, the 16 gathered;
- ``paged-gather``: the same op forced to its gather form (``run_min`` = ∞): what holes or per-head tables cost;
- ``padded-gather+sdpa``: today's path — every request's slots gathered into one padded ``(B, H_kv, T, D)``
  scratch buffer (``KVPool.read``), then SDPA with ``enable_gqa``;
- ``contiguous-sdpa`` / ``contiguous-folded``: a contiguous ``(B, H_kv, T, D)`` cache (a static cache),
  SDPA and GQA folded into two matmuls: no paging at all;
- ``paged-evicted``: ``paged_attention`` on per-head tables keeping ``--keep`` of each request's entries
  (scattered, as SnapKV leaves them): its bound counts only the kept bytes;
- ``flex`` (``--flex``): ``torch.compile(flex_attention)`` with a block mask built from the tables.

The bound of a configuration is the K/V bytes it must read over the bandwidth of a STREAM-like read
(``sum`` of a buffer far larger than the caches, best of 7).

    python scripts/bench_paged.py --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from vlkv.plugins import ops
from vlkv.plugins.paged_cpu import paged_attention_cpu


def read_bandwidth(gib: float = 2.0, repeats: int = 7) -> float:
    """GB/s of a sum over ``gib`` GiB of fp32 (best of ``repeats``): the machine's read bandwidth."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = min(_time(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_problem(args) -> dict:
    """Pools, tables and a contiguous copy of the same K/V (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    b, hk, t, d, layers = args.batch, args.kv_heads, args.tokens, args.dim, args.layers
    appends = 16  # the fixed-pool layout's decode appends per request
    slots = b * (t + 64) + appends * b
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    kp = [torch.randn(hk, slots, d, generator=g).to(dtype) for _ in range(layers)]
    vp = [torch.randn(hk, slots, d, generator=g).to(dtype) for _ in range(layers)]
    # request r owns the run starting at its shuffled place in the pool, 64 free slots between runs
    starts = torch.randperm(b, generator=g) * (t + 64) + 32
    runs = (starts[:, None] + torch.arange(t))[:, None].expand(b, hk, t).contiguous()
    lengths = torch.full((b, hk), t, dtype=torch.long)
    # a fixed pool's layout after 16 decode steps: the prompt's run, then one slot per step, the requests'
    # appends interleaved past every run
    tail = b * (t + 64) + torch.arange(appends)[None, :] * b + torch.arange(b)[:, None]
    fixed = torch.cat([runs[:, 0, : t - appends], tail], dim=1)[:, None].expand(b, hk, t).contiguous()
    keep = max(1, round(args.keep * t))
    picked = torch.stack([torch.randperm(t, generator=g)[:keep].sort().values for _ in range(b * hk)])
    evicted = runs.gather(2, picked.view(b, hk, keep))
    heads = torch.arange(hk)[None, :, None]
    contiguous = [(k[heads, runs], v[heads, runs]) for k, v in zip(kp, vp, strict=True)]
    q = torch.randn(b, args.heads, 1, d, generator=g).to(dtype)
    return dict(
        q=q,
        kp=kp,
        vp=vp,
        runs=runs,
        fixed=fixed,
        lengths=lengths,
        evicted=evicted,
        keep=keep,
        contiguous=contiguous,
    )


def configurations(args, p: dict) -> dict:
    """name → (one decode step's attention over every layer, K/V bytes it must read)."""
    q, kp, vp, runs, lengths = p["q"], p["kp"], p["vp"], p["runs"], p["lengths"]
    b, hq, _, d = q.shape
    hk, layers, scale = args.kv_heads, args.layers, d**-0.5
    full = 2 * layers * b * hk * args.tokens * d * q.element_size()
    kept_lengths = torch.full((b, hk), p["keep"], dtype=torch.long)
    cap = kp[0].shape[1]
    flat = (runs + torch.arange(hk)[None, :, None] * cap).reshape(-1)
    scratch = torch.empty(2, flat.numel(), d, dtype=q.dtype)

    def paged():
        for k, v in zip(kp, vp, strict=True):
            ops.paged_attention(q, k, v, runs, lengths, scale)

    def paged_fixed():
        for k, v in zip(kp, vp, strict=True):
            ops.paged_attention(q, k, v, p["fixed"], lengths, scale)

    def paged_gather():
        for k, v in zip(kp, vp, strict=True):
            paged_attention_cpu(q, k, v, runs, lengths, scale, run_min=2**62)

    def padded_gather_sdpa():
        for k, v in zip(kp, vp, strict=True):
            torch.index_select(k.view(-1, d), 0, flat, out=scratch[0])
            torch.index_select(v.view(-1, d), 0, flat, out=scratch[1])
            kk, vv = (s.view(b, hk, args.tokens, d) for s in scratch)
            F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)

    def contiguous_sdpa():
        for k, v in p["contiguous"]:
            F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def contiguous_folded():
        for k, v in p["contiguous"]:
            s = k @ (q.view(b, hk, hq // hk, d).transpose(-1, -2) * scale)
            torch.softmax(s.transpose(-1, -2), dim=-1) @ v

    def paged_evicted():
        for k, v in zip(kp, vp, strict=True):
            ops.paged_attention(q, k, v, p["evicted"], kept_lengths, scale)

    configs = {
        "paged": (paged, full),
        "paged-fixed-pool": (paged_fixed, full),
        "paged-gather": (paged_gather, full),
        "padded-gather+sdpa": (padded_gather_sdpa, full),
        "contiguous-sdpa": (contiguous_sdpa, full),
        "contiguous-folded": (contiguous_folded, full),
        f"paged-evicted-{args.keep:g}": (paged_evicted, full * p["keep"] // args.tokens),
    }
    if args.flex:
        configs["flex"] = (flex_step(args, p), full)
    return configs


def flex_step(args, p: dict):
    """One step of compiled ``flex_attention`` reading the pools through a block mask from the tables
    (PyTorch's paged-attention pattern: the physical pool is every request's K/V, the mask keeps the
    blocks — and inside them the slots — a request owns). Compiled once, before the timed rounds."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    q, kp, vp, runs = p["q"], p["kp"], p["vp"], p["runs"]
    b, hq, _, d = q.shape
    cap, bs = kp[0].shape[1], 128
    owned = torch.zeros(b, cap, dtype=torch.bool)
    owned.scatter_(1, runs[:, 0], True)  # the same slots in every head (runs tables)
    nblk = -(-cap // bs)
    per_block = F.pad(owned, (0, nblk * bs - cap)).view(b, nblk, bs).sum(-1)
    # the CPU template wants whole blocks apart (no mask_mod call) from partly owned ones
    full, part = per_block == bs, (per_block > 0) & (per_block < bs)

    def listing(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.zeros(b, 1, 1, nblk, dtype=torch.int32)  # width = every block (flex reads it so)
        num = sel.sum(-1).to(torch.int32).view(b, 1, 1)
        for i in range(b):
            ids = sel[i].nonzero().flatten()
            idx[i, 0, 0, : ids.numel()] = ids
        return num, idx

    def mask_mod(bi, h, q_idx, kv_idx):
        return owned[bi, kv_idx]

    mask = BlockMask.from_kv_blocks(
        *listing(part), *listing(full), BLOCK_SIZE=(1, bs), mask_mod=mask_mod, seq_lengths=(1, cap)
    )
    attend = torch.compile(flex_attention, dynamic=False)
    pools = [(k[None].expand(b, *k.shape), v[None].expand(b, *v.shape)) for k, v in zip(kp, vp, strict=True)]

    def step():
        for k, v in pools:
            attend(q, k, v, block_mask=mask, scale=d**-0.5, enable_gqa=True)

    step()  # compile
    want = F.scaled_dot_product_attention(q, *p["contiguous"][0], scale=d**-0.5, enable_gqa=True)
    got = attend(q, *pools[0], block_mask=mask, scale=d**-0.5, enable_gqa=True)
    p["flex_max_abs_diff"] = float((got.float() - want.float()).abs().max())
    return step


def check(args, p: dict) -> float:
    """Max |paged - SDPA on the contiguous cache| over the first layer: the configurations agree."""
    q, d = p["q"], args.dim
    want = F.scaled_dot_product_attention(q, *p["contiguous"][0], scale=d**-0.5, enable_gqa=True)
    got = ops.paged_attention(q, p["kp"][0], p["vp"][0], p["runs"], p["lengths"], d**-0.5)
    return float((got.float() - want.float()).abs().max())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8206, help="entries per request (8k prompt + image)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--keep", type=float, default=0.5, help="kept fraction of the evicted configuration")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--flex", action="store_true", help="also time compiled flex_attention (compiles ~30 s)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not 0 < args.keep <= 1:
        ap.error(f"--keep must be in (0, 1], got {args.keep}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    problem = make_problem(args)
    configs = configurations(args, problem)
    error = check(args, problem)
    bandwidth = read_bandwidth()
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for name, (fn, _) in configs.items():
            samples[name].append(_time(fn) * 1e3)
    bandwidth = max(bandwidth, read_bandwidth())  # before and after the rounds
    machine = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    load = os.getloadavg()[0]
    print(f"# decode attention read, {args.layers} layers × batch {args.batch} × {args.tokens} tokens, "
          f"H={args.heads} Hkv={args.kv_heads} D={args.dim} {args.dtype}; {machine}, "
          f"{torch.get_num_threads()} threads, load {load:.1f}")  # fmt: skip
    flex = problem.get("flex_max_abs_diff")
    print(f"read bandwidth {bandwidth:.1f} GB/s; vs contiguous SDPA max |diff|: paged {error:.2e}", end="")
    print("" if flex is None else f", flex {flex:.2e}", end="\n\n")
    print(
        "| configuration | best ms | median ms | GB/s (best) | bound ms | % of bound |\n|---|---:|---:|---:|---:|---:|"
    )
    rows = []
    for name, (_, nbytes) in configs.items():
        best, med = min(samples[name]), statistics.median(samples[name])
        bound = nbytes / bandwidth / 1e6
        rows.append(
            dict(name=name, best_ms=best, median_ms=med, bytes=nbytes, bound_ms=bound, samples=samples[name])
        )
        print(
            f"| {name} | {best:.1f} | {med:.1f} | {nbytes / best / 1e6:.1f} | {bound:.1f} | {100 * bound / best:.0f} % |"
        )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        result = dict(machine=machine, threads=torch.get_num_threads(), load=load, bandwidth_gbs=bandwidth)
        result |= dict(max_abs_diff=error, config=config, rows=rows, torch=torch.__version__)
        result |= {"flex_max_abs_diff": problem.get("flex_max_abs_diff")}
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
