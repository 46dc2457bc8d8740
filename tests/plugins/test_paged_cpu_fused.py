"""The fused C++ CPU decode read (``vlkv/plugins/paged_cpu_kernel.py``) against the reference: decode rows
read in place, GQA, head sizes, ragged lengths, several runs, appends; what stays on the matmuls."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from vlkv.plugins.paged_cpu import paged_attention_cpu
from vlkv.plugins.paged_reference import paged_attention_reference

# the fused CPU kernel's cases: decode rows over runs read in place, GQA 1/3/7 (unrolled) and 5 (generic),
# head sizes 64, 128 (unrolled) and 40 (generic loop), ragged lengths, several runs per request, appends
FUSED = (
    PagedCase(3, 1, 7, 1, 300, 64, layout="runs", runs=3),
    PagedCase(2, 1, 5, 1, 81, 64, layout="runs", runs=2),
    PagedCase(2, 3, 3, 1, 81, 40, layout="runs", runs=2),
    PagedCase(2, 3, 1, 1, 81, 128, layout="appends"),
    PagedCase(3, 2, 3, 1, 81, 64, layout="appends", full=True),  # lockstep appends: the tail block
    PagedCase(4, 2, 3, 1, 81, 64, layout="appends"),  # ragged: appends per request, merged by index
    PagedCase(2, 2, 3, 1, 81, 64, layout="holes", runs=2),
    PagedCase(2, 2, 3, 1, 81, 128, layout="holes", runs=2),  # head size 128 beside GQA 3
    PagedCase(2, 2, 3, 1, 81, 128, layout="runs", runs=1),
)


def fused_calls(monkeypatch) -> list[int]:
    """Turns the fused kernel on; the segments of each of its calls, appended as the CPU form runs."""
    import vlkv.plugins.paged_cpu as paged_cpu
    import vlkv.plugins.paged_cpu_kernel as kernel

    # the fused read is a feature: a machine that cannot build it fails here (.ci/run installs g++)
    assert kernel.kernel() is not None, (
        "the fused CPU decode kernel did not build (is a C++ compiler installed?)"
    )
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    calls, real = [], kernel.segments_attention
    monkeypatch.setattr(
        kernel,
        "segments_attention",
        lambda qs, k, v, req, *rest: calls.append(req.numel()) or real(qs, k, v, req, *rest),
    )
    return calls


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", FUSED, ids=repr)
def test_cpu_fused_kernel_matches_reference(case, dtype, monkeypatch):
    """The fused kernel (fp32 decode rows read in place; its parts merged by log-sum-exp) gives the
    reference's result within the CPU form's tolerance; bf16 pools, holes and gathered requests keep the
    matmuls (the kernel is not called)."""
    calls = fused_calls(monkeypatch)
    args = case.make(dtype)
    want = paged_attention_reference(**args)
    for inplace_min, run_min in ((1, 1), (1, 16), (None, None)):
        calls.clear()
        got = paged_attention_cpu(**args, run_min=run_min, inplace_min=inplace_min)
        assert got.dtype == dtype
        assert_close_tol(got, want, OUT_TOL, dtype)
        assert torch.all(got[0, : case.group] == 0) or case.full
        plan = paged_cpu_plan_for(args, run_min, inplace_min)
        assert bool(calls) == (dtype == torch.float32 and plan.inplace is not None)
    if dtype == torch.float32 and case.layout != "holes":
        calls.clear()
        paged_attention_cpu(**args, run_min=1, inplace_min=1)
        assert calls, "an fp32 decode read in place must take the fused kernel"


def paged_cpu_plan_for(args: dict, run_min, inplace_min):
    from vlkv.plugins.paged_cpu import plan_for

    return plan_for(args["q"], args["k_pool"], args["table"], args["lengths"], run_min, inplace_min)


def test_cpu_fused_kernel_prefill_rows_keep_the_matmuls(monkeypatch):
    """Several query rows (a prefill chunk: causal masks) are not the kernel's: the matmuls read them."""
    calls = fused_calls(monkeypatch)
    args = PagedCase(2, 3, 3, 4, 81, 64, layout="runs", runs=1).make(torch.float32)
    got = paged_attention_cpu(**args, run_min=1, inplace_min=1)
    assert calls == []
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)


def test_cpu_fused_kernel_one_append_per_request(monkeypatch):
    """Lockstep decode right after a prompt: one run and ONE appended slot per request (the appends'
    block is then a strided view the kernel must get contiguous)."""
    calls = fused_calls(monkeypatch)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 1, 64, generator=g)
    k_pool, v_pool = torch.randn(2, 300, 64, generator=g), torch.randn(2, 300, 64, generator=g)
    rows = [torch.cat([torch.arange(r * 90, r * 90 + 80), torch.tensor([299 - r])]) for r in range(3)]
    table = torch.stack(rows)[:, None].expand(3, 2, 81).contiguous()
    args = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "table": table, "lengths": torch.full((3, 2), 81)}
    got = paged_attention_cpu(**args, scale=0.125, run_min=16, inplace_min=1)
    assert calls == [3, 3]  # the runs, then the appends' block
    assert_close_tol(got, paged_attention_reference(**args, scale=0.125), OUT_TOL, torch.float32)
