"""The Triton paged low-rank read under the factored span's own splits (``paged_lowrank.split_layout``: the
span's columns walked first by the splits that load the bases, the dense rest by the others), under the
interpreter, against its reference: a ragged batch (one request without factors), each other request's
image a block of factored columns with text before and after it, holes and dense entries inside the block,
pre-RoPE (linked) dense columns beside pre-RoPE factored ones (1-D RoPE rows and the M-RoPE table form),
decode and a two-row chunk, 1 to 20 splits, fp32/fp16/bf16, plain and statistics forms, with the paged
read's tolerances (``OUT_TOL``)."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from tests.plugins.test_triton_paged_lowrank import PROB_TOL, RK, RV, rope_args, with_factors
from vlkv.plugins.paged_lowrank import (
    PagedFactors,
    factored_chunk,
    factored_span,
    paged_lowrank_kv,
    paged_lowrank_reference,
    split_layout,
)
from vlkv.plugins.triton_selected_attention import tile_sizes

tpl = pytest.importorskip("vlkv.plugins.triton_paged_lowrank", reason="triton is not installed")

CASES = (
    PagedCase(3, 2, 3, 1, 200, 16, layout="holes", runs=2),  # GQA 3, holes, ragged head lengths
    PagedCase(3, 1, 4, 2, 170, 8),  # a two-row chunk, per-head random slots
)


def image_blocks(args: dict, g: torch.Generator, dtype) -> PagedFactors:
    """``with_factors``' rows and bases, ``frow`` a block per request ``b >= 1``: columns ``[5b, 5b + 130)``
    factored, but for about 15 % of them (left a dense entry, or the case's hole), text either side."""
    f = with_factors(args, g, dtype)
    b, h, c = f.frow.shape
    counts = [0] + [3 + 4 * i for i in range(1, b)]
    offsets = torch.tensor([sum(counts[:i]) for i in range(b)])
    cols = torch.arange(c)
    frow = torch.full_like(f.frow, -1)
    for i in range(1, b):
        block = (cols >= 5 * i) & (cols < 5 * i + 130) & (torch.rand(h, c, generator=g) > 0.15)
        local = torch.randint(0, counts[i], (h, c), generator=g)
        frow[i] = torch.where(block, offsets[i] + local, -1)
    return PagedFactors(frow, *list(vars(f).values())[1:])


def layout_of(args: dict, f: PagedFactors, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(splits_f, holds)`` of the kernel's cut for the case (decode rows: its lengths)."""
    group = args["q"].shape[1] // args["k_pool"].shape[0]
    d = args["k_pool"].shape[-1]
    block_n = tile_sizes(group * args["q"].shape[2], d, d)[1]
    chunk = factored_chunk(RK, RV, d, d)
    splits_f, _, _, holds = split_layout(
        factored_span(f, args["lengths"]), args["lengths"], splits, block_n, chunk
    )
    return splits_f, holds


def test_the_cases_cut_the_span_in_several_splits_beside_dense_ones():
    # the kernel tests below exercise the new cut: some row's span has two or more loading splits, and
    # the others splits of that row take its dense columns
    args = CASES[0].make(torch.float32)
    f = image_blocks(args, torch.Generator().manual_seed(9), torch.float32)
    splits_f, holds = layout_of(args, f, 6)
    assert int(holds.sum(-1).max()) >= 2 and int(splits_f.max()) < 6
    assert int((splits_f == 0).sum()) >= args["q"].shape[0] - 1  # request 0 holds none: all dense splits


@pytest.mark.parametrize("num_splits", [2, 6])
@pytest.mark.parametrize("form", ["post", "rope-1d", "mrope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_the_kernel_equals_the_reference_under_the_span_splits(case, dtype, form, num_splits):
    check_kernel(case, dtype, form, num_splits)


@pytest.mark.parametrize("form", ["rope-1d", "mrope"])
def test_at_twenty_splits_most_take_the_dense_columns(form):
    """Qwen2-VL-7B batch 1's default split count: the span's few splits and many dense ones."""
    check_kernel(CASES[0], torch.float32, form, 20)


def check_kernel(case, dtype, form, num_splits):
    g = torch.Generator().manual_seed(9)
    args = case.make(dtype)
    factors = image_blocks(args, g, dtype)
    ref_rope, rope = rope_args(args, factors, form, g, dtype)
    want = paged_lowrank_reference(**args, factors=factors, **ref_rope)
    got = tpl.paged_lowrank_triton(**args, factors=factors, num_splits=num_splits, **rope)
    assert_close_tol(got, want, OUT_TOL, dtype)


@pytest.mark.parametrize("num_splits", [1, 6])
@pytest.mark.parametrize("form", ["post", "mrope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_statistics_form_under_the_span_splits(dtype, form, num_splits):
    """The statistics form's output and probabilities (each column's logit is stored at its table column
    whatever order the splits walk it in)."""
    g = torch.Generator().manual_seed(10)
    args = CASES[0].make(dtype)
    factors = image_blocks(args, g, dtype)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_one_gives_the_span_its_share_of_the_splits(dtype):
    """``chunk=1`` (the cut that ignores the basis loads' cost, kept to time against): the span takes its
    share of the splits, several loading splits a row, and the result is still the reference's."""
    g = torch.Generator().manual_seed(11)
    args = CASES[0].make(dtype)
    factors = image_blocks(args, g, dtype)
    lengths = args["lengths"]
    splits_f, _, _, holds = split_layout(factored_span(factors, lengths), lengths, 6, 64, 1)
    assert int(holds.sum(-1).max()) >= 3
    ref_rope, rope = rope_args(args, factors, "rope-1d", g, dtype)
    want = paged_lowrank_reference(**args, factors=factors, **ref_rope)
    got = tpl.paged_lowrank_triton(**args, factors=factors, num_splits=6, chunk=1, **rope)
    assert_close_tol(got, want, OUT_TOL, dtype)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        tpl.paged_lowrank_triton(**args, factors=factors, num_splits=6, chunk=0, **rope)


def _cols(c: int, ranges) -> torch.Tensor:
    cols = torch.arange(c)
    out = torch.zeros(c, dtype=torch.bool)
    for lo, hi in ranges:
        out |= (cols >= lo) & (cols < hi)
    return out


# which columns of a 150-column row are factored, by request: the span is first to last factored column
SPANS = {
    "two images, text between": lambda i, c: _cols(c, [(5, 40), (90, 140)]),
    "wholly factored": lambda i, c: _cols(c, [(0, c)]),
    "one column (chunk > span)": lambda i, c: _cols(c, [(7 + i, 8 + i)]),
    "span at the end": lambda i, c: _cols(c, [(c - 30, c)]),
    "span at the start": lambda i, c: _cols(c, [(0, 30)]),
}


@pytest.mark.parametrize("num_splits", [5, 20])
@pytest.mark.parametrize("span", sorted(SPANS))
def test_the_span_splits_at_the_edges_of_a_row(span, num_splits):
    """Spans the image-block cases do not make: two images with text between (one span holding both),
    a row wholly factored, a single factored column, spans touching either end of the row; M-RoPE."""
    args = PagedCase(3, 1, 4, 2, 150, 8).make(torch.float32)
    f = with_factors(args, torch.Generator().manual_seed(1), torch.float32)
    b, h, c = f.frow.shape
    counts = [3 + 4 * i for i in range(b)]
    frow = torch.full_like(f.frow, -1)
    for i in range(b):
        local = torch.arange(c) % counts[i] + sum(counts[:i])
        frow[i] = torch.where(SPANS[span](i, c), local, -1)
    g = torch.Generator().manual_seed(5)
    n, d = sum(counts), args["k_pool"].shape[-1]
    f = PagedFactors(
        frow,
        torch.randn(n, RK, generator=g),
        torch.randn(b, RK, h * d, generator=g) / RK**0.5,
        torch.randn(n, RV, generator=g),
        torch.randn(b, RV, h * d, generator=g) / RV**0.5,
        torch.randint(1, RK + 1, (n,), generator=g),
        torch.randint(1, RV + 1, (n,), generator=g),
    )
    ref_rope, rope = rope_args(args, f, "mrope", torch.Generator().manual_seed(2), torch.float32)
    want = paged_lowrank_reference(**args, factors=f, **ref_rope)
    got = tpl.paged_lowrank_triton(**args, factors=f, num_splits=num_splits, **rope)
    assert_close_tol(got, want, OUT_TOL, torch.float32)
