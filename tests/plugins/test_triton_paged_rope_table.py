"""Pre-RoPE keys rotated on read by a rotary *table* (the static decode step's form, ``runtime/kv/rope_table``)
in the Triton paged read and the Triton statistics kernel, under the interpreter, against the references'
row form (one ``cos/sin`` row per entry, ``rope_table.table_as_rows``): 1-D RoPE (row = position) and
M-RoPE (per dim the position component of its section), ragged rows with holes, one split and several,
fp32 and bf16; positions past the table read its last row (no read outside it)."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.cases import OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import PagedCase
from vlkv.plugins.paged_probs import paged_decode_probs
from vlkv.plugins.paged_reference import paged_attention_reference
from vlkv.runtime.kv.rope_table import RopeTable, table_as_rows

tpa = pytest.importorskip("vlkv.plugins.triton_paged_attention", reason="triton is not installed")
tpp = pytest.importorskip("vlkv.plugins.triton_paged_probs", reason="triton is not installed")

CASES = (
    PagedCase(2, 2, 3, 1, 81, 16, layout="holes", runs=2),  # GQA 3, holes, ragged head lengths
    PagedCase(3, 1, 4, 1, 9, 8),  # per-head random slots, an empty row
)
ROWS = 64  # the table's positions
# probabilities: fp32 sums of the same products (the rotated bf16 key rounded to nearest-even in the
# kernel, as torch rounds it: Triton's interpreter alone would round toward zero)
PROB_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


def _table(dims: int, rot_dims: int, dtype, g) -> RopeTable:
    """A random table of ``ROWS`` positions (HF's layout: the angles repeated over the two halves); with
    ``dims`` 3 components, sections of 1, 2 and the rest of the half (as Qwen2-VL's, doubled)."""
    theta = torch.rand(ROWS, rot_dims // 2, generator=g) * 100
    sec = None
    if dims > 1:
        half = torch.tensor([0] + [1] * 2 + [2] * (rot_dims // 2 - 3))
        sec = torch.cat([half, half])
    return RopeTable(theta.cos().repeat(1, 2).to(dtype), theta.sin().repeat(1, 2).to(dtype), sec)


def _positions(args: dict, dims: int, g) -> torch.Tensor:
    """``rot (B, H_kv, C, P)``: random positions for about half the held entries (one past the table
    among them), ``-1`` for the rest."""
    b, h, c = args["table"].shape
    rot = torch.randint(0, ROWS, (b, h, c, dims), generator=g)
    rot[0, 0, 0] = ROWS + 5  # past the table: its last row
    on = torch.rand(b, h, c, generator=g) < 0.5
    return torch.where(on[..., None], rot, -1)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims", [1, 3], ids=["rope-1d", "mrope"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_a_table_read_equals_the_row_form(case, dims, dtype, num_splits):
    g = torch.Generator().manual_seed(1)
    args = case.make(dtype)
    table = _table(dims, 8 if case.dim == 16 else case.dim, dtype, g)
    rot4 = _positions(args, dims, g)
    rows, cos, sin = table_as_rows(rot4, table)
    assert torch.equal(table_as_rows(rot4.clamp_max(ROWS - 1), table)[1], cos)  # clamped to the last row
    want = paged_attention_reference(**args, rot=rows, cos=cos, sin=sin)
    assert not torch.allclose(want.float(), paged_attention_reference(**args).float())  # rotation matters
    rope = dict(rot=rot4, cos=table.cos, sin=table.sin, sec=table.sec)
    if dims == 1:  # 1-D: the eager kernel form itself, rows of the table named by position
        rope = dict(rot=rot4[..., 0], cos=table.cos, sin=table.sin)
    got = tpa.paged_attention_triton(**args, num_splits=num_splits, **rope)
    assert_close_tol(got, want, OUT_TOL, dtype)
    if case.queries == 1:  # the statistics kernel: one query row
        q, k_pool, v_pool, tab, lengths = (args[n] for n in ("q", "k_pool", "v_pool", "table", "lengths"))
        out, probs, _ = tpp.paged_probs_triton(
            q, k_pool, v_pool, tab, lengths, args["scale"], num_splits=num_splits, **rope
        )
        want_p, _ = paged_decode_probs(q, k_pool, tab, lengths, args["scale"], rot=rows, cos=cos, sin=sin)
        torch.testing.assert_close(probs, want_p, rtol=PROB_TOL[dtype], atol=PROB_TOL[dtype])
        assert_close_tol(out, want, OUT_TOL, dtype)


def test_the_table_form_checks_its_arguments():
    args = PagedCase(2, 2, 3, 1, 9, 8).make(torch.float32)
    table = _table(3, 8, torch.float32, torch.Generator().manual_seed(0))
    rot4 = torch.full((*args["table"].shape, 3), -1)
    with pytest.raises(ValueError, match="needs rot"):
        tpa.paged_attention_triton(**args, rot=rot4[..., 0], cos=table.cos, sin=table.sin, sec=table.sec)
    with pytest.raises(ValueError, match="sec must be int64"):
        tpa.paged_attention_triton(**args, rot=rot4, cos=table.cos, sin=table.sin, sec=table.sec[:4])
    with pytest.raises(ValueError, match="RopeTable.sec"):
        RopeTable(table.cos, table.sin, table.sec.int())


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
def test_the_append_writes_each_pre_rope_columns_positions_beside_the_read_table(holes):
    """``decode_append_(rot_out=...)``: per request and head, each column below the new one whose slot is
    flagged pre-RoPE (and not a hole) gets its ``P`` positions, every other column up to the width ``-1``
    in every component; the read table is the reference's."""
    from tests.plugins.test_paged_append_triton import B, D, H, P, S, _meta, _tables
    from vlkv.plugins import paged_append_triton as tri

    g = torch.Generator().manual_seed(3)
    caps, cols = [9, 40, 17], [4, 37, 0]
    tables = _tables(g, caps, holes)
    k_pool, v_pool = torch.randn(H, S, D, generator=g), torch.randn(H, S, D, generator=g)
    ids = torch.randperm(S, generator=g)[: H * B].view(H, B)
    prerope = torch.rand(H, S, generator=g) < 0.5
    prerope[torch.arange(H)[:, None], ids] = False  # the new slots' flags (cleared by the launch) are off
    flags = prerope.clone()
    k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    pos, order = torch.randint(0, 99, (B, P), generator=g), torch.randint(0, 99, (B,), generator=g)
    mod = torch.zeros(B, dtype=torch.int8)
    width = max(cols) + 3
    want = tri.decode_append_reference(
        k_pool, v_pool, prerope, k, v, tables, cols, ids, pos, mod, order, width
    )
    out = torch.full((B, H, width), 7, dtype=torch.long)
    rot = torch.full((B, H, width, P), 7, dtype=torch.long)
    meta = _meta(tables, cols, [-1] * B)
    tri.decode_append_(k_pool, v_pool, prerope, k, v, meta, 1, pos, mod, order, ids=ids, out=out, rot_out=rot)
    seen = torch.arange(width)[None, None, :] < torch.tensor(cols)[:, None, None] + 1
    assert torch.equal(out[seen.expand_as(out)], want[4][seen.expand_as(out)])
    some = False
    for b, (t, p) in enumerate(zip(want[3], cols)):
        for h in range(H):
            for c in range(width):
                slot = int(want[4][b, h, c])
                on = c < p and slot >= 0 and bool(flags[h, slot])
                some |= on
                expect = t["positions"][0, h, c] if on else torch.full((P,), -1)
                assert torch.equal(rot[b, h, c], expect), (b, h, c)
    assert some
    with pytest.raises(ValueError, match="rot_out must be int64"):
        tri.decode_append_(k_pool, v_pool, prerope, k, v, meta, 1, pos, mod, order, ids=ids, rot_out=rot)


@pytest.mark.gpu
def test_on_cuda_the_compiled_table_read_equals_the_row_form():
    """On a GPU (TRITON_INTERPRET=0: compiled): the paged read and the statistics kernel, bf16, 1-D and
    M-RoPE table forms, one case (four compiled variants: a few seconds of the check's pytest part)."""
    case = CASES[0]
    for dims in (1, 3):
        g = torch.Generator().manual_seed(2)
        args = case.make(torch.bfloat16)
        table = _table(dims, 8, torch.bfloat16, g)
        rot4 = _positions(args, dims, g)
        rows, cos, sin = table_as_rows(rot4, table)
        want = paged_attention_reference(**args, rot=rows, cos=cos, sin=sin)
        want_p, _ = paged_decode_probs(
            args["q"],
            args["k_pool"],
            args["table"],
            args["lengths"],
            args["scale"],
            rot=rows,
            cos=cos,
            sin=sin,
        )
        on = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        rope = dict(rot=rot4.cuda(), cos=table.cos.cuda(), sin=table.sin.cuda(), sec=table.sec)
        if dims == 1:
            rope = dict(rot=rot4[..., 0].cuda(), cos=table.cos.cuda(), sin=table.sin.cuda())
        else:
            rope["sec"] = table.sec.cuda()
        got = tpa.paged_attention_triton(**on, **rope)
        assert_close_tol(got.cpu(), want, OUT_TOL, torch.bfloat16)
        out, probs, _ = tpp.paged_probs_triton(
            on["q"], on["k_pool"], on["v_pool"], on["table"], on["lengths"], on["scale"], **rope
        )
        torch.testing.assert_close(probs.cpu(), want_p, rtol=1e-4, atol=1e-5)
        assert_close_tol(out.cpu(), want, OUT_TOL, torch.bfloat16)
