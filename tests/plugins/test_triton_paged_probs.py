"""The Triton paged decode with probabilities (``triton_paged_probs``, under the interpreter) against the two
halves it replaces on the GPU path (``paged_decode_probs`` + ``paged_decode_out``, the reference).

What must hold: the probabilities equal the halves' within fp32 tolerances (the logits are fp32 sums of
the same products for every pool dtype), exactly 0 at holes, past each (request, head)'s length and in a
row holding nothing; the output equals the halves' and ``paged_attention_reference`` (``OUT_TOL``); the
held-column mask is the halves' one (None where every column is held, from the device or from host
lengths); fp32 / bf16 / fp16 pools, GQA 1, 3 and 4, per-head random slots, runs with holes and ragged
head lengths, appends, one split and several, column counts off the block size; nothing is gathered;
``triton_decode_probs`` declines what it does not read (not CUDA and not forced, two query rows).
"""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import APPENDS, PagedCase, compiled_variants
from tests.plugins.test_paged_probs import loop_probs
from vlkv.plugins import ops
from vlkv.plugins.paged_probs import paged_decode_out, paged_decode_probs, triton_decode_probs
from vlkv.plugins.paged_reference import held_columns, paged_attention_reference
from vlkv.runtime.op_count import count_ops

tpp = pytest.importorskip("vlkv.plugins.triton_paged_probs", reason="triton is not installed")

CASES = (
    PagedCase(1, 1, 1, 1, 1, 16),  # one column
    PagedCase(2, 2, 3, 1, 9, 8),  # per-head random slots and lengths, an empty row
    PagedCase(2, 2, 4, 1, 81, 16, layout="holes", runs=2),  # GQA 4, holes, ragged head lengths
    PagedCase(3, 4, 1, 1, 81, 16, layout="holes", runs=3),  # GQA 1, four heads of their own lengths
    APPENDS[0],  # a prompt's run, then single appended slots
    PagedCase(3, 2, 1, 1, 81, 16, layout="runs", full=True),  # every column held: no mask
)
# fp32 softmax of fp32 dot products, summed in another order than the matmul's (fp16 under the
# interpreter: its dot rounds the products to fp16 first)
PROB_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _matmul_halves(monkeypatch):
    """The reference is the halves' matmul / gather form (the fused CPU kernel does not read it)."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)


def halves(args) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``probs, vis, out`` of the two halves: the path this kernel replaces."""
    q, table, lengths = args["q"], args["table"], args["lengths"]
    probs, vis = paged_decode_probs(q, args["k_pool"], table, lengths, args["scale"])
    out = paged_decode_out(probs, args["v_pool"], table, lengths).view(q.shape).to(q.dtype)
    return probs, vis, out


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_kernel_matches_the_halves(case, dtype, num_splits):
    args = case.make(dtype)
    want_p, want_vis, want_out = halves(args)
    q, k_pool, v_pool, table, lengths = (args[n] for n in ("q", "k_pool", "v_pool", "table", "lengths"))
    out, probs, vis = tpp.paged_probs_triton(
        q, k_pool, v_pool, table, lengths, args["scale"], num_splits=num_splits
    )
    assert probs.dtype == torch.float32 and probs.shape == want_p.shape
    tol = PROB_TOL[dtype]
    torch.testing.assert_close(probs, want_p, rtol=tol, atol=tol)
    torch.testing.assert_close(probs.double(), loop_probs(args), rtol=tol, atol=tol)
    held = held_columns(table, lengths.clamp(0, table.shape[2]))
    assert torch.equal(vis, held[:, :, None, :])
    assert want_vis is None or torch.equal(vis, want_vis)
    assert bool((probs[~held[:, :, None, :].expand_as(probs)] == 0).all())  # holes, padding: exactly 0
    assert out.dtype == dtype and out.shape == (*q.shape[:3], v_pool.shape[-1])
    assert_close_tol(out, want_out, OUT_TOL, dtype)
    assert_close_tol(out, paged_attention_reference(**args), OUT_TOL, dtype)
    if not case.full:  # lengths[0, 0] = 0: that row holds nothing, its query heads are zeros
        assert bool((probs[0, 0] == 0).all()) and bool((out[0, : case.group] == 0).all())


