"""Bytes one decode layer's read loads for AttentionPack's factored image columns: the paged low-rank
kernel (``vlkv.plugins.paged_lowrank.factored_read_bytes``) against the same columns as dense pool entries,
and path (a)'s dense rebuild (written, then read by attention). Arithmetic on the tables, no timing.

One request of 640 columns: 16 text columns, the 576 image rows factored, 48 more text columns. The
bases are loaded by every (KV head, split) program whose columns meet the image (the kernel's test), so
the count depends on the launch's split count: 1, 4, and what ``default_num_splits`` picks for this one
request (8 on LLaVA's 32 KV heads, 20 on Qwen2-VL's 4; 1 and 4 at batch 16)."""

from __future__ import annotations

import json

import torch

from vlkv.plugins.paged_lowrank import PagedFactors, factored_read_bytes
from vlkv.plugins.triton_selected_attention import default_num_splits, tile_sizes

# (name, H_kv, D, image rows, rank, rank_lo, top_fraction, itemsize): AttentionPack's defaults (rank 64,
# rank_lo 16 for all but the top quarter, keys too) on LLaVA-1.5-7B (MHA: 32 KV heads) and Qwen2-VL-7B
# (GQA: 4 KV heads), 576 image rows, fp16; the tiny test model at the tests' rank 4
CONFIGS = [
    ("llava-1.5-7b", 32, 128, 576, 64, 16, 0.25, 2),
    ("qwen2-vl-7b", 4, 128, 576, 64, 16, 0.25, 2),
    ("tiny-llava", 2, 16, 576, 4, 1, 0.25, 4),
]
BEFORE, COLS = 16, 640  # the image's first column, the request's columns

for name, h, d, rows, rank, lo, top, item in CONFIGS:
    dtype = {2: torch.float16, 4: torch.float32}[item]
    hi = int(rows * top)
    ranks = torch.tensor([rank] * hi + [lo] * (rows - hi))
    frow = torch.full((1, h, COLS), -1, dtype=torch.long)
    frow[..., BEFORE : BEFORE + rows] = torch.arange(rows)
    f = PagedFactors(
        frow,
        torch.zeros(rows, rank, dtype=dtype),
        torch.zeros(1, rank, h * d, dtype=dtype),
        torch.zeros(rows, rank, dtype=dtype),
        torch.zeros(1, rank, h * d, dtype=dtype),
        ranks,
        ranks,
    )
    block_n = tile_sizes(1, d, d)[1]  # one query head a KV head's program: LLaVA's MHA; GQA tiles alike
    for splits in sorted({1, 4, default_num_splits(h, COLS, block_n)}):
        kernel, dense = factored_read_bytes(f, torch.full((1, h), COLS), d, d, splits, block_n)
        rebuild = 2 * dense  # path (a): the rebuilt K/V written into the dense copy, then read by attention
        print(
            json.dumps(
                {
                    "model": name,
                    "kv_heads": h,
                    "head_dim": d,
                    "image_rows": rows,
                    "columns": COLS,
                    "rank": rank,
                    "rank_lo": lo,
                    "num_splits": splits,
                    "block_n": block_n,
                    "kernel_bytes": kernel,
                    "dense_bytes": dense,
                    "kernel_over_dense": round(kernel / dense, 3),
                    "path_a_copy_bytes": rebuild,
                    "kernel_over_path_a": round(kernel / rebuild, 3),
                }
            )
        )
