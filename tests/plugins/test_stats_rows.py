"""Statistics over a window of rows: exact against brute force, and the work follows the rows asked for."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.test_reference import brute_stats
from vlkv.plugins.reference import attn_stats_reference


def _window(batch: int, queries: int, lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """``(B, Q)`` bool: each sample's last ``rows`` valid rows (a SnapKV observation window)."""
    i = torch.arange(queries)[None, :]
    return (i >= (lengths - rows)[:, None]) & (i < lengths[:, None])


@pytest.mark.parametrize("queries", [9, 81, 200])
@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("chunk_rows", [4, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_window_rows_match_brute_force(queries, rows, chunk_rows, causal):
    torch.manual_seed(queries * 1000 + rows)
    batch, heads, kv_heads, dim = 2, 6, 2, 16
    q, k = torch.randn(batch, heads, queries, dim), torch.randn(batch, kv_heads, queries, dim)
    # sample 1 is padded: its last rows and keys are not valid
    lengths = torch.tensor([queries, max(queries - 5, 1)])
    args = {
        "q": q,
        "k": k,
        "scale": dim**-0.5,
        "query_rows": _window(batch, queries, lengths, rows),
        "causal": causal,
        "threshold": 0.05,
        "key_lengths": lengths,
        "q_offset": torch.zeros(batch, dtype=torch.long),
    }
    got = attn_stats_reference(**args, chunk_rows=chunk_rows)
    colsum, below, visible = brute_stats(**args)
    torch.testing.assert_close(got.colsum, colsum.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.below, below, rtol=0, atol=0)
    torch.testing.assert_close(got.visible, visible, rtol=0, atol=0)


def test_unrequested_rows_are_never_computed(monkeypatch):
    """A 3-row window of a 300-row prompt multiplies 3 query rows (times the GQA group), not 300."""
    batch, heads, kv_heads, queries, dim = 2, 4, 2, 300, 8
    q, k = torch.randn(batch, heads, queries, dim), torch.randn(batch, kv_heads, queries, dim)
    lengths = torch.full((batch,), queries)
    seen: list[tuple[int, int]] = []
    bmm = torch.bmm

    def counting_bmm(a, b, *rest, **kw):
        seen.append((a.shape[1], b.shape[2]))  # (query rows x group, key columns)
        return bmm(a, b, *rest, **kw)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    attn_stats_reference(q, k, 0.3, query_rows=_window(batch, queries, lengths, 3), chunk_rows=256)
    group = heads // kv_heads
    assert sum(r for r, _ in seen) == batch * 3 * group
    # causal: the last rows see every key, and no key beyond them exists
    assert all(cols == queries for _, cols in seen)


def test_causal_chunks_skip_keys_no_row_sees(monkeypatch):
    """Every row, causal, 4 chunks of 64: chunk c multiplies only the 64·(c+1) keys its rows can see."""
    q, k = torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8)
    cols: list[int] = []
    bmm = torch.bmm

    def counting_bmm(a, b, *rest, **kw):
        cols.append(b.shape[2])
        return bmm(a, b, *rest, **kw)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    got = attn_stats_reference(q, k, 0.3, chunk_rows=64)
    assert cols == [64, 128, 192, 256]
    # each of the 256 rows is a distribution over what it sees
    torch.testing.assert_close(got.colsum.sum(-1), torch.full((1, 2), 256.0), rtol=1e-5, atol=1e-3)
