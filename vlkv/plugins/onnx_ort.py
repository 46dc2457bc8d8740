"""ONNX Runtime (CPU) test doubles for the vlkv custom ops, via onnxruntime-extensions Python ops.

The Python ops call the PyTorch references, so an ORT session over a rewritten graph checks the graph
surgery without TensorRT. They are registered in ``ai.onnx.contrib`` with float32 inputs only; convert a
canonical graph with ``onnx_ops.convert_model(model, "ort")`` first.
"""

from __future__ import annotations

from vlkv.plugins.onnx_ops import (
    OP_ATTN_STATS,
    OP_LOWRANK_ATTENTION,
    OP_MERGE_KV,
    OP_PAGED_ATTENTION,
    OP_SELECTED_ATTENTION,
    ORT_DOMAIN,
    get_spec,
    make_node,
)

# ORT 1.31 reads models up to IR 13; onnx 1.23 writes 14 by default.
IR_VERSION = 10
OPSET = 17

_REGISTERED = False


def _missing(package: str, error: ImportError) -> RuntimeError:
    return RuntimeError(f"{package} is not installed ({error}): pip install 'vlkv[onnx]'")


def register_ort_ops() -> None:
    """Define the onnxruntime-extensions Python ops once per process (registration is global)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from onnxruntime_extensions import PyCustomOpDef, onnx_op
    except ImportError as error:
        raise _missing("onnxruntime-extensions", error) from None
    import torch

    from vlkv.plugins.reference import attn_stats_reference, merge_kv_reference, selected_attention_reference

    f32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64

    @onnx_op(
        op_type=OP_ATTN_STATS,
        inputs=[f32, f32, i64, i64, i64],
        outputs=[f32, i64, i64],
        attrs={"scale": f32, "causal": i64, "threshold": f32},
    )
    def _attn_stats(q, k, query_rows, key_lengths, q_offset, **attrs):
        threshold = attrs["threshold"]
        stats = attn_stats_reference(
            torch.from_numpy(q),
            torch.from_numpy(k),
            attrs["scale"],
            query_rows=torch.from_numpy(query_rows) != 0,
            causal=bool(attrs["causal"]),
            threshold=threshold if threshold > 0 else None,
            key_lengths=torch.from_numpy(key_lengths),
            q_offset=torch.from_numpy(q_offset),
        )
        below = stats.below if stats.below is not None else torch.zeros_like(stats.visible)
        return stats.colsum.numpy(), below.numpy(), stats.visible.numpy()

    @onnx_op(
        op_type=OP_SELECTED_ATTENTION, inputs=[f32, f32, f32, i64, i64], outputs=[f32], attrs={"scale": f32}
    )
    def _selected_attention(q, k, v, indices, lengths, **attrs):
        args = (torch.from_numpy(x) for x in (q, k, v, indices, lengths))
        return selected_attention_reference(*args, attrs["scale"]).numpy()

    @onnx_op(op_type=OP_MERGE_KV, inputs=[f32, f32, i64, i64], outputs=[f32, f32])
    def _merge_kv(k, v, assign, counts):
        k_out, v_out = merge_kv_reference(*(torch.from_numpy(x) for x in (k, v, assign, counts)))
        return k_out.numpy(), v_out.numpy()

    @onnx_op(
        op_type=OP_LOWRANK_ATTENTION,
        inputs=[f32, f32, f32, f32, f32, i64, f32, f32, i64],
        outputs=[f32],
        attrs={"scale": f32},
    )
    def _lowrank_attention(q, kbar, dk, vbar, dv, rows, k, v, dense_len, **attrs):
        from vlkv.plugins.lowrank_reference import lowrank_decode_attention

        args = (torch.from_numpy(x) for x in (q, kbar, dk, vbar, dv, rows, k, v, dense_len))
        return lowrank_decode_attention(*args, scale=attrs["scale"]).numpy()

    @onnx_op(
        op_type=OP_PAGED_ATTENTION, inputs=[f32, f32, f32, i64, i64], outputs=[f32], attrs={"scale": f32}
    )
    def _paged_attention(q, k_pool, v_pool, table, lengths, **attrs):
        from vlkv.plugins.paged_reference import paged_attention_reference

        args = (torch.from_numpy(x) for x in (q, k_pool, v_pool, table, lengths))
        return paged_attention_reference(*args, attrs["scale"]).numpy()

    _REGISTERED = True


def ort_session_options():
    """``onnxruntime.SessionOptions`` with the extensions library (and the vlkv Python ops) registered."""
    try:
        import onnxruntime as ort
        from onnxruntime_extensions import get_library_path
    except ImportError as error:
        raise _missing("onnxruntime / onnxruntime-extensions", error) from None
    register_ort_ops()
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return options


def make_single_op_model(op: str, form: str = "ort", **attrs):
    """A one-node ONNX model running ``op``; graph inputs/outputs carry the spec's names and symbolic dims.

    form: "ort" (runs with ``ort_session_options()``), "canonical" or "trt". attrs: the op's attributes.
    """
    import onnx
    from onnx import TensorProto, helper

    spec = get_spec(op)
    elem = {"float": TensorProto.FLOAT, "int64": TensorProto.INT64}
    inputs = [helper.make_tensor_value_info(p.name, elem[p.elem_type], list(p.shape)) for p in spec.inputs]
    outputs = [helper.make_tensor_value_info(p.name, elem[p.elem_type], list(p.shape)) for p in spec.outputs]
    node = make_node(spec.name, [p.name for p in spec.inputs], [p.name for p in spec.outputs], form, **attrs)
    opsets = [helper.make_opsetid("", OPSET)]
    if form != "trt":
        opsets.append(helper.make_opsetid(node.domain, 1))
    model = helper.make_model(
        helper.make_graph([node], f"vlkv_{spec.plugin}", inputs, outputs),
        opset_imports=opsets,
        ir_version=IR_VERSION,
    )
    onnx.checker.check_model(model)
    return model


def run_single_op(op: str, feeds: dict, **attrs) -> list:
    """Run ``op`` once through ONNX Runtime on CPU. feeds: input name -> numpy array. Returns the outputs."""
    import onnxruntime as ort

    model = make_single_op_model(op, "ort", **attrs)
    session = ort.InferenceSession(
        model.SerializeToString(), ort_session_options(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


__all__ = ["ORT_DOMAIN", "make_single_op_model", "ort_session_options", "register_ort_ops", "run_single_op"]
