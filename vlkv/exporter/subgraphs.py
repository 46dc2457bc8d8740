"""The ``vlkv.subgraphs`` metadata: decomposed subgraphs of an exported graph that a plugin can replace.

An exporter records each such subgraph in the model's ``metadata_props`` under :data:`SUBGRAPHS_KEY`
as a JSON list of ``{"op", "layer", "inputs", "outputs", ...attributes}``: the plugin op (``AttnStats``,
``SelectedAttention``, ``MergeKV``; see ``vlkv.plugins.onnx_ops.OPS``), its boundary input tensors in
the op's input order and its output tensors. ``vlkv.exporter.graph_rewrite`` reads them.
"""

from __future__ import annotations

import json

SUBGRAPHS_KEY = "vlkv.subgraphs"


def subgraph_records(model) -> list[dict]:
    """The decomposed-subgraph records an ``onnx.ModelProto`` carries (empty when there are none)."""
    for prop in model.metadata_props:
        if prop.key == SUBGRAPHS_KEY:
            return json.loads(prop.value)
    return []


def set_subgraph_records(model, records: list[dict]) -> None:
    """Replace ``model``'s records by ``records`` (none left = no key)."""
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != SUBGRAPHS_KEY]
    del model.metadata_props[:]
    for key, value in kept:
        model.metadata_props.add(key=key, value=value)
    if records:
        model.metadata_props.add(key=SUBGRAPHS_KEY, value=json.dumps(records))
