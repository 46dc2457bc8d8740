"""Path (b) reference: rank-space attention over post-RoPE factors equals dense attention over the
reconstructed K/V (fp32/fp16/bf16, sizes hitting block edges, GQA, padded rows)."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins.lowrank_reference import lowrank_decode_attention
from vlkv.runtime.kv.lowrank import truncated_svd

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _dense_attention(q, k, v, mask):
    """``q (B, H, D)``, ``k, v (B, H_kv, N, D)``, ``mask (B, N)`` → ``(B, H, D)`` fp32."""
    b, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("bhd,bhnd->bhn", q.float(), kk) * d**-0.5
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1)
    return torch.einsum("bhn,bhnd->bhd", p, vv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("t", "s", "rank"), [(1, 1, 1), (9, 3, 4), (81, 17, 16), (729, 64, 64)])
def test_rank_space_attention_equals_dense_over_the_reconstruction(dtype, t, s, rank):
    g = torch.Generator().manual_seed(t * 7 + s)
    b, hkv, grp, d = 2, 2, 3, 16
    rows = torch.tensor([t, max(1, t - 5)])
    dense_len = torch.tensor([s, max(1, s // 2)])
    kbar, dk, vbar, dv = [], [], [], []
    for _ in range(b):
        mk, mv = torch.randn(t, hkv * d, generator=g), torch.randn(t, hkv * d, generator=g)
        a, ba = truncated_svd(mk, rank, exact=True)
        c, bc = truncated_svd(mv, rank, exact=True)
        r = a.shape[1]
        kbar.append(a), dk.append(ba), vbar.append(c), dv.append(bc)
    kbar, dk, vbar, dv = (torch.stack(x).to(dtype) for x in (kbar, dk, vbar, dv))
    q = torch.randn(b, hkv * grp, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    got = lowrank_decode_attention(q, kbar, dk, vbar, dv, rows, k, v, dense_len)
    # reference: materialise the factored rows (same stored values) and attend densely
    kr = (kbar.float() @ dk.float()).view(b, t, hkv, d).transpose(1, 2)
    vr = (vbar.float() @ dv.float()).view(b, t, hkv, d).transpose(1, 2)
    mask = torch.cat(
        [torch.arange(t)[None] < rows[:, None], torch.arange(s)[None] < dense_len[:, None]], dim=1
    )
    want = _dense_attention(q, torch.cat([kr, k.float()], 2), torch.cat([vr, v.float()], 2), mask)
    rtol, atol = TOL[dtype]
    assert got.dtype == dtype and r == min(rank, t, hkv * d)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)
