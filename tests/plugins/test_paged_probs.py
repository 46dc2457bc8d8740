"""A paged decode step in two halves (probabilities, then P·V) equals the reference, per row and head."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.test_paged_attention import APPENDS, BIG, CASES, ROPE, PagedCase
from vlkv.plugins.paged_probs import paged_decode_out, paged_decode_probs
from vlkv.plugins.paged_reference import paged_attention_reference, rotate_keys

DECODE = [c for c in (*CASES, BIG, *APPENDS, *ROPE) if c.queries == 1]
DECODE.append(PagedCase(3, 2, 3, 1, 81, 16, layout="runs", full=True))  # every row full: no mask


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
