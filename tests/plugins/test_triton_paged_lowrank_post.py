"""The Triton paged low-rank read of post-RoPE factors (AttentionPack path (b): ``PagedFactors.post_rope``,
the kernel's rank-space logits ``(q·D_kᵀ)·K̄ᵀ``), under the interpreter, against its reference
(``paged_lowrank_reference``, itself checked against the eager rank-space read in
tests/runtime/kv/test_paged_factors.py): a batch mixing a request without factors, a path (b) request and
a path (a) request (pre-RoPE factored columns rotated beside path (b)'s, whose ``rot`` entries the read
must ignore), 1-D RoPE rows and the M-RoPE table form, fp32/fp16/bf16, plain and statistics forms, one
split and three, and the factored span's own splits (image blocks, 6 splits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from tests.plugins.test_triton_paged_lowrank import PROB_TOL, rope_args, with_factors
from tests.plugins.test_triton_paged_lowrank_splits import CASES as SPAN_CASES
from tests.plugins.test_triton_paged_lowrank_splits import image_blocks, layout_of
from vlkv.plugins.paged_lowrank import PagedFactors, paged_lowrank_kv, paged_lowrank_reference

tpl = pytest.importorskip("vlkv.plugins.triton_paged_lowrank", reason="triton is not installed")

CASES = (
    PagedCase(3, 2, 3, 1, 81, 16, layout="holes", runs=2),  # GQA 3, holes, ragged head lengths
    PagedCase(3, 1, 4, 2, 9, 8),  # a two-row chunk, per-head random slots, an empty row
)


def mixed(f: PagedFactors) -> PagedFactors:
    """``f`` with request 1 post-RoPE (path (b)); request 0 holds no factors, the rest stay path (a)."""
    post = torch.zeros(f.frow.shape[0], dtype=torch.bool)
    post[1] = True
    return dataclasses.replace(f, post_rope=post)


def check(args: dict, f: PagedFactors, form: str, dtype, num_splits: int, g: torch.Generator) -> None:
    ref_rope, rope = rope_args(args, f, form, g, dtype)
    want = paged_lowrank_reference(**args, factors=f, **ref_rope)
    got = tpl.paged_lowrank_triton(**args, factors=f, num_splits=num_splits, **rope)
    assert_close_tol(got, want, OUT_TOL, dtype)
    as_a = paged_lowrank_reference(**args, factors=dataclasses.replace(f, post_rope=None), **ref_rope)
    torch.testing.assert_close(as_a[2], want[2], rtol=0, atol=0)  # the path (a) request is unchanged
    if args["q"].shape[2] != 1:
        return
    # the rot table names some of path (b)'s factored columns, and the read ignores them: read as
    # pre-RoPE (rotated, rounded) the post-RoPE request's output differs
    assert bool(((ref_rope["rot"][1] >= 0) & (f.frow[1] >= 0)).any())
    assert (as_a[1].float() - want[1].float()).abs().max() > 0.02
    out, probs, vis = tpl.paged_lowrank_probs_triton(**args, factors=f, num_splits=num_splits, **rope)
    assert_close_tol(out, want, OUT_TOL, dtype)
    q, scale = args["q"], args["scale"]
    k, _, seen = paged_lowrank_kv(
        q, args["k_pool"], args["v_pool"], args["table"], args["lengths"], f, **ref_rope
    )
    b, h, c, d = k.shape
    scores = torch.matmul(q.float().view(b, h, -1, d), k.float().transpose(-1, -2)) * scale
    ref = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    assert torch.equal(vis, seen)
    torch.testing.assert_close(probs, ref, rtol=PROB_TOL[dtype], atol=PROB_TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("form", ["rope-1d", "mrope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_batch_mixing_path_a_and_b_equals_the_reference(dtype, form, num_splits):
    g = torch.Generator().manual_seed(11)
    args = CASES[0].make(dtype)
    check(args, mixed(with_factors(args, g, dtype)), form, dtype, num_splits, g)


@pytest.mark.parametrize("form", ["rope-1d", "mrope"])
def test_path_b_under_the_factored_spans_own_splits(form):
    dtype = torch.float16
    g = torch.Generator().manual_seed(12)
    args = SPAN_CASES[0].make(dtype)
    f = mixed(image_blocks(args, g, dtype))
    splits_f, holds = layout_of(args, f, 6)
    assert int(holds[1].sum(-1).max()) >= 2  # the post-RoPE request's span is cut among several splits
    check(args, f, form, dtype, 6, g)


def test_a_two_row_chunk_reads_path_b_too():
    g = torch.Generator().manual_seed(13)
    args = CASES[1].make(torch.float32)
    check(args, mixed(with_factors(args, g, torch.float32)), "rope-1d", torch.float32, 1, g)


def test_the_flag_is_checked():
    args = CASES[1].make(torch.float32)
    f = with_factors(args, torch.Generator().manual_seed(14), torch.float32)
    with pytest.raises(ValueError, match="PagedFactors.post_rope"):
        dataclasses.replace(f, post_rope=torch.zeros(f.frow.shape[0] + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="PagedFactors.post_rope"):
        dataclasses.replace(f, post_rope=torch.zeros(f.frow.shape[0], dtype=torch.long))


@pytest.mark.gpu
def test_on_cuda_the_compiled_kernel_reads_path_b():
    """On a GPU (compiled, not the interpreter): the mixed batch, bf16, 1-D RoPE rows, plain and statistics
    forms against the reference."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(15)
    args = CASES[0].make(dtype)
    f = mixed(with_factors(args, g, dtype))
    ref_rope, rope = rope_args(args, f, "rope-1d", g, dtype)
    want = paged_lowrank_reference(**args, factors=f, **ref_rope)
    on = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    fc = PagedFactors(*(t.cuda() for t in vars(f).values()))
    rope = {n: v.cuda() for n, v in rope.items()}
    assert_close_tol(tpl.paged_lowrank_triton(**on, factors=fc, **rope).cpu(), want, OUT_TOL, dtype)
    out, probs, _ = tpl.paged_lowrank_probs_triton(**on, factors=fc, num_splits=3, **rope)
    assert_close_tol(out.cpu(), want, OUT_TOL, dtype)
    assert bool(probs.isfinite().all())
