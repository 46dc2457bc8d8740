"""The paged low-rank read's byte count (``paged_lowrank.factored_read_bytes``): rank-masked factor rows
plus one basis load per (request, head, split) program whose columns meet the row's factored span
(``factored_span``, the kernel's test), against the dense entries those columns would be."""

from __future__ import annotations

import torch

from vlkv.plugins.paged_lowrank import PagedFactors, factored_read_bytes, factored_span


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
    # four splits: every split of the 4096 columns meets the span, each loads the bases again
    kernel4, _ = factored_read_bytes(big, torch.full((1, 8), 4096), 128, 128, num_splits=4)
    assert kernel4 == kernel + 4 * 8 * 3 * 64 * 256


def test_only_splits_that_meet_the_factored_span_load_the_bases():
    # one request, one head, 64 columns of which 10..19 are factored; split by 4 (16 columns each): only
    # split 0 (0..15) and split 1 (16..31) meet the span; a second request holds none
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
    assert kernel == 4 * (10 * (4 + 2) + 2 * (4 * 8 + 2 * 8))
    assert dense == 4 * 10 * 16
    # past the length nothing is factored: no program loads the bases
    none, _ = factored_read_bytes(f, torch.tensor([[10], [64]]), 8, 8, num_splits=4, block_n=16)
    assert none == 0
