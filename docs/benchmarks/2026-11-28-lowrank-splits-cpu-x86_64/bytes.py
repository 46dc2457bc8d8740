"""Bytes one decode layer's paged low-rank read loads for AttentionPack's factored image columns, before
and after the factored span got its own splits (issue #28), against the same columns as dense pool
entries. Arithmetic on the tables, no timing.

Before (commit 27cdd47): a row's columns cut in ``num_splits`` contiguous ``block_n``-rounded pieces;
every piece that meets the factored span loads the request's basis slices for the head. After
(``vlkv.plugins.paged_lowrank.split_layout``, the kernel's cut): the span gets ``⌊span / chunk⌋`` splits
(at least 1, at most ``num_splits − 1``), ``chunk = factored_chunk(...)`` columns each at least, and only
they load the bases; the other splits take the dense columns.

Each request: 16 text columns, 576 image rows factored (AttentionPack's defaults: rank 64 for the top
quarter of rows by importance, 16 for the rest, keys too), then text; fp16. Batch 4's requests hold 640,
800, 1200 and 2000 columns (longer conversations after the image). The split count is the launcher's
(``default_num_splits``, about 256 programs), besides 1 and 4. Also per (request, KV head): the programs
that walk any column, and the most columns one program walks (its loop length: the read's critical
path).

Path (b) (post-RoPE factors, ``PagedFactors.post_rope``): the same rows and basis slices, so the same
bytes (counted again with every request flagged); what changes is the key side's tile products, counted
per factored tile (a tile of ``block_n`` columns inside the span) of the programs that hold the span:
path (a) rebuilds the keys, ``block_n·BLOCK_R·BLOCK_D`` twice (the key and its rotate-half partner),
path (b) takes the logits in the rank space, ``BLOCK_M·BLOCK_R·block_n`` a tile plus the query's
projection ``BLOCK_M·BLOCK_D·BLOCK_R`` once a program (tile sides padded as ``tl.dot`` runs them; the
dense ``q·kᵀ`` and the values' products are the same in both)."""

from __future__ import annotations

import dataclasses
import json

import torch

from vlkv.plugins.paged_lowrank import (
    PagedFactors,
    factored_chunk,
    factored_columns,
    factored_read_bytes,
    factored_span,
    split_layout,
)
from vlkv.plugins.triton_selected_attention import default_num_splits, tile_sizes

# (name, H_kv, query heads per KV head, D): LLaVA-1.5-7B (MHA) and Qwen2-VL-7B (GQA 7)
MODELS = [("llava-1.5-7b", 32, 1, 128), ("qwen2-vl-7b", 4, 7, 128)]
BATCHES = {1: [640], 4: [640, 800, 1200, 2000]}
BEFORE, ROWS, RANK, RANK_LO, TOP, ITEM = 16, 576, 64, 16, 0.25, 2


