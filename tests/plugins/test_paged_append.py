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
from vlkv.plugins.paged_append import NewColumns
from vlkv.plugins.paged_reference import paged_attention_reference

# the kernel sums in another order than the reference's matmuls (fp32 rounding only)
TOL = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def built():
    if paged_append.kernel() is None:
        pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")


def _case(caches=(2, 1), kv_heads=2, group=3, dim=64, cap=40, slots=300, holes=False, seed=0):
    """Caches of ``caches`` requests each (own tables of ``cap`` columns), their lengths before the
    append, fresh slots for the new entries, what the new column gets, a pool."""
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
            m = int(past[used + i])
            for j in range(kv_heads):  # each head its own slots (per-head tables)
                t[i, j, :m] = perm[(used + i) * cap * kv_heads + j * cap :][:m] % slots
            if holes:
                h[i, :, :m] = torch.rand(kv_heads, m, generator=g) < 0.3
        tables.append(t)
        hole_tables.append(h if holes else torch.empty(0, dtype=torch.bool))
        used += n
    taken = set(torch.cat([t.flatten() for t in tables]).tolist())
    free = torch.tensor([s for s in range(slots) if s not in taken])  # the pool's free slots
    ids = free[: kv_heads * b].view(kv_heads, b)
    q = torch.randn(b, kv_heads, group, dim, generator=g)
    k_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    v_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    columns = NewColumns(
        [torch.randint(0, 99, (*t.shape, 3), generator=g) for t in tables],
        [torch.randint(0, 4, t.shape, generator=g).to(torch.int8) for t in tables],
        [torch.randint(0, 99, t.shape, generator=g) for t in tables],
        past,
        torch.randint(100, 200, (b, 3), generator=g),
        torch.full((b,), 3, dtype=torch.int8),
        torch.randint(100, 200, (b,), generator=g),
    )
    return q, k_new, v_new, k_pool, v_pool, ids, tables, hole_tables, columns, past + 1


def _write_columns(tables, holes, columns, ids):
    """The reference append's table writes: each request's new column, into copies."""
    c = columns
    out = [[t.clone() for t in ts] for ts in (tables, holes, c.positions, c.modality, c.order)]
    at = 0
    for j, t in enumerate(tables):
        for i in range(t.shape[0]):
            col = int(c.cols[at])
            out[0][j][i, :, col] = ids[:, at]
            if out[1][j].numel():
                out[1][j][i, :, col] = False
            out[2][j][i, :, col] = c.pos_new[at]
            out[3][j][i, :, col] = c.mod_new[at]
            out[4][j][i, :, col] = c.ord_new[at]
            at += 1
    return out


def _reference(case, scale):
    """The pool write, the tables' column writes, then ``paged_attention_reference``: the pools after
    the write, the output ``(B, 1, H, D)``, the tables after and the read's ``(B, H_kv, C)`` table."""
    q, k_new, v_new, k_pool, v_pool, ids, tables, holes, columns, lengths = case
    after = _write_columns(tables, holes, columns, ids)
    kp, vp = k_pool.clone(), v_pool.clone()
    heads = torch.arange(kp.shape[0])[:, None]
    kp[heads, ids] = k_new[:, :, 0].transpose(0, 1)
    vp[heads, ids] = v_new[:, :, 0].transpose(0, 1)
    table = torch.cat(after[0])
    if after[1][0].numel():
        table = table.masked_fill(torch.cat(after[1]), -1)
    b, kv_heads, group, dim = q.shape
    wide = lengths[:, None].expand(b, kv_heads)
    out = paged_attention_reference(q.reshape(b, kv_heads * group, 1, dim), kp, vp, table, wide, scale)
    return kp, vp, out.reshape(b, 1, kv_heads * group, dim), after, table


def _call(case, scale, prerope=None, **kw):
    q, k_new, v_new, k_pool, v_pool, ids, tables, holes, columns, lengths = case
    if prerope is None:
        prerope = torch.zeros(k_pool.shape[:2], dtype=torch.bool)
    return paged_append.append_attend(
        q, k_new, v_new, k_pool, v_pool, prerope, ids, tables, holes, columns, lengths, scale, **kw
    )


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
@pytest.mark.parametrize("dim,group", [(64, 3), (128, 1), (48, 5)])
def test_the_writes_and_the_read_equal_the_reference(holes, dim, group):
    case = _case(dim=dim, group=group, holes=holes)
    scale = dim**-0.5
    kp, vp, want, after, table = _reference(case, scale)
    _, _, _, k_pool, v_pool, ids, tables, hole_tables, c, lengths = case
    prerope = torch.ones(k_pool.shape[:2], dtype=torch.bool)
    out, attended = _call(case, scale, prerope)
    assert torch.equal(k_pool, kp) and torch.equal(v_pool, vp)  # the new rows, bytes equal; nothing else
    for want_ts, got_ts in zip(after, (tables, hole_tables, c.positions, c.modality, c.order)):
        for w, got in zip(want_ts, got_ts):
            assert torch.equal(w, got)  # each table's new column written, nothing else touched
    cleared = torch.zeros_like(prerope)
    cleared[torch.arange(ids.shape[0])[:, None], ids] = True
    assert torch.equal(prerope, ~cleared)  # the new slots' pre-RoPE flags cleared, no other
    torch.testing.assert_close(out, want, **TOL)
    held = (table >= 0) & (torch.arange(table.shape[2]) < lengths[:, None, None])
    assert torch.equal(attended, held.double().sum(2).mean(1))


