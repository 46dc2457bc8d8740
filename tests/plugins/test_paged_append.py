"""The fused decode append-and-read (``paged_append``) against its reference: the pool write, then the
paged read (``paged_attention_reference``).

What must hold: after the call the pools hold exactly what ``KVPool.write`` would have written (bytes
equal, pre-RoPE flags cleared at the new slots, nothing else touched); the output equals the reference
read of the same tables (holes skipped, each request its own length, strided tables of several caches)
within fp32 rounding; the entries attended are the live entries; the probabilities equal the
reference softmax at each live column; bad arguments are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import paged_append
from vlkv.plugins.paged_reference import paged_attention_reference

# the kernel sums in another order than the reference's matmuls (fp32 rounding only)
TOL = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def built():
    if paged_append.kernel() is None:
        pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")


def _case(caches=(2, 1), kv_heads=2, group=3, dim=64, cap=40, slots=300, holes=False, seed=0):
    """Caches of ``caches`` requests each (own tables, capacity ``cap`` columns, so rows are strided
    views when sliced), their lengths before the append, fresh slots for the new rows, a pool."""
    g = torch.Generator().manual_seed(seed)
    b = sum(caches)
    k_pool = torch.randn(kv_heads, slots, dim, generator=g)
    v_pool = torch.randn(kv_heads, slots, dim, generator=g)
    perm = torch.randperm(slots, generator=g)
    past = torch.randint(1, cap - 1, (b,), generator=g)
    tables, hole_tables, used = [], [], 0
    for n in caches:
        t = torch.zeros(n, kv_heads, cap, dtype=torch.long)
        h = torch.zeros(n, kv_heads, cap, dtype=torch.bool)
        for i in range(n):
            for j in range(kv_heads):  # each head its own slots (per-head tables)
                m = int(past[used + i])
                t[i, j, :m] = perm[(used + i) * cap * kv_heads + j * cap :][:m] % slots
            if holes:
                h[i, :, : int(past[used + i])] = torch.rand(kv_heads, int(past[used + i]), generator=g) < 0.3
        tables.append(t)
        hole_tables.append(h if holes else torch.empty(0, dtype=torch.bool))
        used += n
    # fresh slots: ones no table names (the pool's free stack)
    taken = torch.cat([t.flatten() for t in tables]).unique()
    free = torch.tensor([s for s in range(slots) if s not in set(taken.tolist())])
    ids = free[: kv_heads * b].view(kv_heads, b)
    q = torch.randn(b, kv_heads, group, dim, generator=g)
    k_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    v_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    at = 0
    for t in tables:  # the new column, written by the append before the call
        for i in range(t.shape[0]):
            t[i, :, int(past[at])] = ids[:, at]
            at += 1
    return q, k_new, v_new, k_pool, v_pool, ids, tables, hole_tables, past + 1


def _reference(q, k_new, v_new, k_pool, v_pool, ids, tables, holes, lengths, scale):
    kp, vp = k_pool.clone(), v_pool.clone()
    heads = torch.arange(kp.shape[0])[:, None]
    kp[heads, ids] = k_new[:, :, 0].transpose(0, 1)
    vp[heads, ids] = v_new[:, :, 0].transpose(0, 1)
    table = torch.cat(tables)
    if holes[0].numel():
        table = table.masked_fill(torch.cat(holes), -1)
    b, kv_heads, group, dim = q.shape
    wide = lengths[:, None].expand(b, kv_heads)
    out = paged_attention_reference(q.reshape(b, kv_heads * group, 1, dim), kp, vp, table, wide, scale)
    return kp, vp, out.reshape(b, 1, kv_heads * group, dim), table


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
@pytest.mark.parametrize("dim,group", [(64, 3), (128, 1), (48, 5)])
def test_the_write_and_the_read_equal_the_reference(holes, dim, group):
    q, k_new, v_new, k_pool, v_pool, ids, tables, hole_tables, lengths = _case(
        dim=dim, group=group, holes=holes
    )
    scale = dim**-0.5
    kp, vp, want, table = _reference(
        q, k_new, v_new, k_pool, v_pool, ids, tables, hole_tables, lengths, scale
    )
    prerope = torch.ones(k_pool.shape[:2], dtype=torch.bool)
    out, attended = paged_append.append_attend(
        q, k_new, v_new, k_pool, v_pool, prerope, ids, tables, hole_tables, lengths, scale
    )
    assert torch.equal(k_pool, kp) and torch.equal(v_pool, vp)  # the new rows, bytes equal; nothing else
    cleared = torch.zeros_like(prerope)
    cleared[torch.arange(ids.shape[0])[:, None], ids] = True
    assert torch.equal(prerope, ~cleared)  # the new slots' pre-RoPE flags cleared, no other
    torch.testing.assert_close(out, want, **TOL)
    held = (table >= 0) & (torch.arange(table.shape[2]) < lengths[:, None, None])
    assert torch.equal(attended, held.double().sum(2).mean(1))


def test_strided_views_and_broadcast_ids_are_read_as_they_lie():
    """The caches' tables as views (a column slice of a wider table), ids broadcast over heads (a run's
    next slot, the same in every head) and a transposed q: the same result as contiguous copies."""
    q, k_new, v_new, k_pool, v_pool, _, tables, holes, lengths = _case(caches=(3,), kv_heads=2)
    wide = torch.zeros(3, 2, 64, dtype=torch.long)
    wide[:, :, :40] = tables[0]
    b = q.shape[0]
    ids = torch.arange(290, 290 + b)
    for i in range(b):
        wide[i, :, int(lengths[i]) - 1] = ids[i]
    view = wide[:, :, :50]
    scale = 0.125
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # (B, H, G, D) with non-default strides
    args = (k_new, v_new)
    ref = _reference(
        q, *args, k_pool, v_pool, ids[None].expand(2, b), [view.contiguous()], holes, lengths, scale
    )
    out, _ = paged_append.append_attend(
        qt, *args, k_pool, v_pool, torch.zeros(2, 300, dtype=torch.bool), ids[None].expand(2, b), [view], holes,
        lengths, scale,
    )  # fmt: skip
    torch.testing.assert_close(out, ref[2], **TOL)


def test_probabilities_are_the_softmax_at_each_live_column():
    q, k_new, v_new, k_pool, v_pool, ids, tables, holes, lengths = _case(holes=True)
    scale = 0.125
    table = _reference(q, k_new, v_new, k_pool, v_pool, ids, tables, holes, lengths, scale)[3]
    width = int(lengths.max())
    prerope = torch.zeros(k_pool.shape[:2], dtype=torch.bool)
    out, attended, probs, counts = paged_append.append_attend(
        q, k_new, v_new, k_pool, v_pool, prerope, ids, tables, holes, lengths, scale, probs_width=width
    )
    b, kv_heads, group, dim = q.shape
    held = (table[:, :, :width] >= 0) & (torch.arange(width) < lengths[:, None, None])
    keys = k_pool[torch.arange(kv_heads)[None, :, None], table[:, :, :width].clamp_min(0)]  # (B, H, W, D)
    scores = torch.einsum("bhgd,bhwd->bhgw", q * scale, keys).masked_fill(~held[:, :, None], float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(scores, -1).nan_to_num(0.0), **TOL)
    assert torch.equal(counts, held.sum(2))


def test_bad_arguments_are_refused_in_one_line():
    q, k_new, v_new, k_pool, v_pool, ids, tables, holes, lengths = _case()
    prerope = torch.zeros(k_pool.shape[:2], dtype=torch.bool)
    bad = ids.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="new slot 10000 out of the pool"):
        paged_append.append_attend(q, k_new, v_new, k_pool, v_pool, prerope, bad, tables, holes, lengths, 1.0)
    with pytest.raises(RuntimeError, match="the tables hold 2 requests, q 3"):
        paged_append.append_attend(
            q, k_new, v_new, k_pool, v_pool, prerope, ids, tables[:1], holes[:1], lengths, 1.0
        )
    with pytest.raises(RuntimeError, match="float32"):
        paged_append.append_attend(
            q.double(), k_new, v_new, k_pool, v_pool, prerope, ids, tables, holes, lengths, 1.0
        )
