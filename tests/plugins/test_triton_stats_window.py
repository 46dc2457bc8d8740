"""The Triton statistics launcher cuts q to the requested window; results equal the reference."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import STATS_TOL, assert_close_tol
from vlkv.plugins.reference import attn_stats_reference

triton_attn_stats = pytest.importorskip("vlkv.plugins.triton_attn_stats", reason="triton is not installed")


def _window(lengths: torch.Tensor, queries: int, rows: torch.Tensor) -> torch.Tensor:
    """``(B, Q)`` bool: sample ``b``'s last ``rows[b]`` valid rows."""
    i = torch.arange(queries)[None, :]
    return (i >= (lengths - rows)[:, None]) & (i < lengths[:, None])


@pytest.mark.parametrize("queries", [9, 81])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_window_rows_equal_reference(queries, causal, dtype):
    torch.manual_seed(queries)
    b, h, hkv, d = 3, 4, 2, 16
    q = torch.randn(b, h, queries, d).to(dtype)
    k = torch.randn(b, hkv, queries + 7, d).to(dtype)
    lengths = torch.tensor([queries, queries - 3, queries - 1])
    # ragged windows; sample 2 asks for no row at all
    rows = _window(lengths, queries, torch.tensor([4, 2, 0]))
    args = dict(query_rows=rows, causal=causal, threshold=0.05, key_lengths=lengths + 7)
    for fused in (False, True):
        got = triton_attn_stats.attn_stats_triton(q, k, 0.25, **args, fused=fused)
        ref = attn_stats_reference(q, k, 0.25, **args)
        assert_close_tol(got.colsum, ref.colsum, STATS_TOL, dtype)
        torch.testing.assert_close(got.below, ref.below, rtol=0, atol=0)
        torch.testing.assert_close(got.visible, ref.visible, rtol=0, atol=0)


def test_compaction_keeps_only_the_window():
    q = torch.randn(2, 2, 100, 16)
    rows = _window(torch.tensor([100, 90]), 100, torch.tensor([5, 3])).to(torch.int8)
    qc, rc, off = triton_attn_stats.compact_rows(q, rows, torch.tensor([0, 0]))
    assert qc.shape == (2, 2, 5, 16) and off.tolist() == [95, 87]
    assert torch.equal(qc[0], q[0, :, 95:100]) and torch.equal(qc[1, :, :3], q[1, :, 87:90])
    assert rc.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    # a selection spread over most rows is left alone
    wide = torch.ones(2, 100, dtype=torch.int8)
    assert triton_attn_stats.compact_rows(q, wide, torch.tensor([0, 0]))[0] is q


def test_a_decode_row_is_not_compacted_and_reads_nothing_back():
    """One query row has nothing to cut: returned as it is, without a read back (a host sync per layer
    of a decode step's statistics on a GPU)."""
    from vlkv.runtime.op_count import count_ops

    q, off = torch.randn(3, 2, 1, 16), torch.tensor([7, 0, 3])
    for rows in (torch.ones(3, 1, dtype=torch.int8), torch.tensor([[1], [0], [1]], dtype=torch.int8)):
        with count_ops() as c:
            got = triton_attn_stats.compact_rows(q, rows, off)
        assert c.syncs == 0 and got[0] is q and got[1] is rows and got[2] is off