def test_strided_views_and_broadcast_ids_are_read_as_they_lie():
    """The caches' tables as views (a column slice of wider tables), ids broadcast over heads (a run's
    next slot, the same in every head) and a q with other strides: the same result as contiguous
    copies."""
    case = list(_case(caches=(3,), kv_heads=2))
    b = case[0].shape[0]
    case[5] = torch.arange(290, 290 + b)[None].expand(2, b)
    ref_case = list(case)
    c = case[8]
    wide = [
        torch.zeros(3, 2, 64, *t.shape[3:], dtype=t.dtype)
        for t in (case[6][0], c.positions[0], c.modality[0], c.order[0])
    ]
    for w, t in zip(wide, (case[6][0], c.positions[0], c.modality[0], c.order[0])):
        w[:, :, :40] = t
    views = [w[:, :, :50] for w in wide]
    ref_case[6] = [views[0].contiguous()]
    ref_case[8] = NewColumns(
        [views[1].contiguous()], [views[2].contiguous()], [views[3].contiguous()], *list(vars(c).values())[3:]
    )
    want = _reference(tuple(ref_case), 0.125)[2]
    case[0] = case[0].transpose(0, 1).contiguous().transpose(0, 1)
    case[6] = [views[0]]
    case[8] = NewColumns([views[1]], [views[2]], [views[3]], *list(vars(c).values())[3:])
    out, _ = _call(tuple(case), 0.125)
    torch.testing.assert_close(out, want, **TOL)
    assert torch.equal(views[0], _write_columns(ref_case[6], ref_case[7], ref_case[8], case[5])[0][0])


def test_probabilities_are_the_softmax_at_each_live_column():
    case = _case(holes=True)
    scale = 0.125
    _, _, want, _, table = _reference(case, scale)
    q, k_pool, lengths = case[0], case[3], case[9]
    width = int(lengths.max())
    out, attended, probs, live = _call(case, scale, probs_width=width)
    b, kv_heads, group, dim = q.shape
    held = (table[:, :, :width] >= 0) & (torch.arange(width) < lengths[:, None, None])
    keys = k_pool[torch.arange(kv_heads)[None, :, None], table[:, :, :width].clamp_min(0)]  # (B, H, W, D)
    scores = torch.einsum("bhgd,bhwd->bhgw", q * scale, keys).masked_fill(~held[:, :, None], float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(scores, -1).nan_to_num(0.0), **TOL)
    assert torch.equal(live, held)
    torch.testing.assert_close(out, want, **TOL)


