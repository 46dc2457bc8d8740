"""Graph surgery: decomposed statistics subgraphs → vlkv plugin nodes, checked in ONNX Runtime."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tests.exporter.test_decoder_onnx import MODELS, decoders, onnx_cache  # noqa: F401 - shared fixtures
from vlkv.exporter.graph_rewrite import decoder_feeds_for, rewrite, rewrite_model, subgraph_records
from vlkv.plugins.onnx_ops import ORT_DOMAIN
from vlkv.plugins.onnx_ort import ort_session_options

# op types that exist only inside the decomposed statistics (which read the attention's own softmax)
STATS_ONLY_OPS = {"ReduceSum", "ReduceMax", "Greater"}


@pytest.fixture(scope="module")
def models(decoders):  # noqa: F811
    return {name: onnx.load(str(path)) for name, path in decoders.items()}


def _decomposed_nodes(model, record) -> set[str]:
    """Names of the nodes between a record's boundary inputs and its outputs, walking producers."""
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, stack = set(), list(record["outputs"])
    while stack:
        tensor = stack.pop()
        node = producer.get(tensor)
        if node is None or node.name in seen or tensor in record["inputs"]:
            continue
        seen.add(node.name)
        stack.extend(node.input)
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_plugin_nodes_replace_the_decomposed_stats(name, models):
    model = models[name]
    records = subgraph_records(model)
    out, report = rewrite_model(model, ["AttnStats"], "ort", threshold=0.05)
    assert report.replaced == {"AttnStats": 4}
    plugins = [n for n in out.graph.node if n.domain == ORT_DOMAIN]
    assert [n.op_type for n in plugins] == ["AttnStats"] * 4
    for node, rec in zip(sorted(plugins, key=lambda n: n.name), records):
        assert list(node.input) == rec["inputs"][:5] and list(node.output) == rec["outputs"]
    remaining = {n.name for n in out.graph.node}
    for rec in records:
        exclusive = _decomposed_nodes(model, rec) - remaining
        assert len(exclusive) > 50  # the bulk of each decomposed subgraph is gone ...
        assert exclusive <= set(report.removed_nodes)
    assert not remaining & set(report.removed_nodes)  # ... and no removed node survives
    assert not STATS_ONLY_OPS & {n.op_type for n in out.graph.node}
    assert {n.op_type for n in model.graph.node} >= STATS_ONLY_OPS
    assert report.nodes_after == len(out.graph.node) < report.nodes_before - 4 * 50
    assert subgraph_records(out) == []  # nothing left to rewrite


