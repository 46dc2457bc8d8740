"""``kv/paged_factors``' kept factor stacks: a layer read again with the same factor tensors reuses the
stacks it built (fewer ops, no pad), equal bit for bit to a fresh build; new ranks are read every call; a
replaced factor tensor rebuilds them; ``frow`` is the one the slot table of ``layer.table`` names."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.runtime.kv.test_paged_factors import MODELS, build_layer
from vlkv.runtime.kv.lowrank import set_ranks
from vlkv.runtime.kv.paged_factors import paged_lowrank_tables, stack_factors
from vlkv.runtime.op_count import count_ops

FIELDS = ("kbar", "dk", "vbar", "dv", "rank_k", "rank_v", "post_rope", "frow")


@pytest.fixture(scope="module")
def rope(engines):
    return engines[MODELS[1]].rope


def _fresh(layer, frow):
    """The stacks built from nothing (nothing kept)."""
    return stack_factors(layer.lowrank.samples, frow, layer.pool.spec.dtype)


def _assert_equal(got, want) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_second_read_reuses_the_stacks_and_equals_a_fresh_build(rope):
    layer = build_layer(rope, 1, torch.float32, post=(2,))
    first = paged_lowrank_tables(layer)[-1]
    second = paged_lowrank_tables(layer)[-1]
    assert second.kbar is first.kbar and second.dk is first.dk and second.vbar is first.vbar
    _assert_equal(second, _fresh(layer, second.frow))
    keep = (layer.pool, layer.layer)
    with count_ops() as kept:
        stack_factors(layer.lowrank.samples, second.frow, layer.pool.spec.dtype, keep=keep)
    with count_ops() as fresh:
        _fresh(layer, second.frow)
    assert kept.syncs == fresh.syncs == 0
    # kept: the ranks' two concatenations only; a fresh build pads and copies every request's factors
    assert kept.ops <= 4 and fresh.ops >= 20, (kept.ops, fresh.ops)


def test_new_ranks_are_read_and_a_replaced_factor_rebuilds_the_stacks(rope):
    layer = build_layer(rope, 1, torch.float32)
    first = paged_lowrank_tables(layer)[-1]
    f = layer.lowrank.samples[0]
    set_ranks(layer, 0, torch.ones(f.rows, dtype=torch.long), torch.ones(f.rows, dtype=torch.long))
    ranked = paged_lowrank_tables(layer)[-1]
    assert ranked.kbar is first.kbar  # the ranks changed, the factors did not
    assert int(ranked.rank_k[: f.rows].sum()) == f.rows and not torch.equal(ranked.rank_k, first.rank_k)
    _assert_equal(ranked, _fresh(layer, ranked.frow))
    # a factor edit that factors again replaces the tensors (here one, with other values)
    g = layer.lowrank.samples[2]
    layer.lowrank.samples[2] = replace(g, kbar=g.kbar * 2)
    rebuilt = paged_lowrank_tables(layer)[-1]
    assert rebuilt.kbar is not first.kbar and not torch.equal(rebuilt.kbar, first.kbar)
    _assert_equal(rebuilt, _fresh(layer, rebuilt.frow))


def test_frow_names_the_slot_tables_factor_rows(rope):
    """``frow`` as built from ``layer.table`` before (each request's first row its offset in the stack),
    now from ``paged_tables``' table (holes masked there, and excluded here either way)."""
    layer = build_layer(rope, 1, torch.float32, post=(2,))
    table, lengths, _, _, _, factors = paged_lowrank_tables(layer)
    n = table.shape[2]
    raw = layer.table(n)
    fac = (raw < 0) & (torch.arange(n) < lengths[..., None]) & layer.open_mask(n)
    offsets, start = [], 0
    for f in layer.lowrank.samples:
        offsets.append(start)
        start += 0 if f is None else f.rows
    want = torch.where(fac, -raw.long() - 1 + torch.tensor(offsets)[:, None, None], -1)
    assert torch.equal(factors.frow, want) and bool((want >= 0).any())
    assert torch.equal(table, torch.where(fac, -1, raw.masked_fill(~layer.open_mask(n), -1)))
