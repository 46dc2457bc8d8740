"""``ops.selected_row_stats`` (one decode row over each KV head's selected keys, A-VL's core step)
equals ``attn_stats_reference`` over the same keys (one call per KV head when their lengths differ, as
the runtime called it before), and reads nothing back."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import attn_stats_reference, selected_row_stats
from vlkv.runtime.op_count import count_ops


def _reference(q, k_sel, lengths, scale, rows, threshold):
    """Per KV head, the reference over its GQA group's query heads and that head's first lengths keys."""
    kv_heads, group = k_sel.shape[1], q.shape[1] // k_sel.shape[1]
    parts = [
        attn_stats_reference(
            q[:, j * group : (j + 1) * group],
            k_sel[:, j : j + 1],
            scale,
            query_rows=rows,
            causal=False,
            threshold=threshold,
            key_lengths=lengths[:, j],
        )
        for j in range(kv_heads)
    ]
    below = None if threshold is None else torch.cat([p.below for p in parts], 1)
    return torch.cat([p.colsum for p in parts], 1), below, torch.cat([p.visible for p in parts], 1)


@pytest.mark.parametrize("threshold", [None, 0.05])
@pytest.mark.parametrize("rows", ["all", "some"])
@pytest.mark.parametrize("lengths", ["uniform", "per-head", "an empty head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_selected_row_stats_equal_the_reference(lengths, rows, threshold, dtype):
    g = torch.Generator().manual_seed(7)
    b, kv_heads, group, width, dim = 3, 2, 3, 37, 16
    q = torch.randn(b, kv_heads * group, 1, dim, generator=g).to(dtype)
    k_sel = torch.randn(b, kv_heads, width, dim, generator=g).to(dtype)
    lens = {
        "uniform": torch.full((b, kv_heads), 29),
        "per-head": torch.tensor([[37, 11], [5, 20], [1, 37]]),
        "an empty head": torch.tensor([[0, 11], [5, 20], [30, 0]]),
    }[lengths]
    want_rows = None if rows == "all" else torch.tensor([[True], [False], [True]])
    with count_ops() as c:
        got = selected_row_stats(q, k_sel, lens, 0.25, query_rows=want_rows, threshold=threshold)
    assert c.syncs == 0, dict(c.kinds)
    colsum, below, visible = _reference(q, k_sel, lens, 0.25, want_rows, threshold)
    assert got.colsum.dtype == torch.float32 and got.colsum.shape == colsum.shape
    torch.testing.assert_close(got.colsum, colsum, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.visible, visible)
    if threshold is None:
        assert got.below is None
    else:
        # a probability within float rounding of the cut may count on one side or the other
        assert (got.below - below).abs().max() <= 1


def test_selected_row_stats_take_one_row():
    with pytest.raises(ValueError, match="one query row"):
        selected_row_stats(torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 3, 4), torch.ones(1, 1), 1.0)
