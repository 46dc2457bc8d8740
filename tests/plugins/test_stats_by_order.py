"""Statistics masked by sequence order (a link step's non-contiguous rows) == float64 brute force."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import attn_stats


@pytest.mark.parametrize("keys", [1, 9, 81])
@pytest.mark.parametrize("group", [1, 3])
def test_order_masked_stats_equal_brute_force(keys, group):
    g = torch.Generator().manual_seed(keys * 7 + group)
    b, hkv, q, d = 2, 2, 5, 8
    h = hkv * group
    qs = torch.randn(b, h, q, d, generator=g)
    ks = torch.randn(b, hkv, keys, d, generator=g)
    # each KV head holds its own shuffled tokens; the rows are a scattered selection of the sequence
    key_order = torch.stack(
        [torch.stack([torch.randperm(keys, generator=g) * 2 for _ in range(hkv)]) for _ in range(b)]
    )
    query_order = torch.randint(0, 2 * keys, (b, q), generator=g)
    lengths = torch.tensor([keys, max(keys - 2, 1)])
    rows = torch.rand(b, q, generator=g) > 0.3
    got = attn_stats(
        qs, ks, 0.5, query_rows=rows, causal=False, threshold=0.2, key_lengths=lengths,
        key_order=key_order, query_order=query_order,
    )  # fmt: skip
    col = torch.zeros(b, h, keys, dtype=torch.float64)
    below = torch.zeros(b, h, dtype=torch.long)
    visible = torch.zeros(b, h, dtype=torch.long)
    for bi in range(b):
        for hi in range(h):
            kv = hi // group
            for i in range(q):
                if not rows[bi, i]:
                    continue
                vis = (key_order[bi, kv] <= query_order[bi, i]) & (torch.arange(keys) < lengths[bi])
                if not vis.any():
                    continue
                s = (qs[bi, hi, i].double() @ ks[bi, kv].double().T) * 0.5
                p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
                col[bi, hi] += p
                below[bi, hi] += int(((p < 0.2 * p.max()) & vis).sum())
                visible[bi, hi] += int(vis.sum())
    torch.testing.assert_close(got.colsum.double(), col, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.visible, visible)
    assert (got.below - below).abs().max() <= 1  # float32 vs float64 at the cut
