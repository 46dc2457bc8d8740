"""The GPU check's ``kernels`` part, ``lowrank_split``: which split cut of the paged low-rank read is faster.

``triton_paged_lowrank.paged_lowrank_triton`` reads AttentionPack's factors in place through the slot
tables. Its ``chunk`` picks how a row's columns are cut among the launcher's splits (``paged_lowrank.
split_layout``): by default (``factored_chunk``) the factored span gets its own few splits, each walking at
least ``chunk`` columns, so the basis slices load once or twice a (request, KV head); ``chunk=1`` gives the
span its share of the splits whatever the basis loads cost (the byte-blind cut: more programs, shorter
loops, ~2.2x the span's dense bytes on Qwen2-VL-7B at batch 1). Only a GPU can say which is faster
(``docs/benchmarks/2026-11-28-lowrank-splits-cpu-x86_64/`` counts the bytes). Each cell times, at a 7B
model's decode shape (one query row a request):

- ``default``: the low-rank read with the launcher's cut; ``chunk1``: the same with ``chunk=1``;
- ``dense``: ``triton_paged_attention.paged_attention_triton`` over the same columns as dense pool
  entries (what a full cache reads, keys post-RoPE);

each as a CUDA graph of ``GRAPH_CALLS`` calls (the static step's form: the host half out of the time),
and as eager calls (events around one call: the launcher's host work included), the three interleaved
(``gpu_timing.interleaved_ms``), medians. Rows: each request's image is one contiguous factored span
(AttentionPack factors an image block), text before and after it dense; AttentionPack's defaults
(``AttnPackPolicy``: rank 64 stored for keys and values, a quarter of the rows rebuilt at 64, the rest at
``rank_lo`` 16, keys too: ``lo_keys``); path (a): factored keys pre-RoPE, rotated on read with the model's
own rotary form (Qwen2-VL M-RoPE, the table form with sections 16/24/24; LLaVA 1-D), as the static step
reads them. Each result is checked against its reference (``paged_lowrank_reference`` /
``paged_attention_reference``) within :data:`TOL`. With ``--tiny`` (the CPU dry run, Triton's
interpreter): toy shapes, eager calls only.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial

import torch
from gpu_timing import interleaved_ms

# |got - want| <= atol + rtol·|want| (the paged read's tolerances in tests/plugins/cases.OUT_TOL: the kernel
# accumulates values in the rank space where the reference rounds each rebuilt value)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
GRAPH_CALLS = (
    20  # calls one graph replays: a replay of ~20 µs kernels is then far above the event's resolution
)
# batch > 1 cells run only while the part has used less than this share of its limit (the kernels part's
# earlier entries and this one's compiles come first: run 7's part took 14 of its 40 s)
LATER_CELLS_SHARE = 0.55


@dataclass(frozen=True)
class Cell:
    """One measured shape: ``kv_heads`` KV heads of ``dim`` dims, ``group`` query heads each; request ``i``
    holds ``lengths[i]`` columns, its image the factored span ``[before, before + image)``; factors of
    ``rank`` components, a quarter of the rows rebuilt at ``rank``, the rest at ``rank // 4``.
    ``splits``: None for the launcher's default split count."""

    model: str
    kv_heads: int
    group: int
    dim: int
    before: int
    image: int
    lengths: tuple[int, ...]
    mrope: bool
    rank: int = 64
    splits: int | None = None

    def __post_init__(self) -> None:
        if min(self.lengths) < self.before + self.image or self.image < 1 or self.rank < 4:
            raise ValueError(f"Cell: every row must hold its image span and rank >= 4, got {self}")


QWEN, LLAVA = (
    dict(model="qwen2-vl-7b", kv_heads=4, group=7, dim=128, mrope=True),
    dict(model="llava-1.5-7b", kv_heads=32, group=1, dim=128, mrope=False),
)
# most informative first (Qwen2-VL-7B batch 1: 20 splits, the cuts' bytes 0.44x against 2.22x dense); batch 4:
# longer conversations after the image (the byte count's rows, bytes.py). Not LLaVA-1.5-7B at batch 4: its
# launcher picks 2 splits there and both cuts give the span one (the same cut, nothing to compare)
CELLS = (
    Cell(**QWEN, before=16, image=576, lengths=(640,)),
    Cell(**LLAVA, before=35, image=576, lengths=(700,)),
    Cell(**QWEN, before=16, image=576, lengths=(640, 800, 1200, 2000)),
)
# toy rows: 4 splits, a rank whose chunk (128 columns at D 16) leaves the span one split by default and two
# (of 64-column tiles) with chunk=1, so the two cuts differ
TINY_CELLS = (
    Cell("toy-qwen2-vl", 2, 2, 16, 8, 128, (192,), True, rank=32, splits=4),
    Cell("toy-llava", 2, 1, 16, 4, 128, (180,), False, rank=32, splits=4),
)


