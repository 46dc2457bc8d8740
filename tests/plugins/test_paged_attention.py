"""Paged attention: the reference against a per-row float64 loop; the CPU form, the Triton kernel (under
the interpreter) and the ``ops`` dispatch against the reference, over ragged rows, holes, GQA 1/3/7,
decode and prefill chunks, per-head and shared tables, and column counts on block edges (1, 9, 81, 729)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from tests.plugins.paged_cases import APPENDS, BIG, CASES, ROPE, PagedCase, compiled_variants, loop_reference
from vlkv.plugins import ops
from vlkv.plugins.paged_cpu import paged_attention_cpu, shared_runs
from vlkv.plugins.paged_probs import paged_decode_probs
from vlkv.plugins.paged_reference import paged_attention_reference

tpa = pytest.importorskip("vlkv.plugins.triton_paged_attention", reason="triton is not installed")


@pytest.fixture(autouse=True)
def _matmul_read(monkeypatch):
    """These tests read the matmul / gather forms: the fused kernel (on by default) is off here; its
    own tests turn it on (``fused_calls``, tests/plugins/test_paged_cpu_fused.py)."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)


@pytest.mark.parametrize("case", (*CASES, BIG), ids=repr)
def test_reference_matches_loop(case):
    args = case.make(torch.float32)
    got = paged_attention_reference(**args)
    torch.testing.assert_close(got.double(), loop_reference(**args), rtol=1e-5, atol=1e-5)
    assert torch.all(got[0, : case.group] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", (*CASES, BIG, *APPENDS, *ROPE), ids=repr)
def test_cpu_form_matches_reference(case, dtype):
    args = case.make(dtype)
    want = paged_attention_reference(**args)
    # every request in place with every run a view; long runs in place, short ones gathered; every
    # request gathered and attended together (the default for requests this short)
    for inplace_min, run_min in ((1, 1), (1, 16), (None, None)):
        got = paged_attention_cpu(**args, run_min=run_min, inplace_min=inplace_min)
        assert got.dtype == dtype
        assert_close_tol(got, want, OUT_TOL, dtype)
        assert torch.all(got[0, : case.group] == 0)


@pytest.mark.parametrize("qk", [True, False], ids=["q@K^T", "K@q^T"])
@pytest.mark.parametrize("case", (*CASES, BIG, *APPENDS), ids=repr)
def test_cpu_form_both_score_forms_match_reference(case, qk, monkeypatch):
    """The in-place read's two score matmuls (``paged_cpu.SCORES_QK``) give the reference's result."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "SCORES_QK", qk)
    for dtype in (torch.float32, torch.bfloat16):
        args = case.make(dtype)
        got = paged_cpu.paged_attention_cpu(**args, run_min=16, inplace_min=1)
        assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", (*CASES, *APPENDS, *ROPE), ids=repr)
def test_triton_kernel_matches_reference(case, dtype, num_splits):
    args = case.make(dtype)
    got = tpa.paged_attention_triton(**args, num_splits=num_splits)
    assert got.dtype == dtype
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)
    assert torch.all(got[0, : case.group] == 0)


def test_triton_kernel_729_columns_auto_splits():
    args = BIG.make(torch.float16)
    got = tpa.paged_attention_triton(**args)
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float16)


def test_triton_kernel_reads_strided_pool_and_query():
    """A pool slice (another layer's rows around it) and a transposed q are read through their strides."""
    args = CASES[2].make(torch.float32)
    h, s, d = args["k_pool"].shape
    big = torch.randn(h, s + 7, d + 4)
    big[:, 3 : 3 + s, :d] = args["k_pool"]
    args["k_pool"] = big[:, 3 : 3 + s, :d]
    args["q"] = args["q"].transpose(1, 2).contiguous().transpose(1, 2)
    want = paged_attention_reference(**args)
    assert_close_tol(tpa.paged_attention_triton(**args, num_splits=1), want, OUT_TOL, torch.float32)
    assert_close_tol(paged_attention_cpu(**args), want, OUT_TOL, torch.float32)


def test_ops_dispatch_cpu_and_forced_triton(monkeypatch):
    args = CASES[3].make(torch.float32)
    want = paged_attention_reference(**args)
    assert_close_tol(ops.paged_attention(**args), want, OUT_TOL, torch.float32)
    monkeypatch.setenv(ops.FORCE_TRITON_ENV, "1")
    assert_close_tol(ops.paged_attention(**args), want, OUT_TOL, torch.float32)


def test_shared_runs_finds_runs_or_declines():
    row = torch.tensor([[5, 6, 7, 20, 21, 2], [5, 6, 7, 20, 21, 2]])
    assert shared_runs(row) == [(0, 3, 5), (3, 5, 20), (5, 6, 2)]
    assert shared_runs(torch.tensor([[5, 6], [5, 7]])) is None  # heads differ
    assert shared_runs(torch.tensor([[5, -1, 7]])) is None  # a hole


@pytest.mark.parametrize("form", ["reference", "cpu", "triton", "probs"])
def test_bad_shapes_name_the_argument(form):
    """Every form validates through ``check_paged_args``: the same one-line error for the same mistake."""
    args = CASES[1].make(torch.float32)
    if form == "probs":
        args["q"] = args["q"][:, :, -1:]

    def call(**over):
        a = {**args, **over}
        if form == "probs":
            return paged_decode_probs(a["q"], a["k_pool"], a["table"], a["lengths"], a["scale"], *a["rope"])
        fn = {"reference": paged_attention_reference, "cpu": paged_attention_cpu}.get(form)
        fn = fn or tpa.paged_attention_triton
        rot, cos, sin = a.pop("rope")
        return fn(**a, rot=rot, cos=cos, sin=sin)

    args["rope"] = (None, None, None)
    with pytest.raises(ValueError, match="lengths"):
        call(lengths=args["lengths"][:, :1])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        call(q=args["q"][:, :1])
    rot = torch.zeros_like(args["table"])
    cos = torch.ones(4, 3)
    with pytest.raises(ValueError, match="cos/sin width 3"):
        call(rope=(rot, cos, cos))
    with pytest.raises(ValueError, match="rot must be"):
        call(rope=(rot[:, :1], cos, cos))


def test_cpu_form_reads_runs_in_place(monkeypatch):
    """Requests whose slots are long shared runs are read as pool views: the gather is never called."""
    import vlkv.plugins.paged_cpu as paged_cpu

    def no_gather(*_):
        raise AssertionError("gathered a request whose slots are runs")

    args = dataclasses.replace(BIG, full=True).make(torch.float32)
    want = paged_attention_reference(**args)
    monkeypatch.setattr(paged_cpu, "_gather", no_gather)
    got = paged_cpu.paged_attention_cpu(**args, run_min=16, inplace_min=16)
    assert_close_tol(got, want, OUT_TOL, torch.float32)


def count_gathers(monkeypatch) -> list[int]:
    """The rows each ``paged_cpu._gather`` call copies, appended as the CPU form runs."""
    import vlkv.plugins.paged_cpu as paged_cpu

    gathered, real = [], paged_cpu._gather
    monkeypatch.setattr(
        paged_cpu,
        "_gather",
        lambda pool, flat, out=None: gathered.append(flat.numel()) or real(pool, flat, out),
    )
    return gathered


@pytest.mark.parametrize("case", APPENDS, ids=repr)
def test_cpu_form_gathers_only_the_short_runs(case, monkeypatch):
    """A prompt's run is read in place; only the appended single slots are gathered (5 per request), by
    one gather of K and one of V for every request."""
    import vlkv.plugins.paged_cpu as paged_cpu

    args = dataclasses.replace(case, full=True).make(torch.float32)
    gathered = count_gathers(monkeypatch)
    got = paged_cpu.paged_attention_cpu(**args, run_min=16, inplace_min=16)
    assert gathered == [5 * case.kv_heads * case.batch] * 2  # K and V of every request's appends
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)
    # equal lengths and appends (lockstep decode): the appends are one block, attended by one matmul
    plan = paged_cpu.plan_for(args["q"], args["k_pool"], args["table"], args["lengths"], 16, 16)
    assert plan.inplace.tail == 5
    for qk in (True, False):
        monkeypatch.setattr(paged_cpu, "SCORES_QK", qk)
        for dtype in (torch.float32, torch.bfloat16):
            args = dataclasses.replace(case, full=True).make(dtype)
            got = paged_cpu.paged_attention_cpu(**args, run_min=16, inplace_min=16)
            assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_dispatch_matches_reference(dtype, monkeypatch):
    """On a GPU (run with TRITON_INTERPRET=0 to compile the kernel): ops.paged_attention takes the kernel."""
    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    for case in (*CASES, *APPENDS, *ROPE, BIG):
        args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.make(dtype).items()}
        assert ops.use_triton(args["q"])
        for splits in (None, 1):
            got = ops.paged_attention(**args, num_splits=splits)
            assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, dtype)