# one ORT session pair per model (sessions of ~1000 nodes take a second to build)
@pytest.mark.parametrize(("name", "threshold"), [("tiny-llava", 0.05), ("tiny-qwen2-vl", 0.1)])
def test_rewritten_graph_matches_the_original_in_ort(name, threshold, models):
    model = models[name]
    out, _ = rewrite_model(model, None, "ort", threshold=threshold)
    feeds = decoder_feeds_for(model, batch=3, rows=4, seed=7)
    feeds["stats_threshold"] = np.array([threshold], dtype=np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    plugged = ort.InferenceSession(
        out.SerializeToString(), ort_session_options(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in plain.get_outputs()]
    assert names == [o.name for o in plugged.get_outputs()]
    for n, a, b in zip(names, plain.run(names, feeds), plugged.run(names, feeds)):
        a, b = torch.from_numpy(a), torch.from_numpy(b)
        if n.startswith("attn_colsum"):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=n)
        else:  # logits, presents: untouched nodes; counts: integers
            assert torch.equal(a, b), n
    assert sum(int(plugged.run([f"attn_below.{i}"], feeds)[0].sum()) for i in range(4)) > 0  # counts are live


def test_trt_form_carries_plugin_attributes(models):
    out, _ = rewrite_model(models["tiny-llava"], ["attn_stats"], "trt", threshold=0.01)
    nodes = [n for n in out.graph.node if n.op_type == "attn_stats"]
    assert len(nodes) == 4 and {n.domain for n in nodes} == {""}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"vlkv" and attrs["plugin_version"] == b"1"
    assert attrs["scale"] == pytest.approx(0.25) and attrs["threshold"] == pytest.approx(0.01)
    assert attrs["causal"] == 1
    assert "vlkv" not in {o.domain for o in out.opset_import}


def test_empty_plugin_set_changes_nothing(models):
    model = models["tiny-qwen2-vl"]
    out, report = rewrite_model(model, [], "trt")
    assert report.replaced == {} and report.removed_nodes == []
    assert Counter(n.op_type for n in out.graph.node) == Counter(n.op_type for n in model.graph.node)
    assert subgraph_records(out) == subgraph_records(model)


def test_broken_record_fails_with_one_line(models):
    model = onnx.ModelProto()
    model.CopyFrom(models["tiny-llava"])
    records = subgraph_records(model)
    records[1]["inputs"][0] = "no.such.tensor"
    next(p for p in model.metadata_props if p.key == "vlkv.subgraphs").value = json.dumps(records)
    with pytest.raises(ValueError, match=r"layer 1\): tensors \['no.such.tensor'\]"):
        rewrite_model(model)
    with pytest.raises(ValueError, match="unknown vlkv op"):
        rewrite_model(model, ["Softmax"])


def test_plugin_graph_stage(tmp_path, decoders):  # noqa: F811
    from vlkv.exporter.recipe_loader import load_recipe

    recipe = load_recipe("recipes/demo.yaml", ["policy.name=vlcache", "policy.budget=0.2"])
    decoder_dir = decoders["tiny-llava"].parent
    rewrite(recipe, decoder_dir, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["replaced"] == {"AttnStats": 4}
    assert metrics["threshold"] == pytest.approx(0.01)  # VL-Cache's default p, baked into the plugin
    assert metrics["max_abs_err_vs_decomposed"] < 1e-5
    out = onnx.load(str(tmp_path / "decoder.onnx"))
    assert Counter(n.op_type for n in out.graph.node)["attn_stats"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_feed_builder_uses_the_graph_input_dtypes(dtype, onnx_cache):  # noqa: F811
    """``decoder_feeds_for`` (what the TensorRT comparison feeds) runs as is: int64 lengths and
    indices, float32 threshold, the model dtype for embeddings and K/V, read off the graph."""
    from vlkv.exporter.decoder_onnx import cached_decoder
    from vlkv.runtime.models.registry import load_model

    loaded = load_model("tiny-llava", dtype=dtype)
    path = cached_decoder(loaded.model, loaded.family)
    model = onnx.load(str(path), load_external_data=False)
    feeds = decoder_feeds_for(path, seed=3)  # a path works as well as a ModelProto
    declared = {
        i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input
    }
    assert {n: f.dtype for n, f in feeds.items()} == declared
    assert feeds["past_lengths"].dtype == np.int64 and feeds["stats_threshold"].dtype == np.float32
    assert feeds["inputs_embeds"].dtype == {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    assert np.isfinite(logits.astype(np.float32)).all()


def test_decoder_export_and_rewrite_do_not_import_each_other():
    """The stage modules share the graph contract (``decoder_graph``, ``subgraphs``), not each other."""
    import ast
    from pathlib import Path

    import vlkv.exporter

    root = Path(vlkv.exporter.__file__).parent

    def imports(name: str) -> set[str]:
        tree = ast.parse((root / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        return found

    assert "vlkv.exporter.graph_rewrite" not in imports("decoder_onnx")
    assert "vlkv.exporter.decoder_onnx" not in imports("graph_rewrite")
    for shared in ("decoder_graph", "subgraphs"):
        assert not {"vlkv.exporter.graph_rewrite", "vlkv.exporter.decoder_onnx"} & imports(shared)
