"""Graph surgery: swap the decomposed subgraphs of an exported graph for vlkv plugin nodes.

An exporter that writes a decomposed subgraph (plain ONNX ops) which a vlkv plugin can replace records
it in the model's ``metadata_props`` (``vlkv.exporter.subgraphs``): the op, its boundary input tensors
in the op's input order, its output tensors and its attributes. :func:`rewrite_model` adds one plugin node
per record, wired to those tensors, detaches the outputs from their old producers, and lets
onnx-graphsurgeon's ``cleanup`` delete every node that no longer feeds a graph output. Nodes the
subgraph shared with the rest of the graph (the exporter may share e.g. an ``arange``) survive.

The plugin node is written in one of ``onnx_ops``' three forms: ``"trt"`` for TensorRT's ONNX parser
(default domain, op = plugin name, ``plugin_namespace``/``plugin_version`` attributes), ``"ort"`` for
ONNX Runtime with the onnxruntime-extensions reference ops (``vlkv.plugins.onnx_ort``), or
``"canonical"`` (domain ``vlkv``).

``AttnStats`` takes its threshold as an attribute, while the decoder graph takes ``stats_threshold``
at run time: the rewrite bakes a value in (the policy's ``threshold``; 0 = no counts), after which the
graph input is ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vlkv.exporter.subgraphs import SUBGRAPHS_KEY, set_subgraph_records, subgraph_records
from vlkv.plugins.onnx_ops import OP_ATTN_STATS, convert_model, get_spec, node_attributes

__all__ = ["SUBGRAPHS_KEY", "decoder_feeds_for", "rewrite", "rewrite_model", "subgraph_records"]
FORMS = ("canonical", "ort", "trt")
METRICS_FILE = "metrics.json"


@dataclass
class RewriteReport:
    """What a rewrite did.

    Attributes:
        replaced: per plugin op, how many subgraphs became plugin nodes.
        removed_nodes: names of the nodes the rewrite deleted.
        nodes_before, nodes_after: node counts of the graph.
    """

    replaced: dict[str, int] = field(default_factory=dict)
    removed_nodes: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0


def rewrite_model(model, ops=None, form: str = "trt", threshold: float = 0.0):
    """Replace the recorded decomposed subgraphs of ``model`` by plugin nodes.

    Args:
        model: an ``onnx.ModelProto`` carrying ``vlkv.subgraphs`` metadata.
        ops: op or plugin names to swap in (``["AttnStats"]`` or ``["attn_stats"]``); None = all recorded.
        form: "trt", "ort" or "canonical" (see the module docstring).
        threshold: the ``AttnStats`` threshold attribute, in [0, 1).

    Returns:
        ``(rewritten model, RewriteReport)``; the input model is not modified.
    """
    import onnx_graphsurgeon as gs

    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    wanted = None if ops is None else {get_spec(op).name for op in ops}
    records = [r for r in subgraph_records(model) if wanted is None or r["op"] in wanted]
    graph = gs.import_onnx(model)
    report = RewriteReport(nodes_before=len(graph.nodes))
    before = {n.name for n in graph.nodes}
    tensors = graph.tensors()
    for rec in records:
        graph.nodes.append(_plugin_node(gs, rec, tensors, threshold))
        report.replaced[rec["op"]] = report.replaced.get(rec["op"], 0) + 1
    graph.cleanup().toposort()
    report.nodes_after = len(graph.nodes)
    report.removed_nodes = sorted(before - {n.name for n in graph.nodes})
    out = gs.export_onnx(graph, do_type_check=False)
    out.ir_version = model.ir_version
    del out.metadata_props[:]
    for prop in model.metadata_props:
        out.metadata_props.add(key=prop.key, value=prop.value)
    set_subgraph_records(out, [r for r in subgraph_records(model) if r not in records])
    return convert_model(out, form), report


def _plugin_node(gs, rec: dict, tensors: dict, threshold: float):
    """The plugin node of one record (canonical form), stealing the record's output tensors."""
    from vlkv.plugins.onnx_ops import DOMAIN

    spec = get_spec(rec["op"])
    n_in = len(spec.inputs)
    missing = [t for t in rec["inputs"][:n_in] + rec["outputs"] if t not in tensors]
    if missing:
        raise ValueError(
            f"{rec['op']} subgraph (layer {rec.get('layer')}): tensors {missing} are not in the graph"
        )
    attrs = {}
    if spec.name == OP_ATTN_STATS:
        attrs = {"scale": rec["scale"], "causal": 1, "threshold": threshold}
    elif "scale" in spec.attrs:
        attrs = {"scale": rec["scale"]}
    inputs = [tensors[t] for t in rec["inputs"][:n_in]]
    outputs = [tensors[t] for t in rec["outputs"]]
    for tensor in outputs:
        tensor.inputs.clear()  # detach from the decomposed producer; cleanup() then drops the subgraph
    name = f"{spec.plugin}.{rec['layer']}" if "layer" in rec else None
    return gs.Node(spec.name, name=name, attrs=node_attributes(spec.name, **attrs), inputs=inputs,
                   outputs=outputs, domain=DOMAIN)  # fmt: skip


