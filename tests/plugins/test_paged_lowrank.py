"""The paged low-rank read's split layout (``paged_lowrank.split_layout``: the factored span's own splits,
the kernel's cut) and byte count (``factored_read_bytes``): rank-masked factor rows plus one basis load
per (request, head, split) program that walks factored columns, against the dense entries those columns
would be; at the 7B models' shapes and the launcher's default split counts the read stays under half the
dense K/V (it loaded the bases once per split that met the span: 2.33x dense on Qwen2-VL-7B batch 1)."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins.paged_lowrank import (
    BASES_SHARE,
    PagedFactors,
    factored_chunk,
    factored_read_bytes,
    factored_span,
    split_layout,
    virtual_columns,
)
from vlkv.plugins.triton_selected_attention import default_num_splits, tile_sizes


def test_factored_columns_read_their_ranks_and_one_basis_a_program():
    # 2 requests, 2 KV heads, 4 columns; request 0 factors 3 column-heads (rows 0, 1, 1), request 1 one
    # column in head 1 only (row 2); the last column of request 1 is past its length (not read)
    frow = torch.tensor(
        [[[0, 1, -1, -1], [1, -1, -1, -1]], [[-1, -1, -1, 2], [-1, 2, -1, -1]]], dtype=torch.long
    )
    lengths = torch.tensor([[4, 4], [3, 3]])
    rk, rv, h, d = 8, 4, 2, 16
    f = PagedFactors(
        frow,
        torch.zeros(3, rk, dtype=torch.bfloat16),
        torch.zeros(2, rk, h * d, dtype=torch.bfloat16),
        torch.zeros(3, rv, dtype=torch.bfloat16),
        torch.zeros(2, rv, h * d, dtype=torch.bfloat16),
        torch.tensor([8, 2, 5]),
        torch.tensor([4, 1, 3]),
    )
    kernel, dense = factored_read_bytes(f, lengths, d, d)
    components = (8 + 4) + (2 + 1) + (2 + 1) + (5 + 3)  # rows 0, 1, 1 in request 0; row 2 in request 1
    programs = 3  # (0, 0), (0, 1), (1, 1)
    assert kernel == 2 * (components + programs * (rk * d + rv * d))
    assert dense == 2 * 4 * (d + d)
    # at scale the rows dominate: rank 64 for keys and values is half of a D = 128 entry's K + V per head
    # (counted per head: the 8 heads' programs each load the shared row)
    big = PagedFactors(
        torch.zeros(1, 8, 4096, dtype=torch.long),
        torch.zeros(1, 64),
        torch.zeros(1, 64, 8 * 128),
        torch.zeros(1, 64),
        torch.zeros(1, 64, 8 * 128),
        torch.tensor([64]),
        torch.tensor([64]),
    )
    kernel, dense = factored_read_bytes(big, torch.full((1, 8), 4096), 128, 128)
    assert dense == 4 * 8 * 4096 * 256 and kernel == 4 * 8 * (4096 * 128 + 64 * 256)
    assert 0.5 < kernel / dense < 0.52
    # four splits of a wholly factored row: the span takes three (one is left for the dense columns),
    # each loads the bases once; 4096 columns per split is far more than the chunk (256)
    kernel4, _ = factored_read_bytes(big, torch.full((1, 8), 4096), 128, 128, num_splits=4)
    assert factored_chunk(64, 64, 128, 128) == 256
    assert kernel4 == kernel + 4 * 8 * 2 * 64 * 256


def test_only_the_factored_spans_splits_load_the_bases():
    # one request, one head, 64 columns of which 10..19 are factored; a second request holds none. The
    # chunk (4·(4·8 + 2·8) / 16 = 12 columns) fits the span's 10 columns once: one split loads the bases
    frow = torch.full((2, 1, 64), -1, dtype=torch.long)
    frow[0, 0, 10:20] = torch.arange(10)
    lengths = torch.tensor([[64], [64]])
    f = PagedFactors(
        frow,
        torch.zeros(10, 4),
        torch.zeros(2, 4, 8),
        torch.zeros(10, 2),
        torch.zeros(2, 2, 8),
        torch.full((10,), 4),
        torch.full((10,), 2),
    )
    assert factored_span(f, lengths).tolist() == [[[10, 20]], [[64, 0]]]
    kernel, dense = factored_read_bytes(f, lengths, 8, 8, num_splits=4, block_n=16)
    assert kernel == 4 * (10 * (4 + 2) + 1 * (4 * 8 + 2 * 8))
    assert dense == 4 * 10 * 16
    # past the length nothing is factored: no program loads the bases
    none, _ = factored_read_bytes(f, torch.tensor([[10], [64]]), 8, 8, num_splits=4, block_n=16)
    assert none == 0


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 20, 64])
def test_the_layout_walks_every_column_once_and_only_the_spans_splits_meet_factors(num_splits):
    """Random spans (some rows none, some wholly factored) and lengths: the splits' virtual ranges tile
    ``[0, length)`` in order, mapped they are a permutation of the row's columns; the splits that load the
    bases walk the whole span and nothing else meets it; each such split averages at least ``chunk``
    columns where the span holds one, so the bases cost at most 1/BASES_SHARE of the span's dense bytes."""
    g = torch.Generator().manual_seed(num_splits)
    b, h, c, block_n, chunk = 5, 3, 300, 16, 24
    lengths = torch.randint(0, c + 1, (b, h), generator=g)
    lengths[0, 0], lengths[0, 1] = c, 0
    a = torch.randint(0, c, (b, h), generator=g)
    e = a + torch.randint(0, c, (b, h), generator=g)
    a[1, 0], e[1, 0] = 0, c  # wholly factored
    span = torch.stack([a, e], -1).to(torch.int32)
    span[2, 1] = torch.tensor([c, 0])  # no factored column
    splits_f, start, stop, holds = split_layout(span, lengths, num_splits, block_n, chunk)
    n = lengths.long()
    lo = torch.minimum(span[..., 0].long(), n)
    n_f = torch.minimum(torch.maximum(span[..., 1].long(), lo), n) - lo
    # a split rounded to block_n may leave the span's last one empty: it loads nothing
    assert bool((holds.sum(-1) <= splits_f).all()) and bool(((holds.sum(-1) > 0) == (n_f > 0)).all())
    assert bool((splits_f <= max(num_splits - 1, 1)).all())
    assert bool(((splits_f > 0) == (n_f > 0)).all())
    assert bool((splits_f * chunk <= n_f.clamp_min(chunk)).all())
    for i in range(b):
        for j in range(h):
            ranges = [torch.arange(int(s0), max(int(s0), int(s1))) for s0, s1 in zip(start[i, j], stop[i, j])]
            walked = [r for r in ranges if len(r)]
            virtual = torch.cat(walked) if walked else torch.zeros(0, dtype=torch.long)
            assert torch.equal(virtual, torch.arange(int(n[i, j])))  # in order, each once
            cols = virtual_columns(span[i, j], lengths[i, j], virtual)
            assert torch.equal(cols.sort().values, torch.arange(int(n[i, j])))
            for k in range(num_splits):
                mine = virtual_columns(span[i, j], lengths[i, j], ranges[k])
                meets = bool(((mine >= lo[i, j]) & (mine < lo[i, j] + n_f[i, j])).any())
                assert meets == bool(holds[i, j, k])
                if holds[i, j, k] and num_splits > 1:  # with one split it walks the dense columns too
                    assert bool(((mine >= lo[i, j]) & (mine < lo[i, j] + n_f[i, j])).all())