def test_auto_splits_read_a_long_row_through_strides():
    """729 columns (several splits picked from the launch size), a pool slice and a transposed q."""
    args = PagedCase(2, 2, 3, 1, 729, 16, layout="holes", runs=2).make(torch.float32)
    want_p, _, want_out = halves(args)
    h, s, d = args["k_pool"].shape
    big = torch.randn(h, s + 7, d + 4)
    big[:, 3 : 3 + s, :d] = args["k_pool"]
    k_pool = big[:, 3 : 3 + s, :d]
    q = args["q"].transpose(1, 2).contiguous().transpose(1, 2)
    out, probs, _ = tpp.paged_probs_triton(
        q, k_pool, args["v_pool"], args["table"], args["lengths"], args["scale"]
    )
    torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-5)
    assert_close_tol(out, want_out, OUT_TOL, torch.float32)


def test_splits_merge_in_the_normalise_pass_unless_the_group_spans_row_tiles(monkeypatch):
    """Several splits: the normalise pass merges their outputs (two launches in all) where one row tile
    holds the group; a group of 65 query heads (two tiles of 64) takes ``combine_splits``' own launch."""
    merged = []
    real = tpp.combine_splits
    monkeypatch.setattr(tpp, "combine_splits", lambda *a: merged.append(1) or real(*a))
    for group, launches in ((4, 0), (65, 1)):
        merged.clear()
        args = PagedCase(2, 1, group, 1, 40, 8, layout="holes", runs=2).make(torch.float32)
        want_p, _, want_out = halves(args)
        call = (args["q"], args["k_pool"], args["v_pool"], args["table"], args["lengths"], args["scale"])
        out, probs, _ = tpp.paged_probs_triton(*call, num_splits=3)
        assert len(merged) == launches, group
        torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-5)
        assert_close_tol(out, want_out, OUT_TOL, torch.float32)


@pytest.mark.parametrize("case", CASES[1:], ids=repr)
def test_forced_dispatch_reads_nothing_gathered_and_keeps_the_halves_mask(case, monkeypatch):
    """``triton_decode_probs`` (forced Triton on CPU tensors) gathers nothing; its mask is the halves', or
    all True where theirs is None (every column held) and host lengths say a hole is possible: from host
    lengths nothing is read back."""
    import vlkv.plugins.paged_cpu as paged_cpu
    import vlkv.plugins.paged_probs as paged_probs

    args = case.make(torch.float32)
    want_p, want_vis, want_out = halves(args)
    q, k_pool, v_pool, table, lengths = (args[n] for n in ("q", "k_pool", "v_pool", "table", "lengths"))

    def no_gather(*_a, **_k):
        raise AssertionError("the Triton path gathered K or V")

    monkeypatch.setattr(paged_cpu, "_gather", no_gather)
    monkeypatch.setattr(paged_probs, "_gather", no_gather)
    monkeypatch.setenv(ops.FORCE_TRITON_ENV, "1")
    host = lengths.clamp(0, table.shape[2]).tolist()
    for kw in ({}, {"host": host, "holes": True}, {"host": host, "holes": case.layout == "holes"}):
        with count_ops() as c:
            out, probs, vis = triton_decode_probs(q, k_pool, v_pool, table, lengths, args["scale"], **kw)
        # (the interpreter's own host copies are the launcher's, not the dispatch's)
        assert c.syncs_in("vlkv.plugins.paged_probs") == (0 if kw else 1), (kw, dict(c.sites))
        torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-5)
        assert_close_tol(out, want_out, OUT_TOL, torch.float32)
        if want_vis is None:
            assert vis is None or bool(vis.all()), kw
            assert vis is None or kw.get("holes"), kw  # told no hole: no mask
        else:
            assert torch.equal(vis, want_vis), kw


