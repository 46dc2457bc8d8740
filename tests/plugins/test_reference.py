"""The PyTorch references against eager brute force (full masked matrices in float64, explicit loops)."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import BIG_STATS_CASE, MERGE_CASES, SELECT_CASES, STATS_CASES, StatsCase
from vlkv.plugins.reference import attn_stats_reference, merge_kv_reference, selected_attention_reference


def brute_stats(q, k, scale, query_rows=None, causal=True, threshold=None, key_lengths=None, q_offset=None):
    """colsum (B, H, S), below (B, H), visible (B, H) from the whole (Q, S) probability matrix per head."""
    batch, heads, num_q, _ = q.shape
    kv_heads, num_k = k.shape[1], k.shape[2]
    colsum = torch.zeros(batch, heads, num_k, dtype=torch.float64)
    below = torch.zeros(batch, heads, dtype=torch.int64)
    visible = torch.zeros(batch, heads, dtype=torch.int64)
    for b in range(batch):
        length = num_k if key_lengths is None else int(key_lengths[b])
        offset = length - num_q if q_offset is None else int(q_offset[b])
        rows = torch.ones(num_q, dtype=torch.bool) if query_rows is None else query_rows[b]
        i = torch.arange(num_q)[:, None]
        j = torch.arange(num_k)[None, :]
        vis = (j < length) & rows[:, None]
        if causal:
            vis &= j <= offset + i
        for h in range(heads):
            scores = q[b, h].double() @ k[b, h // (heads // kv_heads)].double().T * scale
            probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)
            colsum[b, h] = probs.sum(0)
            visible[b, h] = vis.sum()
            if threshold is not None:
                below[b, h] = ((probs < threshold * probs.amax(-1, keepdim=True)) & vis).sum()
    return colsum, below, visible


@pytest.mark.parametrize("case", [*STATS_CASES, BIG_STATS_CASE], ids=repr)
@pytest.mark.parametrize("chunk_rows", [3, 256])
def test_attn_stats_reference_matches_brute_force(case: StatsCase, chunk_rows: int):
    args = case.make(torch.float32)
    got = attn_stats_reference(**args, chunk_rows=chunk_rows)
    colsum, below, visible = brute_stats(**args)
    torch.testing.assert_close(got.colsum, colsum.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.below, below, rtol=0, atol=0)
    torch.testing.assert_close(got.visible, visible, rtol=0, atol=0)
    # Each included row with a visible key is a distribution, so the column sums add up to that row count.
    assert got.colsum.dtype == torch.float32 and got.colsum.shape == (case.batch, case.heads, case.keys)


def test_attn_stats_reference_empty_rows_and_no_threshold():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    # Sample 1 has two padded keys and an offset that leaves its first row with nothing visible.
    lengths, offset = torch.tensor([5, 3]), torch.tensor([2, -1])
    got = attn_stats_reference(q, k, 0.5, key_lengths=lengths, q_offset=offset)
    assert got.below is None
    torch.testing.assert_close(got.colsum.sum(-1)[0], torch.full((4,), 3.0))
    torch.testing.assert_close(got.colsum.sum(-1)[1], torch.full((4,), 2.0))  # row 0 sees nothing
    assert torch.all(got.colsum[1, :, 3:] == 0)
    assert got.visible.tolist() == [[3 + 4 + 5] * 4, [0 + 1 + 2] * 4]


def test_attn_stats_reference_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attn_stats_reference(torch.randn(1, 3, 2, 8), torch.randn(1, 2, 4, 8), 1.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        attn_stats_reference(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 4, 8), 1.0, chunk_rows=0)


@pytest.mark.parametrize("case", SELECT_CASES, ids=repr)
def test_selected_attention_reference_matches_loops(case):
    args = case.make(torch.float32)
    got = selected_attention_reference(**args)
    q, k, v, idx, lengths = args["q"], args["k"], args["v"], args["indices"], args["lengths"]
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            n = int(lengths[b, h // group])
            slots = idx[b, h // group, :n]
            if n == 0:
                expected = torch.zeros_like(q[b, h])
            else:
                probs = torch.softmax(
                    q[b, h].double() @ k[b, h // group, slots].double().T * args["scale"], -1
                )
                expected = (probs @ v[b, h // group, slots].double()).float()
            torch.testing.assert_close(got[b, h], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", MERGE_CASES, ids=repr)
def test_merge_kv_reference_matches_loops(case):
    args = case.make(torch.float32)
    k_out, v_out = merge_kv_reference(**args)
    assign = args["assign"]
    for b in range(assign.shape[0]):
        for h in range(assign.shape[1]):
            for t in range(args["counts"].shape[-1]):
                src = (assign[b, h] == t).nonzero().flatten()
                for x, out in ((args["k"], k_out), (args["v"], v_out)):
                    expected = x[b, h, src].mean(0) if len(src) else torch.zeros(x.shape[-1])
                    torch.testing.assert_close(out[b, h, t], expected, rtol=1e-6, atol=1e-6)


def test_merge_kv_reference_keeps_dtype_and_checks_shape():
    k = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    k_out, v_out = merge_kv_reference(k, k, torch.tensor([[[0, 0, 1, -1]]]), torch.tensor([[[2, 1]]]))
    assert k_out.dtype == v_out.dtype == torch.float16 and k_out.shape == (1, 1, 2, 8)
    torch.testing.assert_close(k_out[0, 0, 0], ((k[0, 0, 0].float() + k[0, 0, 1].float()) / 2).half())
    with pytest.raises(ValueError, match="assign"):
        merge_kv_reference(
            k, k, torch.zeros(1, 1, 3, dtype=torch.int64), torch.ones(1, 1, 2, dtype=torch.int64)
        )