def test_bad_arguments_are_refused_in_one_line():
    case = list(_case())
    bad = case[5].clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="new slot 10000 out of the pool"):
        _call(tuple(case[:5] + [bad] + case[6:]), 1.0)
    c = case[8]
    with pytest.raises(RuntimeError, match="the tables hold 2 requests, q 3"):
        one = NewColumns(
            c.positions[:1], c.modality[:1], c.order[:1], c.cols, c.pos_new, c.mod_new, c.ord_new
        )
        _call(tuple(case[:6] + [case[6][:1], case[7][:1], one, case[9]]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        _call(tuple([case[0].double()] + case[1:]), 1.0)
    far = NewColumns(c.positions, c.modality, c.order, c.cols + 100, c.pos_new, c.mod_new, c.ord_new)
    with pytest.raises(RuntimeError, match="column .* outside request 0"):
        _call(tuple(case[:8] + [far, case[9]]), 1.0)
    # a strided cols (the same values) would be read through its raw pointer: refused, nothing written
    strided = torch.stack([c.cols, c.cols], 1)[:, 0]
    assert torch.equal(strided, c.cols) and not strided.is_contiguous()
    pools = [case[3].clone(), case[4].clone()]
    loose = NewColumns(c.positions, c.modality, c.order, strided, c.pos_new, c.mod_new, c.ord_new)
    with pytest.raises(RuntimeError, match="contiguous pools, prerope, lengths and cols"):
        _call(tuple(case[:8] + [loose, case[9]]), 1.0)
    assert torch.equal(case[3], pools[0]) and torch.equal(case[4], pools[1])
    with pytest.raises(ValueError, match="pos_new: one row per request"):
        NewColumns(c.positions, c.modality, c.order, c.cols, c.pos_new[:1], c.mod_new, c.ord_new)


def test_the_score_tables_new_column_is_zeroed_and_nothing_else_of_them():
    """A statistics policy's running scores (the reservation no longer zeroes them on this path): each
    cache's score tables get 0 at each of its requests' new column, every head; the rest untouched, the
    output as without them; a score table not shaped like its slot table is refused before any write."""
    case = list(_case(caches=(2, 1)))
    c, tables = case[8], case[6]
    g = torch.Generator().manual_seed(4)
    scores = [[torch.rand(t.shape, generator=g) + 1 for _ in range(n)] for t, n in zip(tables, (2, 1))]
    before = [[x.clone() for x in per] for per in scores]
    plain = _call(tuple(case), 0.125)[0]
    case = list(_case(caches=(2, 1)))
    case[8] = NewColumns(*list(vars(c).values())[:7], scores)
    got = _call(tuple(case), 0.125)[0]
    assert torch.equal(got, plain)
    at = 0
    for t, per, old in zip(tables, scores, before):
        for i in range(t.shape[0]):
            for x in old:
                x[i, :, int(c.cols[at])] = 0
            at += 1
        assert all(torch.equal(x, o) for x, o in zip(per, old))
    assert all((x != 1).any() for per in before for x in per)  # something was zeroed
    bad = [[torch.ones(1, 2, 3)], []]
    pools = [case[3].clone(), case[4].clone()]
    with pytest.raises(RuntimeError, match="score table 0 must be float32 on the CPU, shaped like"):
        _call(tuple(case[:8] + [NewColumns(*list(vars(c).values())[:7], bad), case[9]]), 1.0)
    assert torch.equal(case[3], pools[0]) and torch.equal(case[4], pools[1])
    with pytest.raises(ValueError, match="scores: one list of score tables per cache"):
        NewColumns(*list(vars(c).values())[:7], [[]])


@pytest.mark.parametrize("probs", [False, True], ids=["out", "probs"])
def test_a_prompt_run_then_scattered_appends_reads_as_one_softmax(probs):
    """A row whose live slots are a long leading run (a prompt) and then scattered slots (decode appends
    interleaved with other requests', a hole among them): the run is read as contiguous rows, the rest
    through their slots, the two softmaxes merged. Output and probabilities equal the reference's."""
    g = torch.Generator().manual_seed(3)
    b, kv_heads, group, dim, slots, cap = 2, 2, 3, 64, 2000, 700
    k_pool = torch.randn(kv_heads, slots, dim, generator=g)
    v_pool = torch.randn(kv_heads, slots, dim, generator=g)
    run = (200, 520)  # one request's prompt shorter than the prefix read's floor: one pass through its slots
    past = torch.tensor([run[0] + 40, run[1] + 25])
    table = torch.zeros(b, kv_heads, cap, dtype=torch.long)
    holes = torch.zeros(b, kv_heads, cap, dtype=torch.bool)
    tail = torch.randperm(slots - 1200, generator=g) + 1200
    for i in range(b):
        table[i, :, : run[i]] = torch.arange(i * 600, i * 600 + run[i])
        n = int(past[i]) - run[i]
        table[i, :, run[i] : past[i]] = tail[i * 100 : i * 100 + n]
        holes[i, 1, run[i] + 3] = True  # a hole among the appends of one head
    ids = torch.stack([tail[500:502], tail[502:504]])  # (H_kv, B)
    columns = NewColumns(
        [torch.zeros(b, kv_heads, cap, 1, dtype=torch.long)],
        [torch.zeros(b, kv_heads, cap, dtype=torch.int8)],
        [torch.zeros(b, kv_heads, cap, dtype=torch.long)],
        past,
        past[:, None] + 7,
        torch.full((b,), 3, dtype=torch.int8),
        past + 7,
    )
    q = torch.randn(b, kv_heads, group, dim, generator=g)
    k_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    v_new = torch.randn(b, kv_heads, 1, dim, generator=g)
    case = (q, k_new, v_new, k_pool, v_pool, ids, [table], [holes], columns, past + 1)
    scale = 0.125
    _, _, want, _, read = _reference(case, scale)
    width = int(past.max()) + 1
    got = _call(case, scale, probs_width=width if probs else None)
    torch.testing.assert_close(got[0], want, **TOL)
    if probs:
        held = (read[:, :, :width] >= 0) & (torch.arange(width) < (past + 1)[:, None, None])
        keys = k_pool[torch.arange(kv_heads)[None, :, None], read[:, :, :width].clamp_min(0)]
        scores = torch.einsum("bhgd,bhwd->bhgw", q * scale, keys).masked_fill(
            ~held[:, :, None], float("-inf")
        )
        torch.testing.assert_close(got[2], torch.softmax(scores, -1), **TOL)
        assert torch.equal(got[3], held)