@pytest.mark.gpu
def test_cuda_kernel_does_not_recompile_as_the_table_grows(monkeypatch):
    """A decode's table grows a column a step; the kernel compiled for the first width serves every later
    one (widths crossing multiples of 16, lengths 1 and full), at a fixed split count."""
    from vlkv.plugins.paged_attention_kernels import paged_attention_kernel

    monkeypatch.delenv(ops.FORCE_TRITON_ENV, raising=False)
    base = PagedCase(2, 2, 4, 1, 140, 64, layout="runs")
    counts = []
    for cols in range(95, 141):  # 96, 112, 128 divisible by 16
        args = {
            k: v.cuda() if torch.is_tensor(v) else v
            for k, v in dataclasses.replace(base, cols=cols).make(torch.bfloat16).items()
        }
        got = tpa.paged_attention_triton(**args, num_splits=2)
        assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.bfloat16)
        counts.append(compiled_variants(paged_attention_kernel))
    assert counts[-1] == counts[0], counts


# (layouts where no two requests hold one slot: a slot stored rotated has one position)
@pytest.mark.parametrize("case", [c for c in ROPE if c.layout != "perhead"], ids=repr)
def test_rotated_on_read_equals_keys_stored_rotated(case):
    """Reading pre-RoPE keys through ``rot`` equals reading a pool where they were stored rotated, by
    the HF formula written out here (``k·cos + rotate_half(k)·sin`` on the first D_r dims)."""
    args = case.make(torch.float64)
    rot, cos, sin = args.pop("rot"), args.pop("cos"), args.pop("sin")
    dr = cos.shape[-1]
    k = args["k_pool"].clone()
    heads = torch.arange(case.kv_heads)[None, :, None].expand_as(rot)
    held = (args["table"] >= 0) & (torch.arange(case.cols) < args["lengths"][..., None]) & (rot >= 0)
    for hd, slot, row in zip(
        heads[held].tolist(), args["table"][held].tolist(), rot[held].tolist(), strict=True
    ):
        x = args["k_pool"][hd, slot, :dr]
        half = torch.cat([-x[dr // 2 :], x[: dr // 2]])
        k[hd, slot, :dr] = x * cos[row] + half * sin[row]
    want = paged_attention_reference(**{**args, "k_pool": k})
    got = paged_attention_reference(**args, rot=rot, cos=cos, sin=sin)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, paged_attention_reference(**args))  # the rotation mattered


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_aot_entry_matches_reference(dtype):
    """The TensorRT AOT entry (contiguous tensors, int32 shape scalars, one split) under the interpreter."""
    from vlkv.plugins.paged_attention_kernels import paged_attention_aot_kernel
    from vlkv.plugins.triton_launch import dot_in_fp32

    case = CASES[4]
    args = case.make(dtype)
    q = args["q"]
    out = torch.empty_like(q)
    heads, slots = q.shape[1], args["k_pool"].shape[1]
    paged_attention_aot_kernel[(case.batch * case.kv_heads, -(-case.group * case.queries // 16))](
        q, args["k_pool"], args["v_pool"], args["table"], args["lengths"],
        heads, case.kv_heads, case.queries, slots, case.dim, case.cols, out,
        SCALE=args["scale"], IEEE=dot_in_fp32(dtype), BLOCK_M=16, BLOCK_N=64, BLOCK_D=16,
    )  # fmt: skip
    assert_close_tol(out, paged_attention_reference(**args), OUT_TOL, dtype)


def test_cpu_form_attends_short_requests_together(monkeypatch):
    """Requests below ``inplace_min`` (or with holes) are gathered by one call per K and V, whatever
    their number, and the result equals the reference."""
    import vlkv.plugins.paged_cpu as paged_cpu

    args = PagedCase(9, 2, 3, 1, 81, 16, layout="holes", runs=2).make(torch.float32)
    gathered = count_gathers(monkeypatch)
    got = paged_cpu.paged_attention_cpu(**args)
    assert len(gathered) == 2  # one gather of K, one of V, for all nine requests
    assert_close_tol(got, paged_attention_reference(**args), OUT_TOL, torch.float32)


@pytest.mark.parametrize("case", (*CASES, BIG, *APPENDS), ids=repr)
def test_cpu_plan_reused_by_other_layers_matches_reference(case):
    """One plan (built from the tables) read by several layers' pools and queries, as a decode step
    reuses it: each equals the reference of its own pool; the plan matches only the same tables."""
    from vlkv.plugins.paged_cpu import plan_for

    args = case.make(torch.float32)
    table, lengths = args["table"], args["lengths"]
    for inplace_min, run_min in ((1, 1), (16, 16), (None, None)):
        plan = plan_for(args["q"], args["k_pool"], table, lengths, run_min, inplace_min)
        for seed in (1, 2):
            layer = {**case.make(torch.float32, seed=seed), "table": table, "lengths": lengths}
            got = paged_attention_cpu(**layer, plan=plan)
            assert_close_tol(got, paged_attention_reference(**layer), OUT_TOL, torch.float32)
        group = case.group
        clamped = lengths.clamp(0, table.shape[-1])
        assert plan.matches(table.clone(), clamped, args["k_pool"].shape[1], case.queries, group)
        other = table.clone()
        other[-1, 0, 0] += 1
        assert not plan.matches(other, clamped, args["k_pool"].shape[1], case.queries, group)
        assert not plan.matches(table, clamped, args["k_pool"].shape[1] + 1, case.queries, group)


def test_cpu_plan_reused_only_for_the_same_tables():
    from vlkv.plugins.paged_cpu import plan_reused

    args = APPENDS[0].make(torch.float32)
    q, k_pool, table, lengths = args["q"], args["k_pool"], args["table"], args["lengths"]
    first = plan_reused(None, q, k_pool, table, lengths)
    assert plan_reused(first, q, k_pool, table.clone(), lengths.clone()) is first
    other = lengths.clone()
    other[-1, :] -= 1
    assert plan_reused(first, q, k_pool, table, other) is not first


def test_cpu_plan_refuses_rotated_calls_and_other_shapes():
    from vlkv.plugins.paged_cpu import plan_for

    args = ROPE[0].make(torch.float32)
    plan = plan_for(args["q"], args["k_pool"], args["table"], args["lengths"])
    with pytest.raises(ValueError, match="plan was built for other tables"):
        paged_attention_cpu(**args, plan=plan)
    plain = {k: v for k, v in args.items() if k not in ("rot", "cos", "sin")}
    with pytest.raises(ValueError, match="plan was built for other tables"):
        q = plain["q"]
        paged_attention_cpu(**{**plain, "q": torch.randn(q.shape[0], q.shape[1], 2, q.shape[3])}, plan=plan)
