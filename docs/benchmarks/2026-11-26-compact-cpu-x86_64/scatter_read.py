"""The fused CPU decode kernel's table rows over one run, a run with 8 gaps, and a scattered subset.

    python docs/benchmarks/2026-11-26-compact-cpu-x86_64/scatter_read.py 4100 1640 820

32 layers of (5, 4 × 8,264, 64) fp32 K and V pools (far above the L3), 4 requests × 5 KV heads × 3
query rows; each row holds n entries: ``run`` n slots in a row, ``8gaps`` the same with 8 slots
skipped mid-row (what H2O's per-step evictions leave), ``scatter`` n ascending slots drawn at random
from the request's 8,200 (what a prompt-time selection leaves unpacked). Median of 6 rounds, the
three layouts rotated within each round.
"""

import sys
import time

import torch

from vlkv.plugins import paged_cpu_kernel as kernel

torch.set_num_threads(1)
H, D, G, R, L, FULL = 5, 64, 3, 4, 32, 8200
S = 4 * FULL + 64
pools = [(torch.randn(H, S, D), torch.randn(H, S, D)) for _ in range(L)]
q = torch.randn(R, H, G, D)
base = torch.arange(R)[:, None, None] * FULL
torch.manual_seed(0)
for n in [int(a) for a in sys.argv[1:]] or [4100, 820]:
    run = (base + torch.arange(n)).expand(R, H, n).contiguous()
    gaps = run.clone()
    for g in range(8):
        gaps[..., n // 2 + g * 8 :] += 1
    picks = [[torch.randperm(FULL)[:n].sort().values for _ in range(H)] for _ in range(R)]
    scatter = torch.stack([torch.stack(p) for p in picks]) + base
    lens = torch.full((R, H), n)
    res = {"run": [], "8gaps": [], "scatter": []}
    for _ in range(6):
        for name, table in (("run", run), ("8gaps", gaps), ("scatter", scatter)):
            t0 = time.perf_counter()
            for kp, vp in pools:
                kernel.table_attention(q, kp, vp, table, lens)
            res[name].append(time.perf_counter() - t0)
    gb = L * R * H * n * D * 4 * 2 / 1e9
    print(
        n,
        {k: f"{sorted(v)[3] * 1e3:.1f} ms ({gb / sorted(v)[3]:.0f} GB/s)" for k, v in res.items()},
        flush=True,
    )
