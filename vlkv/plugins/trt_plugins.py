"""TensorRT quickly-deployable plugins (``tensorrt.plugin``) for the vlkv ops, AOT-compiled Triton kernels.

``register_plugins()`` defines ``vlkv::attn_stats``, ``vlkv::selected_attention``, ``vlkv::merge_kv``,
``vlkv::lowrank_attention`` and ``vlkv::paged_attention``:
``@trtp.register`` (output shapes and types), ``@trtp.autotune`` (type/format combinations) and
``@trtp.aot_impl`` (PTX from ``ptx.compile_ptx``, baked into the engine, so no Python runs at inference).
Inputs, outputs and attributes follow ``onnx_ops.OPS``; an ONNX node in TensorRT form (see
``onnx_ops.make_node(..., form="trt")``) maps onto them by name.

The callbacks follow the contract ``tensorrt.plugin`` enforces when they are decorated (its
``_validate.py``): ``register`` annotates every argument (TensorDescs first, then int/float/str/bool/bytes
attributes, no defaults) and its return (``TensorDesc`` or ``tuple[TensorDesc, ...]`` spelled out);
``autotune`` takes ``(inputs..., [attrs...], outputs)``; ``aot_impl`` takes ``(inputs..., [attrs...],
outputs, tactic)`` and *must* annotate its return as ``tuple[str | bytes, str | bytes,
KernelLaunchParams, SymIntExprs]``. TensorRT cannot be installed on the development machines
(toolchain.md A1); the tests run these callbacks on a stand-in ``tensorrt.plugin`` that applies the same
checks. Head dim, head counts and attributes must be build-time constants.

The PTX targets one GPU architecture, ``register_plugins(arch=...)`` (the recipe's ``trt.ptx_arch`` or
the build machine's GPU): an engine only runs on the architecture its kernels were compiled for.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin reads the callbacks' annotations as
# objects, and ``trtp`` is a local of ``_define``, so string annotations could not be resolved.
from vlkv.plugins.onnx_ops import OPS, PLUGIN_NAMESPACE
from vlkv.plugins.ptx import SM_ARCHES, compile_ptx, device_arch, parse_arch


class TensorRTUnavailableError(RuntimeError):
    """TensorRT (with its ``tensorrt.plugin`` module) cannot be imported."""


PLUGIN_IDS: dict[str, str] = {name: f"{PLUGIN_NAMESPACE}::{spec.plugin}" for name, spec in OPS.items()}

_FLOAT_TYPES = "FP32|FP16|BF16"
_registered = False
# The sm_XX the aot_impl callbacks compile for; set by register_plugins before any engine build.
_target: dict[str, int] = {}


def _import_tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as error:
        raise TensorRTUnavailableError(
            f"TensorRT is not installed ({error}); the vlkv plugins need TensorRT >= 10.8 with tensorrt.plugin,"
            " which pip cannot install here: use an NVIDIA TensorRT container or NVIDIA's package index"
        ) from None
    return trt, trtp


def _const(expr, what: str) -> int:
    """The build-time value of a shape expression (plain ints pass through)."""
    if isinstance(expr, int):
        return expr
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        raise ValueError(f"{what} must be a build-time constant for the AOT vlkv plugins")
    return int(expr.constant_value())


def _aot_result(trtp, artifact, dims: dict[str, object]):
    """(kernel name, PTX, KernelLaunchParams, SymIntExprs) from a PtxArtifact and TensorRT shape exprs."""
    params = trtp.KernelLaunchParams()
    for key, value in artifact.launch_params(dims, cdiv=trtp.cdiv).items():
        setattr(params, key, value)
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(dims[name]) for name in artifact.scalar_args])
    return artifact.kernel_name.encode(), artifact.ptx.encode(), params, extra


def _define(trt, trtp) -> None:
    """Attach the register / autotune / aot_impl callbacks; runs once per process."""

    ints = "INT64"

    @trtp.register(PLUGIN_IDS["AttnStats"])
    def _attn_stats_desc(
        q: trtp.TensorDesc, k: trtp.TensorDesc, query_rows: trtp.TensorDesc, key_lengths: trtp.TensorDesc,
        q_offset: trtp.TensorDesc, scale: float, causal: int, threshold: float,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        b, h, s = q.shape_expr[0], q.shape_expr[1], k.shape_expr[2]
        return (
            trtp.from_shape_expr((b, h, s), dtype=trt.float32),
            trtp.from_shape_expr((b, h), dtype=trt.int64),
            trtp.from_shape_expr((b, h), dtype=trt.int64),
        )

    aot_result = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]
    combinations = list[trtp.AutoTuneCombination]

    @trtp.autotune(PLUGIN_IDS["AttnStats"])
    def _attn_stats_tune(q, k, query_rows, key_lengths, q_offset, outputs) -> combinations:
        types = f"{_FLOAT_TYPES}, {_FLOAT_TYPES}, {ints}, {ints}, {ints}, FP32, {ints}, {ints}"
        return [trtp.AutoTuneCombination(types, "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["AttnStats"])
    def _attn_stats_aot(q, k, query_rows, key_lengths, q_offset, scale: float, causal: int, threshold: float,
                        outputs, tactic: int) -> aot_result:  # fmt: skip
        artifact = compile_ptx(
            "attn_stats", q.dtype, head_dim=_const(q.shape_expr[3], "head_dim"), arch=_target["arch"],
            SCALE=float(scale), THRESHOLD=float(threshold), CAUSAL=bool(causal), HAS_THRESHOLD=threshold > 0,
        )  # fmt: skip
        dims = {"B": q.shape_expr[0], "H": q.shape_expr[1], "HKV": k.shape_expr[1], "Q": q.shape_expr[2]}
        dims |= {"S": k.shape_expr[2], "D": q.shape_expr[3]}
        return _aot_result(trtp, artifact, dims)

    @trtp.register(PLUGIN_IDS["SelectedAttention"])
    def _selected_desc(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, indices: trtp.TensorDesc,
        lengths: trtp.TensorDesc, scale: float,
    ) -> trtp.TensorDesc:  # fmt: skip
        return q.like()

    @trtp.autotune(PLUGIN_IDS["SelectedAttention"])
    def _selected_tune(q, k, v, indices, lengths, outputs) -> combinations:
        f = _FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{f}, {f}, {f}, {ints}, {ints}, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["SelectedAttention"])
    def _selected_aot(q, k, v, indices, lengths, scale: float, outputs, tactic: int) -> aot_result:
        artifact = compile_ptx(
            "selected_attention", q.dtype, head_dim=_const(q.shape_expr[3], "head_dim"), arch=_target["arch"],
            SCALE=float(scale),
        )  # fmt: skip
        dims = {"B": q.shape_expr[0], "H": q.shape_expr[1], "HKV": k.shape_expr[1], "Q": q.shape_expr[2]}
        dims |= {"S": k.shape_expr[2], "D": q.shape_expr[3], "K_SEL": indices.shape_expr[2]}
        return _aot_result(trtp, artifact, dims)

    @trtp.register(PLUGIN_IDS["PagedAttention"])
    def _paged_desc(
        q: trtp.TensorDesc, k_pool: trtp.TensorDesc, v_pool: trtp.TensorDesc, table: trtp.TensorDesc,
        lengths: trtp.TensorDesc, scale: float,
    ) -> trtp.TensorDesc:  # fmt: skip
        return q.like()

    @trtp.autotune(PLUGIN_IDS["PagedAttention"])
    def _paged_tune(q, k_pool, v_pool, table, lengths, outputs) -> combinations:
        f = _FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{f}, {f}, {f}, {ints}, {ints}, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["PagedAttention"])
    def _paged_aot(q, k_pool, v_pool, table, lengths, scale: float, outputs, tactic: int) -> aot_result:
        artifact = compile_ptx(
            "paged_attention", q.dtype, head_dim=_const(q.shape_expr[3], "head_dim"), arch=_target["arch"],
            SCALE=float(scale),
        )  # fmt: skip
        dims = {"B": q.shape_expr[0], "H": q.shape_expr[1], "HKV": k_pool.shape_expr[0], "Q": q.shape_expr[2]}
        dims |= {"S": k_pool.shape_expr[1], "D": q.shape_expr[3], "C": table.shape_expr[2]}
        return _aot_result(trtp, artifact, dims)

    @trtp.register(PLUGIN_IDS["MergeKV"])
    def _merge_desc(
        k: trtp.TensorDesc, v: trtp.TensorDesc, assign: trtp.TensorDesc, counts: trtp.TensorDesc
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        shape = (k.shape_expr[0], k.shape_expr[1], counts.shape_expr[2], k.shape_expr[3])
        return trtp.from_shape_expr(shape, dtype=k.dtype), trtp.from_shape_expr(shape, dtype=v.dtype)

    @trtp.autotune(PLUGIN_IDS["MergeKV"])
    def _merge_tune(k, v, assign, counts, outputs) -> combinations:
        f = _FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{f}, {f}, {ints}, {ints}, {f}, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["MergeKV"])
    def _merge_aot(k, v, assign, counts, outputs, tactic: int) -> aot_result:
        head_dim = _const(k.shape_expr[3], "head_dim")
        artifact = compile_ptx("merge_kv", k.dtype, head_dim=head_dim, arch=_target["arch"])
        dims = {"B": k.shape_expr[0], "HKV": k.shape_expr[1], "S": k.shape_expr[2]}
        dims |= {"S_OUT": counts.shape_expr[2], "D": k.shape_expr[3]}
        return _aot_result(trtp, artifact, dims)

    _define_lowrank(trt, trtp, aot_result, combinations, ints)


def _define_lowrank(trt, trtp, aot_result, combinations, ints: str) -> None:
    """``vlkv::lowrank_attention``: AttentionPack path (b), one decode row over factors + dense entries."""

    @trtp.register(PLUGIN_IDS["LowRankAttention"])
    def _lowrank_desc(
        q: trtp.TensorDesc, kbar: trtp.TensorDesc, dk: trtp.TensorDesc, vbar: trtp.TensorDesc,
        dv: trtp.TensorDesc, rows: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc,
        dense_len: trtp.TensorDesc, scale: float,
    ) -> trtp.TensorDesc:  # fmt: skip
        return q.like()

    @trtp.autotune(PLUGIN_IDS["LowRankAttention"])
    def _lowrank_tune(q, kbar, dk, vbar, dv, rows, k, v, dense_len, outputs) -> combinations:
        f = _FLOAT_TYPES
        types = f"{f}, {f}, {f}, {f}, {f}, {ints}, {f}, {f}, {ints}, {f}"
        return [trtp.AutoTuneCombination(types, "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["LowRankAttention"])
    def _lowrank_aot(q, kbar, dk, vbar, dv, rows, k, v, dense_len, scale: float, outputs,
                     tactic: int) -> aot_result:  # fmt: skip
        # the ranks fix the rank tiles, so like the head dim they are build-time constants
        rank_k, rank_v = (
            _const(kbar.shape_expr[2], "rank (kbar dim 2)"),
            _const(vbar.shape_expr[2], "rank (vbar dim 2)"),
        )
        artifact = compile_ptx(
            "lowrank_attention", q.dtype, head_dim=_const(q.shape_expr[2], "head_dim"), arch=_target["arch"],
            SCALE=float(scale), BLOCK_RK=_rank_tile(rank_k), BLOCK_RV=_rank_tile(rank_v),
        )  # fmt: skip
        dims = {"B": q.shape_expr[0], "H": q.shape_expr[1], "HKV": k.shape_expr[1], "T": kbar.shape_expr[1]}
        dims |= {
            "S": k.shape_expr[2],
            "D": q.shape_expr[2],
            "RK": kbar.shape_expr[2],
            "RV": vbar.shape_expr[2],
        }
        return _aot_result(trtp, artifact, dims)


def _rank_tile(rank: int) -> int:
    """The rank padded to a power of two >= 16 (the smallest tl.dot tile side)."""
    return max(16, 1 << (max(rank, 1) - 1).bit_length())


def resolve_arch(arch: int | str | None, what: str = "trt.ptx_arch") -> int:
    """The sm_XX to compile for: ``arch`` when given, else the visible GPU's; one-line ValueError otherwise."""
    if arch is not None:
        return parse_arch(arch, what)
    found = device_arch()
    if found is None:
        raise ValueError(
            f"{what}: no CUDA device is visible to take the architecture from; set it to one of {', '.join(SM_ARCHES)}"
        )
    return parse_arch(found, f"{what} (from the visible GPU)")


def register_plugins(arch: int | str | None = None) -> list[str]:
    """Register the vlkv plugins with TensorRT (once per process); returns their ids ("vlkv::attn_stats", ...).

    arch: the GPU architecture the AOT kernels are compiled for (``"sm_90"``, one of
    ``ptx.SM_ARCHES``); None = the visible GPU's. A later call may retarget the kernels.

    Raises TensorRTUnavailableError (one line, no chained traceback) when TensorRT cannot be imported,
    and ValueError (one line) for an unsupported or undeterminable architecture.
    """
    global _registered
    trt, trtp = _import_tensorrt()
    _target["arch"] = resolve_arch(arch)
    if not _registered:
        _define(trt, trtp)
        _registered = True
    return sorted(PLUGIN_IDS.values())
