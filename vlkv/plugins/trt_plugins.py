"""TensorRT quickly-deployable plugins (``tensorrt.plugin``) for the vlkv ops, AOT-compiled Triton kernels.

``register_plugins()`` defines ``vlkv::attn_stats``, ``vlkv::selected_attention`` and ``vlkv::merge_kv``:
``@trtp.register`` (output shapes and types), ``@trtp.autotune`` (type/format combinations) and
``@trtp.aot_impl`` (PTX from ``ptx.compile_ptx``, baked into the engine, so no Python runs at inference).
Inputs, outputs and attributes follow ``onnx_ops.OPS``; an ONNX node in TensorRT form (see
``onnx_ops.make_node(..., form="trt")``) maps onto them by name.

Written against the documented TensorRT 10.8+ / 11 QDP API; TensorRT cannot be installed on the
development machines (toolchain.md A1), so this module has only been exercised against a fake
``tensorrt.plugin`` in the tests. Head dim, head counts and attributes must be build-time constants.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin reads the callbacks' annotations as
# objects, and ``trtp`` is a local of ``_define``, so string annotations could not be resolved.
from vlkv.plugins.onnx_ops import OPS, PLUGIN_NAMESPACE
from vlkv.plugins.ptx import compile_ptx


class TensorRTUnavailableError(RuntimeError):
    """TensorRT (with its ``tensorrt.plugin`` module) cannot be imported."""


PLUGIN_IDS: dict[str, str] = {name: f"{PLUGIN_NAMESPACE}::{spec.plugin}" for name, spec in OPS.items()}

_FLOAT_TYPES = "FP32|FP16|BF16"
_registered = False


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

    @trtp.autotune(PLUGIN_IDS["AttnStats"])
    def _attn_stats_tune(q, k, query_rows, key_lengths, q_offset, outputs):
        types = f"{_FLOAT_TYPES}, {_FLOAT_TYPES}, {ints}, {ints}, {ints}, FP32, {ints}, {ints}"
        return [trtp.AutoTuneCombination(types, "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["AttnStats"])
    def _attn_stats_aot(q, k, query_rows, key_lengths, q_offset, scale: float, causal: int, threshold: float,
                        outputs, tactic):  # fmt: skip
        artifact = compile_ptx(
            "attn_stats", q.dtype, head_dim=_const(q.shape_expr[3], "head_dim"),
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
    def _selected_tune(q, k, v, indices, lengths, outputs):
        f = _FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{f}, {f}, {f}, {ints}, {ints}, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["SelectedAttention"])
    def _selected_aot(q, k, v, indices, lengths, scale: float, outputs, tactic):
        artifact = compile_ptx(
            "selected_attention", q.dtype, head_dim=_const(q.shape_expr[3], "head_dim"), SCALE=float(scale)
        )
        dims = {"B": q.shape_expr[0], "H": q.shape_expr[1], "HKV": k.shape_expr[1], "Q": q.shape_expr[2]}
        dims |= {"S": k.shape_expr[2], "D": q.shape_expr[3], "K_SEL": indices.shape_expr[2]}
        return _aot_result(trtp, artifact, dims)

    @trtp.register(PLUGIN_IDS["MergeKV"])
    def _merge_desc(
        k: trtp.TensorDesc, v: trtp.TensorDesc, assign: trtp.TensorDesc, counts: trtp.TensorDesc
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        shape = (k.shape_expr[0], k.shape_expr[1], counts.shape_expr[2], k.shape_expr[3])
        return trtp.from_shape_expr(shape, dtype=k.dtype), trtp.from_shape_expr(shape, dtype=v.dtype)

    @trtp.autotune(PLUGIN_IDS["MergeKV"])
    def _merge_tune(k, v, assign, counts, outputs):
        f = _FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{f}, {f}, {ints}, {ints}, {f}, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS["MergeKV"])
    def _merge_aot(k, v, assign, counts, outputs, tactic):
        artifact = compile_ptx("merge_kv", k.dtype, head_dim=_const(k.shape_expr[3], "head_dim"))
        dims = {"B": k.shape_expr[0], "HKV": k.shape_expr[1], "S": k.shape_expr[2]}
        dims |= {"S_OUT": counts.shape_expr[2], "D": k.shape_expr[3]}
        return _aot_result(trtp, artifact, dims)


def register_plugins() -> list[str]:
    """Register the vlkv plugins with TensorRT (idempotent); returns their ids ("vlkv::attn_stats", ...).

    Raises TensorRTUnavailableError (one line, no chained traceback) when TensorRT cannot be imported.
    """
    global _registered
    trt, trtp = _import_tensorrt()
    if not _registered:
        _define(trt, trtp)
        _registered = True
    return sorted(PLUGIN_IDS.values())
