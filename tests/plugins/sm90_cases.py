"""The launches ``test_triton_sm90.py`` compiles for sm_90: every Triton launcher vlkv runs on a GPU, in the
variants GPU runs take (bf16 mainly; fp32 / fp16 where the GPU tests or the device layer run them; each
launcher's constexpr branches: rotary forms, one split or several, statistics, visibility, id forms).

Each case is a zero-argument launch over small CPU tensors (inside ``triton_target.compile_only`` nothing
runs: the outputs stay garbage) and the kernels it must compile. Shapes are the models' where a tile size
follows from them (head size 128, GQA 7, hidden 4,096, intermediate 11,008), small elsewhere. Imports sit
in the builders: this module is imported by the test's parent process too, where Triton may interpret.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FORMS = ("plain", "rope-1d", "mrope")
HEAD_DIM = 128  # LLaVA-1.5-7B's and Qwen2-VL's head size: the paged tiles' BLOCK_D


@dataclass(frozen=True)
class Sm90Case:
    """``launch()`` runs the launcher once; ``kernels``: the kernel names its launches must compile."""

    name: str
    launch: Callable[[], object]
    kernels: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.kernels:
            raise ValueError(f"{self.name}: name at least one kernel the launch compiles")


def _paged(dtype, form: str, low: bool = False) -> dict:
    """A paged read's keywords (``q (2, 14, 1, 128)`` over pools of 2 KV heads, holes, GQA 7) with the
    rotary keywords of ``form``; ``low``: low-rank factors too (path (b) mixed in without rotary)."""
    from tests.plugins.paged_cases import PagedCase
    from tests.plugins.test_triton_paged_lowrank import rope_args, with_factors

    g = torch.Generator().manual_seed(5)
    args = PagedCase(2, 2, 7, 1, 81, HEAD_DIM, layout="holes", runs=2).make(dtype)
    factors = with_factors(args, g, dtype) if low else None
    if low and form == "plain":  # path (b): post-RoPE factors of request 1, pre-RoPE (unrotated) of the rest
        factors = dataclasses.replace(factors, post_rope=torch.tensor([False, True]))
    rope = rope_args(args, factors, "post" if form == "plain" else form, g, dtype)[1]
    return args | rope | ({"factors": factors} if low else {})


def _paged_cases() -> list[Sm90Case]:
    from vlkv.plugins import triton_paged_lowrank as tpl
    from vlkv.plugins.triton_paged_attention import paged_attention_triton
    from vlkv.plugins.triton_paged_probs import paged_probs_triton

    read, probs = ("paged_attention_kernel",), ("paged_probs_kernel", "probs_normalise_kernel")
    low, combine = ("paged_lowrank_kernel",), ("combine_splits_kernel",)
    cases = []
    for i, form in enumerate(FORMS):
        for splits, tag in ((1, "1split"), (3, "3splits")):
            more = combine if splits > 1 else ()

            def attention(f=form, s=splits):
                return paged_attention_triton(**_paged(BF16, f), num_splits=s)

            def stats(f=form, s=splits):
                return paged_probs_triton(**_paged(BF16, f), num_splits=s)

            cases += [
                Sm90Case(f"paged_attention/{form}/{tag}", attention, read + more),
                Sm90Case(f"paged_probs/{form}/{tag}", stats, probs),
            ]
        # the low-rank kernel (~1-3 s a compile): each form once per launcher, the split counts alternated
        # (every form and every split count still compiles for both launchers; 6 compiles, not 12)
        for fn, kernels, splits in (
            (tpl.paged_lowrank_triton, low, 3 if i % 2 == 0 else 1),
            (tpl.paged_lowrank_probs_triton, low + probs[1:], 1 if i % 2 == 0 else 3),
        ):
            more = combine if splits > 1 and fn is tpl.paged_lowrank_triton else ()

            def lowrank(fn=fn, f=form, s=splits):
                return fn(**_paged(BF16, f, low=True), num_splits=s)

            name = fn.__name__.removesuffix("_triton")
            cases.append(
                Sm90Case(f"{name}/{form}/{splits}split{'s' if splits > 1 else ''}", lowrank, kernels + more)
            )
    for dtype, tag in ((FP32, "fp32"), (FP16, "fp16")):  # the GPU tests' other dtypes (IEEE dots: fp32)
        cases += [
            Sm90Case(
                f"paged_attention/plain/3splits/{tag}",
                lambda d=dtype: paged_attention_triton(**_paged(d, "plain"), num_splits=3),
                read + combine,
            ),
            Sm90Case(
                f"paged_probs/plain/3splits/{tag}",
                lambda d=dtype: paged_probs_triton(**_paged(d, "plain"), num_splits=3),
                probs,
            ),
        ]
    cases.append(
        Sm90Case(  # a statistics step without held-column output (WRITE_VIS off)
            "paged_probs/plain/3splits/novis",
            lambda: paged_probs_triton(**_paged(BF16, "plain"), num_splits=3, with_vis=False),
            probs,
        )
    )
    return cases


def _append(dtype, run_ids: bool, out: bool, rot: bool) -> None:
    """``decode_append_`` on 3 requests, 2 KV heads, D 128: slots from the meta rows (``run_ids``) or
    per head; the read table (``out``) and its pre-RoPE positions (``rot``) written or not."""
    from vlkv.plugins.paged_append_kernels import META_FIELDS
    from vlkv.plugins.paged_append_triton import decode_append_

    b, h, s, p, width = 3, 2, 64, 3, 40
    pool = torch.zeros(h, s, HEAD_DIM, dtype=dtype)
    k = torch.zeros(b, h, 1, HEAD_DIM, dtype=dtype)
    meta = torch.zeros(2, b, META_FIELDS, dtype=torch.long)
    table = torch.zeros(b, h, width, dtype=torch.long) if out else None
    rot_out = torch.zeros(b, h, width, p, dtype=torch.long) if rot else None
    ids = None if run_ids else torch.zeros(h, b, dtype=torch.long)
    new = (torch.zeros(b, p, dtype=torch.long), torch.zeros(b, dtype=torch.int8), torch.zeros(b).long())
    flags = torch.zeros(h, s, dtype=torch.bool)
    decode_append_(pool, pool.clone(), flags, k, k, meta, 1, *new, ids=ids, out=table, rot_out=rot_out)


def _glue(dtype) -> None:
    """Every ``triton_glue`` launch at LLaVA-1.5-7B's sizes (hidden 4,096, 32 + 2·32 heads of 128,
    intermediate 11,008), 4 decode rows."""
    from vlkv.plugins import triton_glue

    rows, width, inter, heads = 4, 4096, 11008, 32
    x, w = torch.zeros(rows, width, dtype=dtype), torch.ones(width, dtype=dtype)
    triton_glue.rms_norm(x, w, 1e-6)
    triton_glue.add_rms_norm(x, x.clone(), w, 1e-6)
    qkv = torch.zeros(rows, 3 * heads, HEAD_DIM, dtype=dtype)
    cos = torch.zeros(rows, 1, HEAD_DIM, dtype=dtype)
    triton_glue.rope_(qkv, cos, cos.clone(), 2 * heads)
    triton_glue.silu_mul(torch.zeros(rows, 2 * inter, dtype=dtype))
    pool = torch.zeros(heads, 64, HEAD_DIM, dtype=dtype)
    rows4 = qkv.view(rows, 3 * heads, 1, HEAD_DIM)
    k, v = rows4[:, heads : 2 * heads], rows4[:, 2 * heads :]
    ids = torch.zeros(heads, rows, dtype=torch.long)
    triton_glue.pool_write_(pool, pool.clone(), torch.zeros(heads, 64, dtype=torch.bool), ids, k, v)


def _glue_and_append_cases() -> list[Sm90Case]:
    glue = ("rms_norm_kernel", "rope_kernel", "silu_mul_kernel", "pool_write_kernel")
    cases = [
        Sm90Case(f"triton_glue/{t}", lambda d=d: _glue(d), glue) for d, t in ((BF16, "bf16"), (FP32, "fp32"))
    ]
    variants = {  # the static step's (per-head ids, table and rotary rows), fused_append's (the rest)
        "per-head/out/rot": (False, True, True),
        "per-head/out": (False, True, False),
        "run-ids/out": (True, True, False),
        "run-ids": (True, False, False),
    }
    for tag, flags in variants.items():
        cases.append(
            Sm90Case(f"decode_append/{tag}", lambda f=flags: _append(BF16, *f), ("decode_append_kernel",))
        )
    cases.append(
        Sm90Case(
            "decode_append/per-head/out/rot/fp32",
            lambda: _append(FP32, False, True, True),
            ("decode_append_kernel",),
        )
    )
    return cases


def _ops_cases() -> list[Sm90Case]:
    """``ops``' other Triton routes: statistics, selected attention, token merging, rank-space attention."""
    from tests.plugins.cases import LowRankCase, MergeCase, SelectCase, StatsCase
    from vlkv.plugins.triton_attn_stats import attn_stats_triton
    from vlkv.plugins.triton_lowrank_attention import lowrank_attention_triton
    from vlkv.plugins.triton_merge_kv import merge_kv_triton
    from vlkv.plugins.triton_selected_attention import selected_attention_triton

    stats = ("row_stats_kernel", "col_stats_kernel", "sum_counts_kernel")
    stats_case = StatsCase(2, 14, 2, 5, 81, HEAD_DIM, ragged=True)
    select = SelectCase(2, 14, 2, 1, 81, HEAD_DIM, 30)
    cases = []
    for dtype, tag in ((BF16, "bf16"), (FP16, "fp16"), (FP32, "fp32")):
        cases += [
            Sm90Case(
                f"attn_stats/causal/threshold/{tag}",
                lambda d=dtype: attn_stats_triton(**stats_case.make(d)),
                stats,
            ),
            Sm90Case(
                f"selected_attention/3splits/{tag}",
                lambda d=dtype: selected_attention_triton(**select.make(d), num_splits=3),
                ("selected_attention_kernel", "combine_splits_kernel"),
            ),
        ]
    plain_stats = dataclasses.replace(stats_case, causal=False)
    cases += [
        Sm90Case(
            "attn_stats/noncausal/nothreshold",
            lambda: attn_stats_triton(**(plain_stats.make(BF16) | {"threshold": None})),
            stats,
        ),
        Sm90Case(
            "attn_stats/fused",
            lambda: attn_stats_triton(**stats_case.make(BF16), fused=True),
            ("attn_stats_fused_kernel",),
        ),
        Sm90Case(
            "selected_attention/1split",
            lambda: selected_attention_triton(**select.make(BF16), num_splits=1),
            ("selected_attention_kernel",),
        ),
    ]
    merge = ("merge_scatter_kernel", "merge_finalize_kernel")
    merge_case = MergeCase(2, 2, 81, HEAD_DIM, 30)
    cases += [
        Sm90Case("merge_kv/scatter", lambda: merge_kv_triton(**merge_case.make(BF16)), merge),
        Sm90Case(
            "merge_kv/scan",
            lambda: merge_kv_triton(**merge_case.make(BF16), strategy="scan"),
            ("merge_scan_kernel",),
        ),
        Sm90Case("merge_kv/scatter/fp32", lambda: merge_kv_triton(**merge_case.make(FP32)), merge),
    ]
    low = LowRankCase(2, 2, 7, HEAD_DIM, (65, 129), (0, 33), 40, 17)
    for dtype, tag in ((BF16, "bf16"), (FP32, "fp32")):
        cases.append(
            Sm90Case(
                f"lowrank_attention/{tag}",
                lambda d=dtype: lowrank_attention_triton(**low.make(d)),
                ("lowrank_attention_kernel",),
            )
        )
    return cases


# the TensorRT plugins' AOT kernels (``ptx.compile_ptx``: what ``trt_plugins`` bakes into an engine), fp16,
# with ``test_ptx``'s constexprs
def _aot(op: str) -> str:
    from tests.plugins.test_ptx import CONSTEXPRS
    from vlkv.plugins.ptx import compile_ptx

    return compile_ptx(op, "float16", head_dim=HEAD_DIM, arch=90, **CONSTEXPRS[op]).kernel_name


def _aot_cases() -> list[Sm90Case]:
    from tests.plugins.test_ptx import CONSTEXPRS
    from vlkv.plugins.ptx import AOT_KERNELS

    return [
        Sm90Case(f"aot/{op}", lambda o=op: _aot(o), (AOT_KERNELS[op].kernel,)) for op in sorted(CONSTEXPRS)
    ]


def cases() -> list[Sm90Case]:
    """Every case, in the order they compile."""
    return [*_paged_cases(), *_glue_and_append_cases(), *_ops_cases(), *_aot_cases()]
