"""The Triton paged read of low-rank factor rows (``triton_paged_lowrank``), under the interpreter, against
its reference (``paged_lowrank.paged_lowrank_reference``, itself checked against path (a) in
tests/runtime/kv/test_paged_factors.py): ragged requests (one without factors, different factor-row
counts), holes, factored columns at per-row ranks (R_k != R_v, padded to the tile), keys post-RoPE, 1-D
RoPE rows and the M-RoPE table form (partial and full rotary), decode and a prefill chunk, one split and
three, fp32/fp16/bf16. The values' rank-space accumulation is not rounded where the reference rounds
each rebuilt value to the dtype: the tolerances are the paged read's (``OUT_TOL``)."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from tests.plugins.test_triton_paged_rope_table import _table
from vlkv.plugins.paged_lowrank import PagedFactors, paged_lowrank_kv, paged_lowrank_reference
from vlkv.plugins.paged_reference import paged_attention_reference
from vlkv.runtime.kv.rope_table import table_as_rows

tpl = pytest.importorskip("vlkv.plugins.triton_paged_lowrank", reason="triton is not installed")

CASES = (
    PagedCase(2, 2, 3, 1, 81, 16, layout="holes", runs=2),  # GQA 3, holes, ragged head lengths
    PagedCase(3, 1, 4, 2, 9, 8),  # a two-row chunk, per-head random slots, an empty row
)
RK, RV = 5, 3  # padded ranks (BLOCK_R 16)
ROWS = 64  # positions of the M-RoPE table
# probabilities: fp32 softmax of the same keys (rebuilt by the same products, rounded alike); measured
# within 2e-7 in every dtype
PROB_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def with_factors(args: dict, g: torch.Generator, dtype) -> PagedFactors:
    """About 40 % of each row's columns (holes among them) factored, request 0 none; request b's rows
    ``3 + 4b`` stacked; random bases scaled to unit-ish keys; per-row ranks in ``[1, R]``."""
    b, h, c = args["table"].shape
    dim, dim_v = args["k_pool"].shape[-1], args["v_pool"].shape[-1]
    counts = [0] + [3 + 4 * i for i in range(1, b)]
    offsets = torch.tensor([sum(counts[:i]) for i in range(b)])
    inside = torch.arange(c) < args["lengths"][..., None]
    fac = (torch.rand(b, h, c, generator=g) < 0.4) & inside
    fac[0] = False
    local = (
        torch.randint(0, 1 << 20, (b, h, c), generator=g) % torch.tensor(counts).clamp_min(1)[:, None, None]
    )
    frow = torch.where(fac, offsets[:, None, None] + local, -1)
    n = sum(counts)
    return PagedFactors(
        frow,
        torch.randn(n, RK, generator=g).to(dtype),
        (torch.randn(b, RK, h * dim, generator=g) / RK**0.5).to(dtype),
        torch.randn(n, RV, generator=g).to(dtype),
        (torch.randn(b, RV, h * dim_v, generator=g) / RV**0.5).to(dtype),
        torch.randint(1, RK + 1, (n,), generator=g),
        torch.randint(1, RV + 1, (n,), generator=g),
    )


def rope_args(args: dict, factors: PagedFactors, form: str, g: torch.Generator, dtype):
    """``(reference keywords, kernel keywords)``: none, 1-D rows (``rot`` a row of ``cos/sin``), or
    the M-RoPE table form (the reference reads its row form, ``table_as_rows``); about half the held
    columns, factored ones included, pre-RoPE."""
    if form == "post":
        return {}, {}
    b, h, c = args["table"].shape
    dim = args["k_pool"].shape[-1]
    dims = 3 if form == "mrope" else 1
    rot_dims = 8 if dim == 16 else dim  # partial rotary on 16 dims, full on 8
    table = _table(dims, rot_dims, dtype, g)
    rot4 = torch.randint(0, ROWS, (b, h, c, dims), generator=g)
    rot4 = torch.where((torch.rand(b, h, c, generator=g) < 0.5)[..., None], rot4, -1)
    rows, cos, sin = table_as_rows(rot4, table)
    ref = dict(rot=rows, cos=cos, sin=sin)
    if form == "mrope":
        return ref, dict(rot=rot4, cos=table.cos, sin=table.sin, sec=table.sec)
    return ref, dict(rot=rot4[..., 0], cos=table.cos, sin=table.sin)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("form", ["post", "rope-1d", "mrope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_the_kernel_equals_the_reference(case, dtype, form, num_splits):
    g = torch.Generator().manual_seed(3)
    args = case.make(dtype)
    factors = with_factors(args, g, dtype)
    ref_rope, rope = rope_args(args, factors, form, g, dtype)
    want = paged_lowrank_reference(**args, factors=factors, **ref_rope)
    got = tpl.paged_lowrank_triton(**args, factors=factors, num_splits=num_splits, **rope)
    assert_close_tol(got, want, OUT_TOL, dtype)
    # the factored columns are read: as holes, the result differs
    skip = paged_attention_reference(**args, **ref_rope)
    assert (skip.float() - want.float()).abs().max() > 0.05


@pytest.mark.parametrize("form", ["post", "rope-1d"])
def test_splits_outside_the_factored_span_skip_the_bases(form):
    """Factored columns only in 8..23 of request 1 (three splits of 81 columns: the later splits and
    request 0's programs load no basis): the result is still the reference's."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(8)
    args = CASES[0].make(dtype)
    factors = with_factors(args, g, dtype)
    cols = torch.arange(factors.frow.shape[-1])
    frow = torch.where((cols >= 8) & (cols < 24), factors.frow, -1)
    f = PagedFactors(frow, *list(vars(factors).values())[1:])
    assert bool((f.frow[1] >= 0).any())
    ref_rope, rope = rope_args(args, f, form, g, dtype)
    want = paged_lowrank_reference(**args, factors=f, **ref_rope)
    for splits in (1, 3):
        got = tpl.paged_lowrank_triton(**args, factors=f, num_splits=splits, **rope)
        assert_close_tol(got, want, OUT_TOL, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_factored_columns_it_is_the_paged_read(dtype):
    g = torch.Generator().manual_seed(4)
    args = CASES[0].make(dtype)
    factors = with_factors(args, g, dtype)
    none = PagedFactors(torch.full_like(factors.frow, -1), *list(vars(factors).values())[1:])
    got = tpl.paged_lowrank_triton(**args, factors=none)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)
    assert torch.equal(paged_lowrank_reference(**args, factors=none), paged_attention_reference(**args))


def test_the_factors_are_checked():
    args = CASES[1].make(torch.float32)
    g = torch.Generator().manual_seed(5)
    f = with_factors(args, g, torch.float32)
    with pytest.raises(ValueError, match="frow must be"):
        tpl.paged_lowrank_triton(**args, factors=PagedFactors(f.frow[:, :, :4], *list(vars(f).values())[1:]))
    with pytest.raises(ValueError, match="pool's dtype"):
        half = PagedFactors(
            f.frow, f.kbar.half(), f.dk.half(), f.vbar.half(), f.dv.half(), f.rank_k, f.rank_v
        )
        paged_lowrank_reference(**args, factors=half)
    with pytest.raises(ValueError, match="PagedFactors.rank_k"):
        PagedFactors(f.frow, f.kbar, f.dk, f.vbar, f.dv, f.rank_k[:-1], f.rank_v)
    with pytest.raises(ValueError, match="PagedFactors.dv"):
        PagedFactors(f.frow, f.kbar, f.dk, f.vbar, f.dk, f.rank_k, f.rank_v)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("form", ["post", "mrope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_statistics_form_gives_the_reference_probabilities(dtype, form, num_splits):
    """``paged_lowrank_probs_triton`` (one query row): the output as the plain kernel's, and each row's
    softmax over the keys the reference reads (factored columns held in ``vis``)."""
    g = torch.Generator().manual_seed(6)
    args = CASES[0].make(dtype)
    factors = with_factors(args, g, dtype)
    ref_rope, rope = rope_args(args, factors, form, g, dtype)
    out, probs, vis = tpl.paged_lowrank_probs_triton(**args, factors=factors, num_splits=num_splits, **rope)
    assert_close_tol(out, paged_lowrank_reference(**args, factors=factors, **ref_rope), OUT_TOL, dtype)
    q, scale = args["q"], args["scale"]
    k, _, seen = paged_lowrank_kv(
        q, args["k_pool"], args["v_pool"], args["table"], args["lengths"], factors, **ref_rope
    )
    b, h, c, d = k.shape
    scores = torch.matmul(q.float().view(b, h, -1, d), k.float().transpose(-1, -2)) * scale
    want = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    assert torch.equal(vis, seen)
    torch.testing.assert_close(probs, want, rtol=PROB_TOL[dtype], atol=PROB_TOL[dtype])


@pytest.mark.gpu
def test_on_cuda_the_compiled_kernel_equals_the_reference():
    """On a GPU (compiled, not the interpreter): the plain and statistics forms, bf16, 1-D RoPE rows and
    the M-RoPE table form, one case (four compiled variants: the check's pytest part is near its limit)."""
    for dtype in (torch.bfloat16,):
        for form in ("rope-1d", "mrope"):
            g = torch.Generator().manual_seed(7)
            args = CASES[0].make(dtype)
            factors = with_factors(args, g, dtype)
            ref_rope, rope = rope_args(args, factors, form, g, dtype)
            want = paged_lowrank_reference(**args, factors=factors, **ref_rope)
            on = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
            f = PagedFactors(*(None if t is None else t.cuda() for t in vars(factors).values()))
            rope = {n: v.cuda() for n, v in rope.items()}
            got = tpl.paged_lowrank_triton(**on, factors=f, **rope)
            assert_close_tol(got.cpu(), want, OUT_TOL, dtype)
            out, probs, vis = tpl.paged_lowrank_probs_triton(**on, factors=f, **rope)
            assert_close_tol(out.cpu(), want, OUT_TOL, dtype)
            sums = probs.sum(-1).cpu()  # (B, H_kv, G): 1 in a row that sees a column, else 0
            seen = vis.any(-1).cpu().expand_as(sums)
            assert bool(seen.any())
            torch.testing.assert_close(sums, seen.float(), rtol=1e-5, atol=1e-5)
