"""The one-column drop's torch form (``kv/drops.shift_one_each``: the multi-tensor shift a GPU runs) against
the C++ move (``evict_rows.drop_columns``), bit for bit: tables of any rank, each job its own length and
capacity, float tables moved as their bits, the flat dense form and the column-view form."""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.evict_rows as evict_rows
import vlkv.runtime.kv.drops as drops
from tests.runtime.kv.drop_tables import _dropped_columns, _kernel_built, _tables  # noqa: F401  (fixture)


@pytest.mark.parametrize("n", [2, 9, 81])
def test_the_torch_shift_moves_tables_of_any_rank_as_the_kernel_does(n):
    """Tables with two trailing dims (``(B, H_kv, C, 2, 3)``) and one (``(B, H_kv, C, 3)``) beside
    3-D ones: the torch ``where`` shift broadcasts its column mask over every trailing dim and equals
    the C++ move bit for bit (the stale columns past ``k`` included)."""
    layers, b, h, cap = 2, 2, 3, n + 4
    g = torch.Generator().manual_seed(n)
    cols = torch.randint(0, n, (layers, b, h), generator=g)
    fast, slow = _tables(layers, b, h, cap, n), _tables(layers, b, h, cap, n)
    for i, (f, s) in enumerate(zip(fast, slow)):
        five = torch.randn(b, h, cap, 2, 3, generator=torch.Generator().manual_seed(i))
        f.append(five.clone())
        s.append(five)
    index = torch.zeros(b, h, n - 1, dtype=torch.long)
    for tables, c in zip(slow, cols):
        drops.shift_kept(tables, index, int(c.min()), n - 1, c[:, :, None])
    evict_rows.drop_columns(fast, cols, n - 1)
    for f, s in zip(fast, slow):
        assert f[-1].dim() == 5
        for a, e in zip(f, s, strict=True):
            assert torch.equal(a, e)


def test_the_torch_shift_takes_each_jobs_own_length_as_the_kernel_does_per_length():
    """Jobs holding different lengths (a scheduler cohort's requests, one-sample tables of different
    capacities) moved by one multi-tensor shift, each job its own ``k``: every table and column (the
    stale ones past ``k`` included) equals the C++ move of each job alone."""
    lengths, h = [5, 12, 9, 12], 3
    g = torch.Generator().manual_seed(7)
    fast = [_tables(1, 1, h, n + 3 + i, n)[0] for i, n in enumerate(lengths)]
    slow = [[t.clone() for t in tables] for tables in fast]
    cols = torch.stack([torch.randint(0, n, (1, h), generator=g) for n in lengths])  # (J, 1, H_kv)
    gone = drops.shift_one_each(fast, cols, [n - 1 for n in lengths])
    for i, (tables, n) in enumerate(zip(slow, lengths)):
        want = evict_rows.drop_columns([tables], cols[i : i + 1], n - 1)
        assert torch.equal(gone[i : i + 1], want)
        for a, e in zip(fast[i], tables, strict=True):
            assert torch.equal(a, e)


@pytest.mark.parametrize("n", [1, 2, 9, 81])
@pytest.mark.parametrize("where", ["anywhere", "first", "last"])
def test_the_multi_tensor_shift_equals_the_kernel_bit_for_bit(n, where):
    """``drops.shift_one_each`` (the device form: a masked blend by ``torch._foreach_*`` ops) moves
    every table of every layer as the C++ kernel does, bit for bit: float scores holding ``-0.0``,
    ``inf`` and NaN (moved as the integers of their bits), an fp16 table, a 5-D table, the stale
    columns past ``k`` and the dropped slots."""
    layers, b, h, cap = 3, 2, 3, n + 5
    cols = _dropped_columns(layers, b, h, n, where)
    fast, slow = _tables(layers, b, h, cap, n), _tables(layers, b, h, cap, n)
    for i, (f, s) in enumerate(zip(fast, slow)):
        odd = torch.randn(b, h, cap, generator=torch.Generator().manual_seed(i))
        odd.view(-1)[::3] = -0.0
        odd.view(-1)[1::5] = float("inf")
        odd.view(-1)[2::7] = float("nan")
        extra = [odd, odd.half(), torch.randn(b, h, cap, 2, 3, generator=torch.Generator().manual_seed(i))]
        f.extend(t.clone() for t in extra)
        s.extend(extra)
    want = evict_rows.drop_columns(slow, cols, n - 1)
    got = drops.shift_one_each(fast, cols, n - 1)
    assert torch.equal(got, want)
    for f, s in zip(fast, slow):
        for a, e in zip(f, s, strict=True):
            assert a.dtype == e.dtype
            assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))  # the bits, NaN and -0.0 too


@pytest.mark.parametrize("contiguous", [True, False], ids=["whole-tables", "column-views"])
def test_the_multi_tensor_shift_takes_dense_operands_where_the_tables_are_contiguous(contiguous):
    """Contiguous tables are blended as flat dense views, every operand pair the same shape (the form
    CUDA's multi-tensor kernels take; run 7's column views went down the per-tensor path), others as
    column views; both equal the C++ move bit for bit, jobs of different capacities and lengths mixed."""
    lengths, caps, h = [6, 6, 11, 4], [9, 9, 14, 9], 3  # capacities in runs: 9, 9 | 14 | 9
    g = torch.Generator().manual_seed(11)
    fast = []
    for i, c in enumerate(caps):
        tables = _tables(1, 2, h, c + (0 if contiguous else 5), 100 + i)[0]
        fast.append(tables if contiguous else [t[:, :, :c] for t in tables])  # views past a wider table
    slow = [[t.clone() for t in tables] for tables in fast]
    cols = torch.stack([torch.randint(0, n, (2, h), generator=g) for n in lengths])  # (J, B, H_kv)
    ks = [n - 1 for n in lengths]
    ops = (drops._flat_operands if contiguous else drops._column_operands)(fast, cols.unsqueeze(3), ks)
    dense = all(t.is_contiguous() for lists in ops.values() for part in lists for t in part)
    assert dense == contiguous
    for dst, src, on, off in ops.values():  # (column views: the masks broadcast over trailing dims)
        same = all(d.shape == s.shape == a.shape == b.shape for d, s, a, b in zip(dst, src, on, off))
        assert same or not contiguous
    gone = drops.shift_one_each(fast, cols, ks)
    for i, (tables, k) in enumerate(zip(slow, ks)):
        want = evict_rows.drop_columns([tables], cols[i : i + 1], k)
        assert torch.equal(gone[i : i + 1], want)
        for a, e in zip(fast[i], tables, strict=True):
            assert torch.equal(a.view(torch.uint8), e.view(torch.uint8)), i
