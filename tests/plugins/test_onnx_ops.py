"""vlkv ONNX ops: specs, the three node forms, and ONNX Runtime (CPU) execution == reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.plugins.cases import LOWRANK_CASES, MERGE_CASES, SELECT_CASES, STATS_CASES
from vlkv.plugins import onnx_ops
from vlkv.plugins.reference import attn_stats_reference, merge_kv_reference, selected_attention_reference

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions is not installed")
onnx_ort = pytest.importorskip("vlkv.plugins.onnx_ort")


def _np(x: torch.Tensor) -> np.ndarray:
    return x.numpy()


@pytest.mark.parametrize("case", STATS_CASES[1:3], ids=repr)
def test_attn_stats_ort_matches_reference(case):
    args = case.make(torch.float32)
    q, k = args["q"], args["k"]
    rows = args.get("query_rows", torch.ones(case.batch, case.queries, dtype=torch.bool))
    lengths = args.get("key_lengths", torch.full((case.batch,), case.keys))
    offset = args.get("q_offset", lengths - case.queries)
    feeds = {"q": _np(q), "k": _np(k), "query_rows": _np(rows.long()), "key_lengths": _np(lengths)}
    feeds["q_offset"] = _np(offset)
    colsum, below, visible = onnx_ort.run_single_op(
        "AttnStats", feeds, scale=args["scale"], causal=1, threshold=args["threshold"]
    )
    ref = attn_stats_reference(q, k, args["scale"], rows, True, args["threshold"], lengths, offset)
    torch.testing.assert_close(torch.from_numpy(colsum), ref.colsum, rtol=1e-6, atol=1e-6)
    assert np.array_equal(below, ref.below.numpy()) and np.array_equal(visible, ref.visible.numpy())


def test_attn_stats_ort_zero_threshold_counts_nothing():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8)
    feeds = {"q": _np(q), "k": _np(k), "query_rows": np.ones((1, 3), np.int64)}
    feeds |= {"key_lengths": np.array([6]), "q_offset": np.array([3])}
    _, below, visible = onnx_ort.run_single_op("AttnStats", feeds, scale=0.4)
    assert below.tolist() == [[0, 0]] and visible.tolist() == [[4 + 5 + 6] * 2]


def test_selected_attention_ort_matches_reference():
    args = SELECT_CASES[2].make(torch.float32)
    feeds = {name: _np(args[name]) for name in ("q", "k", "v", "indices", "lengths")}
    (out,) = onnx_ort.run_single_op("SelectedAttention", feeds, scale=args["scale"])
    ref = selected_attention_reference(**args)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-6, atol=1e-6)


def test_lowrank_attention_ort_matches_reference():
    from vlkv.plugins.lowrank_reference import lowrank_decode_attention

    args = LOWRANK_CASES[1].make(torch.float32)
    (out,) = onnx_ort.run_single_op("LowRankAttention", {n: _np(x) for n, x in args.items()}, scale=0.3)
    ref = lowrank_decode_attention(**args, scale=0.3)
    assert out.shape == (2, 6, 16)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-6, atol=1e-6)


def test_merge_kv_ort_matches_reference():
    args = MERGE_CASES[2].make(torch.float32)
    k_out, v_out = onnx_ort.run_single_op("MergeKV", {name: _np(x) for name, x in args.items()})
    k_ref, v_ref = merge_kv_reference(**args)
    torch.testing.assert_close(torch.from_numpy(k_out), k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(v_out), v_ref, rtol=1e-6, atol=1e-6)


def test_paged_attention_ort_matches_reference():
    from tests.plugins.paged_cases import CASES
    from vlkv.plugins.paged_reference import paged_attention_reference

    args = CASES[4].make(torch.float32)  # holes, ragged rows, four query rows
    feeds = {name: _np(args[name]) for name in ("q", "k_pool", "v_pool", "table", "lengths")}
    (out,) = onnx_ort.run_single_op("PagedAttention", feeds, scale=args["scale"])
    ref = paged_attention_reference(**args)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", sorted(onnx_ops.OPS))
def test_forms_round_trip(op):
    model = onnx_ort.make_single_op_model(op, "canonical", **({"scale": 0.25} if op != "MergeKV" else {}))
    trt = onnx_ops.convert_model(model, "trt")
    node = trt.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "" and node.op_type == onnx_ops.OPS[op].plugin
    assert attrs["plugin_namespace"] == b"vlkv" and attrs["plugin_version"] == b"1" and attrs["aot"] == 1
    assert {o.domain for o in trt.opset_import} == {""}
    back = onnx_ops.convert_model(onnx_ops.convert_model(trt, "ort"), "canonical")
    assert back.graph.node[0].domain == onnx_ops.DOMAIN and back.graph.node[0].op_type == op
    assert back.graph.node[0].attribute == model.graph.node[0].attribute


def test_schemas_register_and_check():
    onnx_ops.register_onnx_schemas()
    onnx_ops.register_onnx_schemas()  # idempotent
    schema = onnx.defs.get_schema("AttnStats", 1, onnx_ops.DOMAIN)
    assert [p.name for p in schema.inputs] == ["q", "k", "query_rows", "key_lengths", "q_offset"]
    assert set(schema.attributes) == {"scale", "causal", "threshold"}
    onnx.checker.check_model(onnx_ort.make_single_op_model("MergeKV", "canonical"), full_check=True)


def test_bad_attributes_and_ops_are_named():
    with pytest.raises(ValueError, match="no attribute"):
        onnx_ops.node_attributes("MergeKV", scale=1.0)
    with pytest.raises(ValueError, match="unknown vlkv op"):
        onnx_ops.get_spec("Softmax")
    with pytest.raises(ValueError, match="form"):
        onnx_ops.make_node("MergeKV", ["k", "v", "a", "c"], ["ko", "vo"], form="tensorrt")
