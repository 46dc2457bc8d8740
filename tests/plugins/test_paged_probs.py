"""A paged decode step in two halves (probabilities, then P·V) equals the reference, per row and head."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import APPENDS, BIG, CASES, ROPE, PagedCase
from vlkv.plugins.paged_cpu import paged_attention_cpu, plan_for
from vlkv.plugins.paged_probs import decode_route, paged_decode_out, paged_decode_probs
from vlkv.plugins.paged_reference import paged_attention_reference, rotate_keys
from vlkv.runtime.op_count import count_ops

DECODE = [c for c in (*CASES, BIG, *APPENDS, *ROPE) if c.queries == 1]
DECODE.append(PagedCase(3, 2, 3, 1, 81, 16, layout="runs", full=True))  # every row full: no mask


@pytest.fixture(autouse=True)
def _matmul_read(monkeypatch):
    """These tests read the matmul / gather forms: the fused kernel (on by default) is off here; its
    own tests turn it on (``fused_calls``, tests/plugins/test_paged_cpu_fused.py)."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)


def loop_probs(args) -> torch.Tensor:
    """(B, H_kv, G, C) float64: each row's softmax over its held columns, written out per row and head."""
    q, k_pool, table, lengths = args["q"], args["k_pool"], args["table"], args["lengths"]
    b_, hq = q.shape[:2]
    hk, cols = k_pool.shape[0], table.shape[2]
    g = hq // hk
    out = torch.zeros(b_, hk, g, cols, dtype=torch.float64)
    for b in range(b_):
        for h in range(hk):
            held = [c for c in range(int(lengths[b, h])) if table[b, h, c] >= 0]
            if not held:
                continue
            k = k_pool[h, table[b, h, held]]
            if "rot" in args:
                k = rotate_keys(k, args["rot"][b, h, held], args["cos"], args["sin"])
            s = q[b, h * g : (h + 1) * g, 0].double() @ k.double().T * args["scale"]
            out[b, h, :, held] = torch.softmax(s, -1)
    return out


@pytest.mark.parametrize("inplace_min", [1, None], ids=["in-place", "gathered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE, ids=repr)
def test_paged_decode_halves_match_the_reference(case, dtype, inplace_min):
    args = case.make(dtype)
    rope = {k: args[k] for k in ("rot", "cos", "sin") if k in args}
    probs, vis = paged_decode_probs(
        args["q"],
        args["k_pool"],
        args["table"],
        args["lengths"],
        args["scale"],
        **rope,
        inplace_min=inplace_min,
    )
    assert probs.dtype == torch.float32 and (vis is None) == case.full
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(probs.double(), loop_probs(args), rtol=tol, atol=tol)
    out = paged_decode_out(probs, args["v_pool"], args["table"], args["lengths"], inplace_min=inplace_min)
    got = out.reshape(args["q"].shape).to(dtype)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)


@pytest.mark.parametrize("case", DECODE, ids=repr)
def test_a_route_from_host_lengths_reads_nothing_back_and_gathers(case):
    """Routing from the caller's host lengths (and whether any row may have a hole) reads nothing back,
    on ragged and holey tables alike (a decode step routes every layer: a read there is a host sync per
    layer), and gives the same probabilities and output as the device's route with every request
    gathered, bit for bit; its mask is the device's, or all-True where the device's is None (every
    column held: the mask changes nothing)."""
    args = case.make(torch.float32)
    rope = {k: args[k] for k in ("rot", "cos", "sin") if k in args}
    table, lengths = args["table"], args["lengths"]
    cols = torch.arange(table.shape[2])
    holes = bool(((table < 0) & (cols < lengths.clamp(0, table.shape[2])[..., None])).any())
    q, k_pool, v_pool, scale = args["q"], args["k_pool"], args["v_pool"], args["scale"]
    gathered = 1 << 30  # no request is read in place
    want_p, want_vis = paged_decode_probs(q, k_pool, table, lengths, scale, **rope, inplace_min=gathered)
    want = paged_decode_out(want_p, v_pool, table, lengths, inplace_min=gathered)
    host = lengths.tolist()
    for told in sorted({holes, True}):  # the exact answer, and the safe one (a hole is possible)
        with count_ops() as c:
            route = decode_route(table, lengths, host=host, holes=told)
        assert c.syncs == 0, dict(c.kinds)
        assert not route.inplace
        probs, vis = paged_decode_probs(q, k_pool, table, lengths, scale, **rope, route=route)
        assert torch.equal(probs, want_p)
        if want_vis is None:
            assert vis is None or bool(vis.all())
        else:
            assert torch.equal(vis, want_vis)
        assert torch.equal(paged_decode_out(probs, v_pool, table, lengths, route=route), want)


@pytest.mark.parametrize("inplace_min", [1, None], ids=["in-place", "gathered"])
@pytest.mark.parametrize("case", [c for c in (*CASES, BIG, *APPENDS) if not c.rope], ids=repr)
def test_a_cpu_plan_from_host_lengths_reads_as_the_device_plan(case, inplace_min):
    """The CPU read planned from host lengths (and whether a row has a hole) gives the same output as
    the plan that reads them back, on ragged and holey tables, decode rows and prefill chunks."""
    args = case.make(torch.float32)
    table, lengths = args["table"], args["lengths"]
    cols = torch.arange(table.shape[2])
    holes = bool(((table < 0) & (cols < lengths.clamp(0, table.shape[2])[..., None])).any())
    q, k_pool, v_pool, scale = args["q"], args["k_pool"], args["v_pool"], args["scale"]
    want = paged_attention_cpu(q, k_pool, v_pool, table, lengths, scale, inplace_min=inplace_min)
    host = lengths.tolist()
    for told in sorted({holes, True}):
        plan = plan_for(q, k_pool, table, lengths, inplace_min=inplace_min, host=host, holes=told)
        got = paged_attention_cpu(q, k_pool, v_pool, table, lengths, scale, plan=plan)
        assert torch.equal(got, want), (told, (got - want).abs().max())
