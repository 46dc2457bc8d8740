"""Per-head tables read in place: the fused CPU kernel reads each (request, KV head)'s own slot row
(per-head slots, holes, ragged head lengths) straight from the pool, against the reference.

What must hold: the kernel's result equals ``paged_reference`` (fp32, ``OUT_TOL``) for decode rows over
per-head tables, holes, runs and appends, GQA 1/3/5/7, head sizes 40/64/128, empty rows; a plan with
the kernel reads those requests through their table rows and gathers nothing (bytes counted); bf16 pools
and prefill chunks keep the gather (and still equal the reference); a bad slot is one clear error; the
kernel's build is keyed by the CPU it runs on.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.plugins.paged_cpu_kernel as kernel
from tests.plugins.cases import OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from vlkv.plugins.paged_cpu import paged_attention_cpu, plan_for, plan_reused
from vlkv.plugins.paged_reference import held_columns, paged_attention_reference

# decode rows (Q = 1) over per-head tables: random slots per head with ragged head lengths, holes,
# shared runs, appends; GQA 1/3/5/7; head sizes 40 (generic loop), 64, 128 (unrolled); 1..729 columns
HEADS = (
    PagedCase(1, 1, 1, 1, 1, 64),
    PagedCase(2, 2, 3, 1, 9, 64),
    PagedCase(3, 3, 3, 1, 81, 64),
    PagedCase(2, 2, 7, 1, 81, 128),
    PagedCase(2, 1, 5, 1, 81, 40),
    PagedCase(2, 2, 3, 1, 729, 64),
    PagedCase(3, 2, 3, 1, 81, 64, layout="holes", runs=2),
    PagedCase(2, 3, 1, 1, 729, 64, layout="holes", runs=3),
    PagedCase(2, 3, 3, 1, 81, 64, layout="runs", runs=3),
    PagedCase(3, 2, 3, 1, 81, 64, layout="appends"),
)


@pytest.fixture
def fused(monkeypatch):
    """The fused kernel on; counts the bytes gathered into scratch and each table-row kernel call's
    held entries."""
    assert kernel.kernel() is not None, (
        "the fused CPU decode kernel did not build (is a C++ compiler installed?)"
    )
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    seen = {"gathered": 0, "rows": []}
    real_gather, real_rows = paged_cpu._gather, kernel.table_attention

    def gather(pool, flat, out=None):
        seen["gathered"] += flat.numel() * pool.shape[-1] * pool.element_size()
        return real_gather(pool, flat, out)

    def rows(qs, k_pool, v_pool, table, lengths):
        seen["rows"].append(int(held_columns(table, lengths).sum()))
        return real_rows(qs, k_pool, v_pool, table, lengths)

    monkeypatch.setattr(paged_cpu, "_gather", gather)
    monkeypatch.setattr(kernel, "table_attention", rows)
    return seen


@pytest.mark.parametrize("case", HEADS, ids=repr)
def test_table_rows_kernel_matches_reference(case, fused):
    args = case.make(torch.float32)
    want = paged_attention_reference(**args)
    # inplace_min past every request: all read by their table rows; default: long shared runs in place
    for inplace_min in (10**9, None, 1):
        fused["gathered"], fused["rows"] = 0, []
        got = paged_attention_cpu(**args, inplace_min=inplace_min, run_min=16)
        assert_close_tol(got, want, OUT_TOL, torch.float32)
        plan = plan_for(args["q"], args["k_pool"], args["table"], args["lengths"], 16, inplace_min)
        assert plan.gathered is None  # no request gathered: in place by runs, or by its own rows
        if inplace_min == 10**9:
            # each head read its live entries, no more: the held columns of the table (no call when
            # every request is empty)
            held = int(held_columns(args["table"], args["lengths"]).sum())
            assert fused["rows"] == ([held] if held else [])
            assert fused["gathered"] == 0


def test_per_head_request_beside_in_place_and_short_ones(fused):
    """One batch: a long request of shared runs (read in place), a per-head request with holes and
    ragged head lengths (its table rows), a short request (its table rows, not gathered)."""
    g = torch.Generator().manual_seed(7)
    kv_heads, group, dim, slots = 2, 3, 64, 900
    q = torch.randn(3, kv_heads * group, 1, dim, generator=g)
    k_pool, v_pool = (
        torch.randn(kv_heads, slots, dim, generator=g),
        torch.randn(kv_heads, slots, dim, generator=g),
    )
    cols = 300
    long = torch.arange(0, cols)[None].expand(kv_heads, cols)  # one run in every head
    perhead = torch.stack([torch.randperm(slots - 320, generator=g)[:cols] + 320 for _ in range(kv_heads)])
    perhead[torch.rand(kv_heads, cols, generator=g) < 0.4] = -1  # holes
    short = torch.tensor([[310, 311, 312] + [0] * (cols - 3)] * kv_heads)
    table = torch.stack([long, perhead, short])
    lengths = torch.tensor([[cols, cols], [cols, 200], [3, 3]])
    args = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "table": table, "lengths": lengths, "scale": 0.125}
    got = paged_attention_cpu(**args, inplace_min=64)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)
    plan = plan_for(q, k_pool, table, lengths, None, 64)
    assert plan.rows.tolist() == [1, 2] and plan.gathered is None and plan.inplace is not None
    assert fused["gathered"] == 0
    assert fused["rows"] == [int(held_columns(table[1:], lengths[1:]).sum())]


@pytest.mark.parametrize("case", HEADS[6:8], ids=repr)
def test_bf16_pools_and_prefill_rows_keep_the_gather(case, fused):
    """The kernel reads fp32 decode rows only: a bf16 pool and a prefill chunk are gathered (and still
    equal the reference)."""
    args = case.make(torch.bfloat16)
    got = paged_attention_cpu(**args, inplace_min=10**9)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.bfloat16)
    assert fused["rows"] == [] and fused["gathered"] > 0
    fused["gathered"] = 0
    args = dataclasses.replace(case, queries=3).make(torch.float32)
    got = paged_attention_cpu(**args, inplace_min=10**9)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)
    assert fused["rows"] == [] and fused["gathered"] > 0


def test_a_plan_is_reused_only_under_the_same_kernel_setting(fused, monkeypatch):
    args = HEADS[6].make(torch.float32)
    q, k, table, lengths = args["q"], args["k_pool"], args["table"], args["lengths"]
    plan = plan_reused(None, q, k, table, lengths)
    assert plan.fused and plan.rows is not None
    assert plan_reused(plan, q, k, table, lengths) is plan
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    other = plan_reused(plan, q, k, table, lengths)
    assert other is not plan and not other.fused and other.rows is None
    got = paged_attention_cpu(**args, plan=other)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)


def test_a_slot_outside_the_pool_is_one_clear_error(fused):
    q = torch.randn(1, 2, 1, 64)
    k = torch.randn(2, 10, 64)
    table = torch.tensor([[[1, 2, 10], [0, 1, 2]]])
    with pytest.raises(RuntimeError, match="slot 10 out of the pool's 10"):
        kernel.table_attention(q.view(1, 2, 1, 64), k, k, table, torch.full((1, 2), 3))


def test_the_build_is_keyed_by_the_cpu(monkeypatch):
    """A home shared by machines with other CPUs: another CPU (flags) builds and loads its own binary."""
    here = kernel.build_name()
    assert here == kernel.build_name()  # stable on one machine
    monkeypatch.setattr(kernel, "cpu_flags", lambda: "x86_64|other cpu|avx2 sse4_2")
    assert kernel.build_name() != here
    assert kernel.build_name().startswith("vlkv_paged_cpu_kernel_")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", [HEADS[i] for i in (1, 2, 3, 4, 6)], ids=repr)
def test_triton_kernel_reads_per_head_rows(case, dtype):
    """The Triton kernel walks each (request, KV head)'s own row up to that head's length, its hole
    loads masked (nothing read for them): per-head tables equal the reference (interpreter on CPU)."""
    tpa = pytest.importorskip("vlkv.plugins.triton_paged_attention", reason="triton is not installed")
    args = case.make(dtype)
    got = tpa.paged_attention_triton(**args)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)


def test_a_kernel_plan_with_pools_the_kernel_cannot_read_falls_back(fused):
    """A plan made for the kernel (from K's layout) handed a V pool the kernel cannot read (strided):
    the call replans for the gather and still equals the reference."""
    args = HEADS[6].make(torch.float32)
    plan = plan_for(args["q"], args["k_pool"], args["table"], args["lengths"])
    assert plan.rows is not None
    v = args["v_pool"]
    args["v_pool"] = torch.cat([v, v], dim=-1)[..., : v.shape[-1]]  # same values, not contiguous
    got = paged_attention_cpu(**args, plan=plan)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)
    assert fused["rows"] == [] and fused["gathered"] > 0


def test_table_rows_kernel_split_over_threads(fused):
    """Two intra-op threads split the (request, KV head) rows: the same result as the reference."""
    args = HEADS[7].make(torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_attention_cpu(**args, inplace_min=10**9)
    finally:
        torch.set_num_threads(threads)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)
    assert fused["gathered"] == 0