# (name, KV heads, query heads per KV head, D): LLaVA-1.5-7B (MHA), Qwen2-VL-7B (GQA 7)
SHAPES = [("llava-1.5-7b", 32, 1, 128), ("qwen2-vl-7b", 4, 7, 128)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_at_the_default_split_count_the_factored_read_stays_under_half_the_dense_bytes(shape, batch):
    """AttentionPack's defaults (576 image rows at columns 16..591 of 640, rank 64 for the top quarter,
    16 for the rest, keys too, fp16) at the launcher's split count (Qwen2-VL-7B batch 1: 20): the kernel
    loads at most half the dense K/V of those columns (the old cut, a basis load per split meeting the
    span, loaded 2.33x dense there; ``docs/benchmarks/2026-11-28-lowrank-splits-cpu-x86_64``)."""
    _, h, group, d = shape
    rows, cols = 576, 640
    ranks = torch.tensor([64] * (rows // 4) + [16] * (rows - rows // 4)).repeat(batch)
    frow = torch.full((batch, h, cols), -1, dtype=torch.long)
    for i in range(batch):
        frow[i, :, 16 : 16 + rows] = torch.arange(rows) + i * rows
    z = torch.zeros(batch * rows, 64, dtype=torch.float16)
    basis = torch.zeros(batch, 64, h * d, dtype=torch.float16)
    f = PagedFactors(frow, z, basis, z, basis, ranks, ranks)
    lengths = torch.full((batch, h), cols)
    block_m, block_n = tile_sizes(group, d, d)[:2]
    splits = default_num_splits(batch * h * -(-group // block_m), cols, block_n)
    assert splits == {(32, 1): 8, (32, 4): 2, (4, 1): 20, (4, 4): 16}[(h, batch)]
    kernel, dense = factored_read_bytes(f, lengths, d, d, splits, block_n)
    assert dense == batch * h * rows * 2 * d * 2
    assert kernel <= 0.5 * dense
    # the bases: at most 1/BASES_SHARE of the dense bytes (rows: 56 of 256 components a column)
    row_bytes = batch * h * int((2 * ranks[:rows]).sum()) * 2  # rank_k + rank_v components, fp16
    assert kernel - row_bytes <= dense / BASES_SHARE
