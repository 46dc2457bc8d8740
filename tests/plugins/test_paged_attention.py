"""Paged attention: the reference against a per-row float64 loop; the CPU form, the Triton kernel (under
the interpreter) and the ``ops`` dispatch against the reference, over ragged rows, holes, GQA 1/3/7,
decode and prefill chunks, per-head and shared tables, and column counts on block edges (1, 9, 81, 729)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from tests.plugins.cases import DTYPES, OUT_TOL, assert_close_tol
from vlkv.plugins import ops
from vlkv.plugins.paged_cpu import paged_attention_cpu, shared_runs
from vlkv.plugins.paged_probs import paged_decode_probs
from vlkv.plugins.paged_reference import paged_attention_reference

tpa = pytest.importorskip("vlkv.plugins.triton_paged_attention", reason="triton is not installed")


@pytest.fixture(autouse=True)
def _matmul_read(monkeypatch):
    """These tests read the matmul / gather forms: the fused kernel (on by default) is off here; its
    own tests turn it on (``fused_calls``, tests/plugins/test_paged_heads.py)."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)


@dataclass(frozen=True)
class PagedCase:
    """q (B, G·H_kv, Q, D) over a pool (H_kv, S, D); each request's row of ``cols`` table columns.

    layout: "perhead" (every head its own random slots), "runs" (the same ascending runs in every
    head: what the pool hands out), "appends" (one run, then 5 single slots: decode appends in a fixed
    pool), "holes" (runs with holes, ragged head lengths).
    """

    batch: int
    kv_heads: int
    group: int
    queries: int
    cols: int
    dim: int
    layout: str = "perhead"
    runs: int = 1
    full: bool = False  # every row holds all `cols` entries (no padding, no empty row)
    rope: int = 0  # > 0: about half the entries pre-RoPE, rotated on read over this many dims

    def make(self, dtype: torch.dtype, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        b, h, c = self.batch, self.kv_heads, self.cols
        slots = b * c + 11  # spare slots: the requests do not tile the pool
        q = torch.randn(b, h * self.group, self.queries, self.dim, generator=g).to(dtype)
        k_pool = torch.randn(h, slots, self.dim, generator=g).to(dtype)
        v_pool = torch.randn(h, slots, self.dim, generator=g).to(dtype)
        if self.layout == "perhead":
            table = torch.stack([torch.randperm(slots, generator=g)[:c] for _ in range(b * h)]).view(b, h, c)
            lengths = torch.randint(0, c + 1, (b, h), generator=g)
        else:
            # request r's columns as `runs` ascending runs, shuffled across the pool, the same per head
            perm = torch.randperm(b, generator=g)
            rows = []
            for r in range(b):
                base = torch.arange(int(perm[r]) * c, int(perm[r]) * c + c)
                if self.layout == "appends":  # a prompt's run, then appends one slot each (descending)
                    rows.append(torch.cat([base[: c - 5], base[c - 5 :].flip(0)]))
                    continue
                pieces = list(base.tensor_split(self.runs))
                order = torch.randperm(len(pieces), generator=g).tolist()
                rows.append(torch.cat([pieces[i] for i in order]))
            table = torch.stack(rows)[:, None].expand(b, h, c).contiguous()
            lengths = torch.randint(0, c + 1, (b, 1), generator=g).expand(b, h).contiguous()
        lengths[-1] = c
        if self.full:
            lengths.fill_(c)
        if not self.full:
            lengths[0, 0] = 0  # an empty row: its query heads must be zeros
        if self.layout == "holes":
            hole = (torch.rand(b, h, c, generator=g) < 0.2) & (torch.arange(c) > 0)
            table = torch.where(hole, torch.full_like(table, -1), table)
            lengths = (lengths - torch.randint(0, 2, (b, h), generator=g)).clamp_min(0)
        # padding past a row's length may hold anything, including slots out of range
        pad = torch.arange(c)[None, None, :] >= lengths[..., None]
        table = torch.where(pad, torch.full_like(table, 10**6), table)
        args = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "table": table, "lengths": lengths}
        args["scale"] = self.dim**-0.5
        if self.rope:
            args.update(rope_rows(self.rope, b, h, c, g))
            # padding and holes may name any row, out of range included: they are never read
            args["rot"] = torch.where(pad | (table < 0), 10**6, args["rot"])
        return args


def rope_rows(rot_dims: int, b: int, h: int, c: int, g: torch.Generator, rows: int = 20) -> dict:
    """``rot (B, H_kv, C)``: a random row of 20 for about half the entries, -1 (post-RoPE) for the rest;
    ``cos, sin (20, rot_dims)`` in HF's layout."""
    theta = torch.rand(rows, rot_dims // 2, generator=g) * 100
    rot = torch.randint(0, rows, (b, h, c), generator=g)
    rot = torch.where(torch.rand(b, h, c, generator=g) < 0.5, rot, -1)
    return {"rot": rot, "cos": theta.cos().repeat(1, 2), "sin": theta.sin().repeat(1, 2)}


CASES = (
    PagedCase(1, 1, 1, 1, 1, 16),
    PagedCase(2, 2, 3, 1, 9, 8),
    PagedCase(3, 1, 7, 3, 9, 40),
    PagedCase(2, 3, 3, 1, 81, 64, layout="runs", runs=3),
    PagedCase(2, 2, 1, 5, 81, 16, layout="holes", runs=2),
    PagedCase(2, 3, 3, 4, 81, 32, layout="runs", runs=1),
)
BIG = PagedCase(2, 2, 3, 1, 729, 64, layout="runs", runs=2)
APPENDS = (PagedCase(3, 2, 3, 1, 81, 16, layout="appends"), PagedCase(2, 3, 1, 6, 81, 8, layout="appends"))
# pre-RoPE entries: every dim rotated, and partial rotary (the first 8 of 16/40 dims)
ROPE = (
    PagedCase(2, 2, 3, 1, 81, 16, layout="runs", rope=16),
    PagedCase(3, 1, 7, 3, 9, 40, layout="holes", runs=2, rope=8),
    PagedCase(2, 3, 1, 2, 81, 16, rope=8),
)


def loop_reference(q, k_pool, v_pool, table, lengths, scale) -> torch.Tensor:
    """One float64 softmax per (request, query head, query row) over the slots it sees: the spec."""
    batch, heads, num_q, _ = q.shape
    group = heads // k_pool.shape[0]
    out = torch.zeros(batch, heads, num_q, v_pool.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for j in range(heads):
            h = j // group
            n = int(lengths[b, h])
            for i in range(num_q):
                ids = [int(s) for s in table[b, h, : max(0, n - num_q + i + 1)] if s >= 0]
                if not ids:
                    continue
                k, v = k_pool[h, ids].double(), v_pool[h, ids].double()
                p = torch.softmax(k @ q[b, j, i].double() * scale, dim=0)
                out[b, j, i] = p @ v
    return out


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


def compiled_variants(kernel) -> int:
    """How many binaries Triton has compiled for ``kernel`` (a JITFunction) on any device: the first
    element of each device's cache entry is its kernel dict (Triton 3.x)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


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