def _rope(cell: Cell, b: int, c: int, dtype, dev):
    """``(kernel keywords, reference keywords)``: the image columns' positions (Qwen2-VL: M-RoPE ``(t, h,
    w)`` on a square-ish grid after the text; LLaVA: 1-D), ``-1`` (post-RoPE) for the dense columns, and
    the model's rotary table (theta 1e6 / 1e4) over the row's positions."""
    from vlkv.runtime.kv.rope_table import RopeTable, table_as_rows

    d, a, n = cell.dim, cell.before, cell.image
    j = torch.arange(n, device=dev)
    side = max(1, math.isqrt(n))
    comps = [torch.full_like(j, a), a + j // side, a + j % side] if cell.mrope else [a + j]
    rot = torch.full((b, cell.kv_heads, c, len(comps)), -1, dtype=torch.long, device=dev)
    rot[:, :, a : a + n] = torch.stack(comps, -1)
    rows = max(c, a + n) + 1
    base = 1e6 if cell.mrope else 1e4
    inv = base ** -(torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    theta = torch.arange(rows, device=dev, dtype=torch.float32)[:, None] * inv
    cos, sin = theta.cos().repeat(1, 2).to(dtype), theta.sin().repeat(1, 2).to(dtype)
    sec = None
    if cell.mrope:  # Qwen2-VL's mrope_section (16, 24, 24) of the half at D 128, scaled for toy dims
        s0 = d // 8
        half = torch.tensor([0] * s0 + [1] * ((d // 2 - s0) // 2) + [2] * (d // 2 - s0 - (d // 2 - s0) // 2))
        sec = torch.cat([half, half]).to(dev)
    ref_rot, ref_cos, ref_sin = table_as_rows(rot, RopeTable(cos, sin, sec))
    ref = dict(rot=ref_rot, cos=ref_cos, sin=ref_sin)
    kernel = (
        dict(rot=rot, cos=cos, sin=sin, sec=sec) if cell.mrope else dict(rot=rot[..., 0], cos=cos, sin=sin)
    )
    return kernel, ref


def build(cell: Cell, dtype, dev, rope: bool = True) -> dict:
    """A cell's inputs: ``call`` the paged read's ``(q, k_pool, v_pool, table, lengths, scale)`` (every
    column's entry scattered over the pool in 16-slot pages, image columns too: the dense read's cache),
    ``factors`` (:class:`PagedFactors`, each request's image span factored, stacked rows), ``rope`` /
    ``ref_rope`` the kernel's and the reference's rotary keywords (empty without ``rope``)."""
    from vlkv.plugins.paged_lowrank import PagedFactors

    b, h, d, c = len(cell.lengths), cell.kv_heads, cell.dim, max(cell.lengths)
    page = 16
    pages = b * -(-c // page)
    perm = torch.randperm(pages, device=dev)
    slots = (perm[:, None] * page + torch.arange(page, device=dev)).reshape(b, -1)[:, :c]
    table = slots[:, None, :].expand(b, h, c).contiguous()
    k_pool = torch.randn(h, pages * page, d, device=dev, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    lengths = torch.tensor(cell.lengths, device=dev)[:, None].expand(b, h).contiguous()
    q = torch.randn(b, h * cell.group, 1, d, device=dev, dtype=dtype)
    n, r = cell.image, cell.rank
    frow = torch.full((b, h, c), -1, dtype=torch.long, device=dev)
    frow[:, :, cell.before : cell.before + n] = (
        torch.arange(b, device=dev)[:, None] * n + torch.arange(n, device=dev)
    )[:, None]
    # a quarter of each request's rows (its most important, here random) rebuilt at the full rank
    ranks = torch.full((b, n), max(1, r // 4), dtype=torch.long, device=dev)
    top = torch.rand(b, n, device=dev).argsort(-1)[:, : n // 4]
    ranks = ranks.scatter(1, top, r).reshape(-1)
    factors = PagedFactors(
        frow,
        torch.randn(b * n, r, device=dev, dtype=dtype),
        (torch.randn(b, r, h * d, device=dev) / r**0.5).to(dtype),
        torch.randn(b * n, r, device=dev, dtype=dtype),
        (torch.randn(b, r, h * d, device=dev) / r**0.5).to(dtype),
        ranks,
        ranks.clone(),
    )
    kernel_rope, ref_rope = _rope(cell, b, c, dtype, dev) if rope else ({}, {})
    call = (q, k_pool, v_pool, table, lengths, d**-0.5)
    return {"call": call, "factors": factors, "rope": kernel_rope, "ref_rope": ref_rope}


def _check(got: torch.Tensor, want: torch.Tensor, dtype) -> tuple[float, bool]:
    atol, rtol = TOL[dtype]
    diff = (got.float() - want.float()).abs()
    return float(diff.max()), bool((diff <= atol + rtol * want.float().abs()).all())


def _graph(fn, calls: int):
    """``fn`` called ``calls`` times, captured as one CUDA graph (warmed up on a side stream first, as
    ``runtime/cuda_graph.py`` does); returns its ``replay``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def _cut(inp: dict, splits: int, block_n: int, chunk: int) -> dict:
    """The cut's counts (``split_layout``, as the kernel cuts): factored-column bytes loaded, programs
    that walk a column, the most columns one walks (its loop: the read's critical path)."""
    from vlkv.plugins.paged_lowrank import factored_read_bytes, factored_span, split_layout

    q, f, lengths = inp["call"][0], inp["factors"], inp["call"][4]
    d = q.shape[-1]
    kernel, dense = factored_read_bytes(f, lengths, d, d, splits, block_n, chunk=chunk)
    _, start, stop, holds = split_layout(factored_span(f, lengths), lengths, splits, block_n, chunk)
    walked = (stop - start).clamp_min(0)
    return {"factored_bytes": kernel, "dense_bytes": dense, "busy_programs": int((walked > 0).sum()),
            "longest_columns": int(walked.max()), "basis_loads": int(holds.sum())}  # fmt: skip


def run_cell(args, dtype, cell: Cell, rope: bool = True) -> dict:
    """One cell's row: times (ms), ratios, errors vs the references, split count and the cuts' counts."""
    import triton

    from vlkv.plugins.paged_lowrank import factored_chunk, paged_lowrank_reference
    from vlkv.plugins.paged_reference import paged_attention_reference
    from vlkv.plugins.triton_paged_attention import paged_attention_triton
    from vlkv.plugins.triton_paged_lowrank import paged_lowrank_triton
    from vlkv.plugins.triton_selected_attention import default_num_splits, tile_sizes

    dev = args.device
    inp = build(cell, dtype, dev, rope)
    call, f = inp["call"], inp["factors"]
    b, h, d, c = len(cell.lengths), cell.kv_heads, cell.dim, max(cell.lengths)
    block_m, block_n = tile_sizes(cell.group, d, d)[:2]
    splits = cell.splits or default_num_splits(b * h * triton.cdiv(cell.group, block_m), c, block_n)
    chunk = factored_chunk(cell.rank, cell.rank, d, d)
    fns = {
        "default": partial(paged_lowrank_triton, *call, f, num_splits=cell.splits, **inp["rope"]),
        "chunk1": partial(paged_lowrank_triton, *call, f, num_splits=cell.splits, chunk=1, **inp["rope"]),
        "dense": partial(paged_attention_triton, *call, num_splits=cell.splits),
    }
    want_lr = paged_lowrank_reference(*call, f, **inp["ref_rope"])
    want_dense = paged_attention_reference(*call)
    row: dict = {
        "model": cell.model, "batch": b, "lengths": list(cell.lengths), "kv_heads": h, "query_heads": h * cell.group,
        "head_dim": d, "image_span": [cell.before, cell.before + cell.image], "rank": cell.rank,
        "rank_lo": max(1, cell.rank // 4), "top_fraction": 0.25, "splits": splits, "block_n": block_n, "chunk": chunk,
        "rope": ("M-RoPE table" if cell.mrope else "1-D RoPE table") + " (factored keys pre-RoPE)" if rope else "none",
    }  # fmt: skip
    for name, fn in fns.items():
        err, ok = _check(fn(), want_dense if name == "dense" else want_lr, dtype)
        row[f"{name}_max_err"], row[f"{name}_within_tol"] = err, ok
    row["tol"] = list(TOL[dtype])
    repeats = max(100, args.repeats) if dev.startswith("cuda") else args.repeats
    row["repeats"] = repeats
    eager = interleaved_ms(fns, dev, repeats, warmup=1)
    row |= {f"{name}_eager_ms": ms for name, ms in eager.items()}
    times = eager
    if dev.startswith("cuda"):
        try:
            graphs = {name: _graph(fn, GRAPH_CALLS) for name, fn in fns.items()}
            times = interleaved_ms(graphs, dev, repeats, warmup=2, per_call=GRAPH_CALLS)
            row |= {f"{name}_ms": ms for name, ms in times.items()}
            row["timed"] = f"CUDA graph of {GRAPH_CALLS} calls a replay"
        except Exception as exc:  # the eager times stand in; say why
            row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if "timed" not in row:
        row |= {f"{name}_ms": ms for name, ms in times.items()}
        row["timed"] = "eager calls"
    row["default_over_chunk1"] = times["default"] / times["chunk1"]
    row["default_over_dense"] = times["default"] / times["dense"]
    row["chunk1_over_dense"] = times["chunk1"] / times["dense"]
    row["cut_default"] = _cut(inp, splits, block_n, chunk)
    row["cut_chunk1"] = _cut(inp, splits, block_n, 1)
    return row


def kernel_lowrank_split(args, dtype, sizes, emit=None) -> list[dict] | str:
    """Every cell's row (a cell that fails is recorded with its error; with the rotary form failing, the
    cell is measured again without it). ``emit(rows)`` after each cell: a part stopped at its limit keeps
    what it measured."""
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "skipped: the Triton kernels need a GPU, or TRITON_INTERPRET=1 on a CPU"
    start = getattr(args, "part_start", time.perf_counter())
    rows: list[dict] = []
    for cell in TINY_CELLS if args.tiny else CELLS:
        used = time.perf_counter() - start
        if len(cell.lengths) > 1 and used > LATER_CELLS_SHARE * args.part_budget:
            rows.append({"model": cell.model, "batch": len(cell.lengths),
                         "skipped": f"the part had used {used:.0f} of its {args.part_budget:.0f} s"})  # fmt: skip
            continue
        torch.manual_seed(0)
        try:
            rows.append(run_cell(args, dtype, cell))
        except Exception as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            try:
                rows.append(run_cell(args, dtype, cell, rope=False) | {"rope_error": why})
            except Exception as exc2:
                rows.append({"model": cell.model, "batch": len(cell.lengths), "error": why,
                             "error_without_rope": f"{type(exc2).__name__}: {str(exc2).splitlines()[0]}"})  # fmt: skip
        if emit is not None:
            emit(rows)
    return rows


def markdown(rows) -> list[str]:
    """``report.md``'s table of the cells (information, no target)."""
    if not isinstance(rows, list):
        return ["", f"low-rank split cut: {rows}"]
    lines = ["", "Low-rank paged read, split cut (`lowrank_split`; information: which cut is faster). default: the "
             "factored span's own splits (`factored_chunk`); chunk=1: the span's share of the splits; dense: "
             "`paged_attention_triton` over the same columns as dense entries. Bytes: the factored columns' loads "
             "(`factored_read_bytes`) over their dense K/V.", "",
             "| model × batch | splits | default (ms) | chunk=1 (ms) | dense (ms) | default / chunk=1 "
             "| default / dense | eager default / chunk=1 / dense (ms) | bytes / dense, default / chunk=1 "
             "| busy programs, default / chunk=1 | max err default / chunk=1 / dense | timed |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        where = f"{r.get('model')} × {r.get('batch')}"
        if "default_ms" not in r:
            lines.append(f"| {where} | {r.get('skipped') or r.get('error')} |" + " |" * 10)
            continue
        cd, c1 = r["cut_default"], r["cut_chunk1"]
        lines.append(
            f"| {where} | {r['splits']} | {r['default_ms']:.4f} | {r['chunk1_ms']:.4f} | {r['dense_ms']:.4f} "
            f"| {r['default_over_chunk1']:.2f} | {r['default_over_dense']:.2f} "
            f"| {r['default_eager_ms']:.3f} / {r['chunk1_eager_ms']:.3f} / {r['dense_eager_ms']:.3f} "
            f"| {cd['factored_bytes'] / cd['dense_bytes']:.3f} / {c1['factored_bytes'] / c1['dense_bytes']:.3f} "
            f"| {cd['busy_programs']} / {c1['busy_programs']} "
            f"| {r['default_max_err']:.1e} / {r['chunk1_max_err']:.1e} / {r['dense_max_err']:.1e} "
            f"| {r['timed']}{', ' + r['rope_error'] if 'rope_error' in r else ''} |"
        )
    return lines