def policy_threshold(name: str, options: dict) -> float:
    """The threshold a policy asks statistics for (VL-Cache's ``p``); 0 for policies without one."""
    if "threshold" in options:
        return float(options["threshold"])
    from vlkv.runtime.policies import make_policy

    return float(getattr(make_policy(name), "threshold", None) or 0.0)


def rewrite(recipe, decoder_dir: str | Path, out_dir: str | Path) -> Path:
    """The ``plugin_graph`` stage: ``decoder_dir/decoder.onnx`` → ``out_dir/decoder.onnx`` in TensorRT form.

    The plugin set is ``recipe.plugins``; before writing, the graph is converted to the ORT form and
    checked against the decomposed graph with ONNX Runtime (float32 models only), and the maximum
    absolute difference goes to ``metrics.json``.
    """
    import onnx

    from vlkv.exporter.decoder_graph import DECODER_FILE
    from vlkv.runtime.onnx.export import save_model

    src = Path(decoder_dir) / DECODER_FILE
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist; run the decoder_onnx stage first")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(src))
    threshold = policy_threshold(recipe.policy.name, recipe.policy.options)
    trt_model, report = rewrite_model(model, recipe.plugins or [], "trt", threshold)
    metrics = {
        "replaced": report.replaced,
        "nodes_before": report.nodes_before,
        "nodes_after": report.nodes_after,
        "threshold": threshold,
    }
    if recipe.model.dtype == "float32" and report.replaced:
        metrics["max_abs_err_vs_decomposed"] = compare_with_decomposed(
            model, convert_model(trt_model, "ort"), threshold
        )
    save_model(trt_model, out_dir / DECODER_FILE)
    (out_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return out_dir


def compare_with_decomposed(original, rewritten_ort, threshold: float, seed: int = 0) -> float:
    """Max abs difference of every output between the decomposed graph and its ORT-form rewrite.

    Runs both in ONNX Runtime on random valid decoder inputs (per-layer past lengths all different).
    """
    import numpy as np
    import onnxruntime as ort

    from vlkv.plugins.onnx_ort import ort_session_options

    feeds = decoder_feeds_for(original, seed=seed)
    feeds["stats_threshold"] = np.array([threshold], dtype=np.float32)
    plain = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    plugged = ort.InferenceSession(
        rewritten_ort.SerializeToString(), ort_session_options(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in plain.get_outputs()]
    a, b = plain.run(names, feeds), plugged.run(names, feeds)
    return max((float(np.abs(x.astype(np.float64) - y).max()) if x.size else 0.0) for x, y in zip(a, b))


def decoder_feeds_for(model, batch: int = 2, rows: int = 3, seed: int = 0) -> dict:
    """Random valid numpy inputs for an exported decoder graph (``decoder_graph``'s contract).

    ``model`` is an ``onnx.ModelProto`` or a path (its external data is not loaded). Shapes are read
    off the graph's inputs (every layer gets a different past length) and every array has the dtype
    the graph declares for that input, so the feed runs unchanged in ONNX Runtime, in Polygraphy and
    against a TensorRT engine built from the graph or from its plugin rewrite.
    """
    import onnx
    import torch
    from onnx import helper

    from vlkv.exporter.decoder_graph import example_inputs
    from vlkv.runtime.models.adapter import LayerLayout

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    graph_inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    dims = {n: [d.dim_value for d in t.shape.dim] for n, t in graph_inputs.items()}
    n_layers = sum(1 for n in dims if n.startswith("past_key_values.") and n.endswith(".key"))
    _, kv_heads, _, head_dim = dims["past_key_values.0.key"]
    pos_dims = 3 if len(dims["position_ids"]) == 3 else 1
    layout = LayerLayout(n_layers, 0, kv_heads, head_dim, pos_dims)
    past = [2 * i + 1 for i in range(n_layers)]
    feeds = example_inputs(layout, dims["inputs_embeds"][2], torch.float32, past, batch, rows, seed)
    return {
        name: value.numpy().astype(helper.tensor_dtype_to_np_dtype(graph_inputs[name].elem_type))
        for name, value in feeds.items()
    }