def before_bytes(f: PagedFactors, lengths: torch.Tensor, d: int, splits: int, block_n: int) -> int:
    """The kernel's bytes under the old contiguous cut (every split meeting the span loads the bases)."""
    fac = factored_columns(f, lengths)
    rows = f.frow[fac]
    components = int((f.rank_k[rows] + f.rank_v[rows]).sum())
    n = lengths.long()[..., None]
    per = ((n + splits - 1) // splits + block_n - 1) // block_n * block_n
    start = torch.arange(splits) * per
    stop = torch.minimum(start + per, n)
    span = factored_span(f, lengths).long()
    programs = int(((span[..., :1] < stop) & (span[..., 1:] > start)).sum())
    rank_k, rank_v = f.ranks
    return (components + programs * (rank_k * d + rank_v * d)) * ITEM


def occupancy(lengths: torch.Tensor, span: torch.Tensor, splits: int, block_n: int, chunk: int | None):
    """``(busy, longest)``: programs per (request, head) that walk a column, summed; the most columns one
    walks. ``chunk`` None: the old contiguous cut."""
    if chunk is None:
        n = lengths.long()[..., None]
        per = ((n + splits - 1) // splits + block_n - 1) // block_n * block_n
        start = torch.arange(splits) * per
        stop = torch.minimum(start + per, n)
    else:
        _, start, stop, _ = split_layout(span, lengths, splits, block_n, chunk)
    walked = (stop - start).clamp_min(0)
    return int((walked > 0).sum()), int(walked.max())


def key_products(
    span: torch.Tensor, lengths: torch.Tensor, splits: int, tiles: tuple, chunk: int, rank: int
) -> tuple[int, int]:
    """``(path_a, path_b)``: the key side's multiply-adds of one layer's factored tiles (module docstring)."""
    block_m, block_n, block_d = tiles[:3]
    block_r = max(16, 1 << (rank - 1).bit_length())
    _, start, stop, holds = split_layout(span, lengths, splits, block_n, chunk)
    n_f = (span[..., 1] - span[..., 0]).long().clamp_min(0)[..., None]
    walked = (torch.minimum(stop, n_f) - start).clamp_min(0)
    n_tiles = int(torch.where(holds, -(-walked // block_n), 0).sum())
    path_a = n_tiles * 2 * block_n * block_r * block_d
    path_b = n_tiles * block_m * block_r * block_n + int(holds.sum()) * block_m * block_d * block_r
    return path_a, path_b


def main() -> None:
    for name, h, group, d in MODELS:
        for batch, cols in BATCHES.items():
            c = max(cols)
            hi = int(ROWS * TOP)
            ranks = torch.tensor([RANK] * hi + [RANK_LO] * (ROWS - hi))
            frow = torch.full((batch, h, c), -1, dtype=torch.long)
            for i in range(batch):
                frow[i, :, BEFORE : BEFORE + ROWS] = torch.arange(ROWS) + i * ROWS
            lengths = torch.tensor(cols)[:, None].expand(batch, h).contiguous()
            f = PagedFactors(
                frow,
                torch.zeros(batch * ROWS, RANK, dtype=torch.float16),
                torch.zeros(batch, RANK, h * d, dtype=torch.float16),
                torch.zeros(batch * ROWS, RANK, dtype=torch.float16),
                torch.zeros(batch, RANK, h * d, dtype=torch.float16),
                ranks.repeat(batch),
                ranks.repeat(batch),
            )
            block_m, block_n = tile_sizes(group, d, d)[:2]
            grid_m = -(-group // block_m)
            default = default_num_splits(batch * h * grid_m, c, block_n)
            span = factored_span(f, lengths)
            chunk = factored_chunk(RANK, RANK, d, d)
            post = dataclasses.replace(f, post_rope=torch.ones(batch, dtype=torch.bool))
            tiles = tile_sizes(group, d, d)
            for splits in sorted({1, 4, default}):
                after, dense = factored_read_bytes(f, lengths, d, d, splits, block_n)
                path_b, _ = factored_read_bytes(post, lengths, d, d, splits, block_n)
                macs_a, macs_b = key_products(span, lengths, splits, tiles, chunk, RANK)
                before = before_bytes(f, lengths, d, splits, block_n)
                busy_b, long_b = occupancy(lengths, span, splits, block_n, None)
                busy_a, long_a = occupancy(lengths, span, splits, block_n, chunk)
                row = {
                    "model": name, "kv_heads": h, "group": group, "head_dim": d, "batch": batch,
                    "columns": cols, "num_splits": splits, "default_splits": splits == default,
                    "block_n": block_n, "chunk": chunk, "dense_bytes": dense,
                    "before_bytes": before, "before_over_dense": round(before / dense, 3),
                    "after_bytes": after, "after_over_dense": round(after / dense, 3),
                    "busy_programs_before": busy_b, "busy_programs_after": busy_a,
                    "longest_program_columns_before": long_b, "longest_program_columns_after": long_a,
                    "path_b_bytes": path_b, "key_macs_path_a": macs_a, "key_macs_path_b": macs_b,
                    "key_macs_b_over_a": round(macs_b / max(macs_a, 1), 4),
                }  # fmt: skip
                print(json.dumps(row))


if __name__ == "__main__":
    main()