def test_fixed_output_buffers_are_written_in_place():
    """``probs_out`` / ``vis_out`` (a CUDA graph's buffers: the static step's ``probs`` and a hole step's
    ``held``): written in place, the same values as the launcher's own; wrong shapes, dtypes or strides
    are refused."""
    args = CASES[2].make(torch.float32)  # holes, ragged head lengths
    call = (args["q"], args["k_pool"], args["v_pool"], args["table"], args["lengths"], args["scale"])
    want_out, want_p, want_vis = tpp.paged_probs_triton(*call)
    probs_out = torch.full_like(want_p, -1.0)
    vis_out = torch.ones_like(want_vis)
    out, probs, vis = tpp.paged_probs_triton(*call, probs_out=probs_out, vis_out=vis_out)
    assert probs is probs_out and vis is vis_out
    assert torch.equal(probs, want_p) and torch.equal(vis, want_vis) and torch.equal(out, want_out)
    assert not vis.all()  # holes and padding written False over the ones
    assert tpp.paged_probs_triton(*call, with_vis=False, vis_out=vis_out)[2] is None
    with pytest.raises(ValueError, match="vis_out must be"):
        tpp.paged_probs_triton(*call, vis_out=vis_out[..., :-1])
    with pytest.raises(ValueError, match="vis_out must be contiguous"):
        tpp.paged_probs_triton(
            *call, vis_out=torch.ones(*want_vis.shape[:3], 2 * want_vis.shape[3], dtype=torch.bool)[..., ::2]
        )


def test_dispatch_declines_what_it_does_not_read(monkeypatch):
    import vlkv.plugins.paged_probs as paged_probs

    args = CASES[2].make(torch.float32)
    call = (args["q"], args["k_pool"], args["v_pool"], args["table"], args["lengths"], args["scale"])
    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    assert triton_decode_probs(*call) is None  # CPU tensors, Triton not forced: the CPU kernel's call
    monkeypatch.setenv(ops.FORCE_TRITON_ENV, "1")
    two_rows = torch.cat([args["q"], args["q"]], dim=2)
    assert triton_decode_probs(two_rows, *call[1:]) is None
    assert triton_decode_probs(args["q"].double(), *call[1:]) is None  # q and pools of two dtypes
    monkeypatch.setattr(paged_probs, "TRITON_PROBS", False)
    assert triton_decode_probs(*call) is None
    monkeypatch.setattr(paged_probs, "TRITON_PROBS", True)
    assert triton_decode_probs(*call) is not None
    with pytest.raises(ValueError, match="num_splits"):
        tpp.paged_probs_triton(*call, num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_matches_the_halves(dtype, monkeypatch):
    """On a GPU (run with TRITON_INTERPRET=0 to compile the kernels): the dispatch takes the kernel, which
    equals the halves on the same CUDA tensors, with the splits it picks and with one."""
    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    for case in (*CASES, PagedCase(4, 8, 4, 1, 2000, 128, layout="holes", runs=5)):
        args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.make(dtype).items()}
        want_p, want_vis, want_out = halves(args)
        call = (args["q"], args["k_pool"], args["v_pool"], args["table"], args["lengths"], args["scale"])
        got = triton_decode_probs(*call)
        assert got is not None
        for out, probs, vis in (got, tpp.paged_probs_triton(*call, num_splits=1)):
            torch.testing.assert_close(probs, want_p, rtol=PROB_TOL[dtype], atol=PROB_TOL[dtype])
            assert_close_tol(out, want_out, OUT_TOL, dtype)
            assert want_vis is None or torch.equal(vis, want_vis)


@pytest.mark.gpu
def test_cuda_kernels_do_not_recompile_as_the_table_grows(monkeypatch):
    """A decode's table grows a column a step; the kernels compiled for the first width serve every later
    one (widths crossing multiples of 16), at a fixed split count."""
    import dataclasses

    from vlkv.plugins.paged_probs_kernels import paged_probs_kernel, probs_normalise_kernel

    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    base = PagedCase(2, 2, 4, 1, 140, 64, layout="holes", runs=2)
    counts = []
    for cols in range(95, 141):  # 96, 112, 128 divisible by 16
        case = dataclasses.replace(base, cols=cols)
        args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.make(torch.bfloat16).items()}
        want_p, _, want_out = halves(args)
        call = (args["q"], args["k_pool"], args["v_pool"], args["table"], args["lengths"], args["scale"])
        out, probs, _ = tpp.paged_probs_triton(*call, num_splits=2)
        tol = PROB_TOL[torch.bfloat16]
        torch.testing.assert_close(probs, want_p, rtol=tol, atol=tol)
        assert_close_tol(out, want_out, OUT_TOL, torch.bfloat16)
        counts.append(compiled_variants(paged_probs_kernel) + compiled_variants(probs_normalise_kernel))
    assert counts[-1] == counts[0], counts
