"""A statistics decode step by the fused CPU kernel: the output and each row's probabilities from ONE
read of each (request, KV head)'s own slot row (``paged_probs.fused_decode_probs``).

What must hold: the probabilities equal the float64 loop (``loop_probs``) and the two-halves form
(``paged_decode_probs``) within fp32 tolerances, exactly 0 at holes, past a head's length and in an
empty row; the output equals ``paged_reference`` (``OUT_TOL``); the visibility mask is the halves' one
(from the device, or from host lengths); on ragged batches with holes and per-head lengths, shared runs
and appends, GQA 1/3/5/7, head sizes 40/64/128 and small generic ones; nothing is gathered and the
kernel reads each held entry once; calls the kernel does not read (off, bf16 pools, two query rows)
return None, so the caller keeps the halves.
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.plugins.paged_cpu_kernel as kernel
from tests.plugins.cases import OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import APPENDS, BIG, CASES, PagedCase
from tests.plugins.test_paged_heads import HEADS
from tests.plugins.test_paged_probs import loop_probs
from vlkv.plugins.paged_probs import fused_decode_probs, paged_decode_probs
from vlkv.plugins.paged_reference import held_columns, paged_attention_reference

# decode rows over per-head tables (HEADS), shared runs, appends and the generic small head sizes of
# CASES (D 8/16); a full table (no mask) and a GQA group the kernel does not unroll (G = 9)
DECODE = [c for c in (*HEADS, *CASES, BIG, *APPENDS) if c.queries == 1 and not c.rope]
DECODE += [
    PagedCase(3, 2, 3, 1, 81, 64, layout="runs", full=True),
    PagedCase(2, 1, 9, 1, 81, 64, layout="holes", runs=2),
    PagedCase(4, 3, 3, 1, 300, 64, layout="holes", runs=4),
    # the unrolled GQA groups 2, 4 and 8 (common models' shapes) at both unrolled head sizes
    PagedCase(3, 2, 2, 1, 81, 128, layout="holes", runs=2),
    PagedCase(2, 2, 4, 1, 81, 64, layout="perhead"),
    PagedCase(2, 1, 8, 1, 97, 128, layout="holes", runs=3),
]
# fp32 softmax of fp32 dot products against the float64 loop: a few ulps of the largest probability
PROB_TOL = 1e-5


@pytest.fixture
def fused(monkeypatch):
    """The fused kernel on; counts the bytes the CPU read gathers into scratch and the held entries
    each probabilities call of the kernel reads."""
    assert kernel.kernel() is not None, (
        "the fused CPU decode kernel did not build (is a C++ compiler installed?)"
    )
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    seen = {"gathered": 0, "held": []}
    real_gather, real_probs = paged_cpu._gather, kernel.table_attention_probs

    def gather(pool, flat, out=None):
        seen["gathered"] += flat.numel() * pool.shape[-1] * pool.element_size()
        return real_gather(pool, flat, out)

    def probs(qs, k_pool, v_pool, table, lengths):
        seen["held"].append(int(held_columns(table, lengths).sum()))
        return real_probs(qs, k_pool, v_pool, table, lengths)

    monkeypatch.setattr(paged_cpu, "_gather", gather)
    monkeypatch.setattr(kernel, "table_attention_probs", probs)
    return seen


def _host(args) -> tuple[list[list[int]], bool]:
    table, lengths = args["table"], args["lengths"]
    cols = torch.arange(table.shape[2])
    holes = bool(((table < 0) & (cols < lengths.clamp(0, table.shape[2])[..., None])).any())
    return lengths.tolist(), holes


@pytest.mark.parametrize("case", DECODE, ids=repr)
def test_kernel_probabilities_and_output_match_the_reference(case, fused, monkeypatch):
    args = case.make(torch.float32)
    q, k_pool, v_pool, table, lengths = (args[k] for k in ("q", "k_pool", "v_pool", "table", "lengths"))
    got = fused_decode_probs(q, k_pool, v_pool, table, lengths, args["scale"])
    assert got is not None
    out, probs, vis = got
    assert probs.dtype == torch.float32 and probs.shape == (
        *table.shape[:2],
        q.shape[1] // k_pool.shape[0],
        table.shape[2],
    )
    want = loop_probs(args)
    torch.testing.assert_close(probs.double(), want, rtol=PROB_TOL, atol=PROB_TOL)
    held = held_columns(table, lengths.clamp(0, table.shape[2]))
    assert bool((probs.masked_select(~held[:, :, None, :].expand_as(probs)) == 0).all())  # holes, padding
    rows = held.any(-1)
    if bool(rows.any()):  # every held row's probabilities sum to one
        sums = probs.sum(-1)[rows]
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)
    assert_close_tol(out, paged_attention_reference(**args), OUT_TOL, torch.float32)
    # nothing gathered; the kernel read each held entry once, in one call
    assert fused["gathered"] == 0 and fused["held"] == [int(held.sum())]
    # the two halves (the matmul form, the kernel off) give the same probabilities and mask
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    halves, halves_vis = paged_decode_probs(q, k_pool, table, lengths, args["scale"])
    torch.testing.assert_close(probs, halves, rtol=PROB_TOL, atol=PROB_TOL)
    assert (vis is None) == (halves_vis is None) == case.full
    assert vis is None or torch.equal(vis, halves_vis)


@pytest.mark.parametrize("case", DECODE, ids=repr)
def test_kernel_mask_from_host_lengths_equals_the_device_one(case, fused):
    """Told the lengths as Python ints (and whether a hole may exist, the exact answer and the safe
    one), the kernel call gives the same probabilities and mask as the one reading them back."""
    args = case.make(torch.float32)
    call = [args[k] for k in ("q", "k_pool", "v_pool", "table", "lengths", "scale")]
    _, want_p, want_vis = fused_decode_probs(*call)
    host, holes = _host(args)
    for told in sorted({holes, True}):
        _, probs, vis = fused_decode_probs(*call, host=host, holes=told)
        assert torch.equal(probs, want_p)
        assert (vis is None) == (want_vis is None)
        assert vis is None or torch.equal(vis, want_vis)


def test_calls_the_kernel_does_not_read_return_none(fused, monkeypatch):
    """Off, bf16 pools, two query rows: None (the caller keeps the two halves); nothing is read."""
    case = PagedCase(2, 2, 3, 1, 81, 64, layout="holes", runs=2)
    args = case.make(torch.float32)
    call = {k: args[k] for k in ("q", "k_pool", "v_pool", "table", "lengths", "scale")}
    bf16 = {**call, "k_pool": call["k_pool"].bfloat16(), "v_pool": call["v_pool"].bfloat16()}
    assert fused_decode_probs(**bf16) is None
    two = {**call, "q": call["q"].expand(-1, -1, 2, -1).contiguous()}
    assert fused_decode_probs(**two) is None
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    assert fused_decode_probs(**call) is None
    assert fused["held"] == []


def test_a_bad_slot_is_one_clear_error(fused):
    case = PagedCase(2, 2, 3, 1, 9, 64)
    args = case.make(torch.float32)
    table = args["table"].clone()
    table[-1, 0, 0] = args["k_pool"].shape[1]  # one past the pool, inside the row's length
    with pytest.raises(RuntimeError, match="out of the pool"):
        fused_decode_probs(args["q"], args["k_pool"], args["v_pool"], table, args["lengths"], args["scale"])


@pytest.mark.parametrize(
    "bad",
    ["short v pool", "table of another batch", "int32 table", "float64 q"],
)
def test_the_kernel_refuses_shapes_and_dtypes_that_disagree(bad):
    """The C++ read trusts its pointers for every index: mismatched inputs must be one clear error,
    never a read past a buffer (a V pool shorter than K gave non-finite output before the check)."""
    assert kernel.kernel() is not None
    g = torch.Generator().manual_seed(0)
    r, h, grp, d, s = 2, 2, 3, 64, 50
    q = torch.randn(r, h, grp, d, generator=g)
    k_pool, v_pool = torch.randn(h, s, d, generator=g), torch.randn(h, s, d, generator=g)
    table = torch.randint(0, s, (r, h, 7), generator=g)
    lengths = torch.full((r, h), 7)
    if bad == "short v pool":
        v_pool = v_pool[:, :2].contiguous()
    elif bad == "table of another batch":
        table = table[:1].contiguous()
    elif bad == "int32 table":
        table = table.int()
    else:
        q = q.double()
    # (a float64 q meets torch's own dtype check on the output it allocates like q: also one line)
    with pytest.raises(RuntimeError, match="fused decode kernel|expected scalar type Float"):
        if bad == "int32 table":  # the Python wrappers cast tables to int64: the module's own entry
            kernel.kernel().table_rows(q, k_pool, v_pool, table, lengths)
        else:
            kernel.table_attention_probs(q, k_pool, v_pool, table, lengths)
    seg = torch.tensor([0]), torch.tensor([45]), torch.tensor([10])  # slots 45..54 of a 50-slot pool
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.segments_attention(q.float(), k_pool, k_pool, *seg)
