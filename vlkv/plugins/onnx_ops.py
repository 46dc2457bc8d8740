"""ONNX custom ops of the ``vlkv`` domain: schemas, node builders and the three forms of a node.

One op, three spellings (a graph-surgeon pass writes the canonical one, then converts):
- canonical: ``domain="vlkv"``, op type ``AttnStats`` / ``SelectedAttention`` / ``MergeKV`` /
  ``LowRankAttention`` / ``PagedAttention``;
- ONNX Runtime test double: same op type in ``ai.onnx.contrib``, executed by the onnxruntime-extensions
  Python ops in ``onnx_ort.py`` (CPU, float32 only);
- TensorRT parser: default domain, op type = plugin name (``attn_stats`` ...), string attribute
  ``plugin_namespace="vlkv"``, ``plugin_version="1"`` and int ``aot=1`` to pick the AOT implementation
  registered in ``trt_plugins.py`` (toolchain.md B6; whether the parser checks the domain is unverified,
  hence the default domain).

Every attribute is always written: onnxruntime-extensions refuses a node that omits a declared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DOMAIN = "vlkv"
ORT_DOMAIN = "ai.onnx.contrib"
DOMAIN_VERSION = 1
PLUGIN_NAMESPACE = "vlkv"
PLUGIN_VERSION = "1"

OP_ATTN_STATS = "AttnStats"
OP_SELECTED_ATTENTION = "SelectedAttention"
OP_MERGE_KV = "MergeKV"
OP_LOWRANK_ATTENTION = "LowRankAttention"
OP_PAGED_ATTENTION = "PagedAttention"


@dataclass(frozen=True)
class Port:
    """One input or output: name, ONNX element type name ("float", "int64"), shape and meaning."""

    name: str
    elem_type: str
    shape: tuple[str, ...]
    doc: str

    def __post_init__(self) -> None:
        if self.elem_type not in ("float", "int64"):
            raise ValueError(f"Port.elem_type must be 'float' or 'int64', got {self.elem_type!r}")


@dataclass(frozen=True)
class Attr:
    """One attribute: ONNX type ("float" or "int"), default value and meaning."""

    kind: str
    default: float | int
    doc: str

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int"):
            raise ValueError(f"Attr.kind must be 'float' or 'int', got {self.kind!r}")


@dataclass(frozen=True)
class OpSpec:
    """A custom op's documented signature; the ONNX schema, the ORT double and the TRT plugin follow it."""

    name: str
    plugin: str
    doc: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attrs: dict[str, Attr] = field(default_factory=dict)


OPS: dict[str, OpSpec] = {
    OP_ATTN_STATS: OpSpec(
        name=OP_ATTN_STATS,
        plugin="attn_stats",
        doc="Column sums and below-threshold counts of softmax(q k^T * scale); see reference.attn_stats_reference.",
        inputs=(
            Port("q", "float", ("B", "H", "Q", "D"), "post-RoPE queries"),
            Port("k", "float", ("B", "Hkv", "S", "D"), "keys; query head h reads KV head h // (H / Hkv)"),
            Port("query_rows", "int64", ("B", "Q"), "nonzero = the row is included"),
            Port("key_lengths", "int64", ("B",), "keys j >= key_lengths[b] are padding"),
            Port("q_offset", "int64", ("B",), "cache slot of query row 0 (key_lengths - Q for prefill)"),
        ),
        outputs=(
            Port("colsum", "float", ("B", "H", "S"), "sum of probabilities over the included rows"),
            Port("below", "int64", ("B", "H"), "visible entries with prob < threshold * row max"),
            Port("visible", "int64", ("B", "H"), "visible entries over the included rows"),
        ),
        attrs={
            "scale": Attr("float", 1.0, "softmax scale, usually head_dim ** -0.5"),
            "causal": Attr("int", 1, "1: row i sees keys j <= q_offset + i; 0: every valid key"),
            "threshold": Attr("float", 0.0, "relative threshold p; 0 disables counting (below is 0)"),
        },
    ),
    OP_SELECTED_ATTENTION: OpSpec(
        name=OP_SELECTED_ATTENTION,
        plugin="selected_attention",
        doc="Attention of every query row over the selected K/V slots of its KV head, no causal mask.",
        inputs=(
            Port("q", "float", ("B", "H", "Q", "D"), "queries"),
            Port("k", "float", ("B", "Hkv", "S", "D"), "key cache"),
            Port("v", "float", ("B", "Hkv", "S", "D"), "value cache"),
            Port("indices", "int64", ("B", "Hkv", "K"), "selected slots; entries at >= lengths are ignored"),
            Port("lengths", "int64", ("B", "Hkv"), "number of valid indices (0 gives zeros)"),
        ),
        outputs=(Port("out", "float", ("B", "H", "Q", "D"), "attention output, q's dtype"),),
        attrs={"scale": Attr("float", 1.0, "softmax scale")},
    ),
    OP_MERGE_KV: OpSpec(
        name=OP_MERGE_KV,
        plugin="merge_kv",
        doc="Mean of the K/V rows assigned to each target slot; empty targets are zero.",
        inputs=(
            Port("k", "float", ("B", "Hkv", "S", "D"), "keys"),
            Port("v", "float", ("B", "Hkv", "S", "D"), "values"),
            Port("assign", "int64", ("B", "Hkv", "S"), "target slot in [0, S_out) or -1 to drop"),
            Port("counts", "int64", ("B", "Hkv", "S_out"), "sources per target; fixes S_out"),
        ),
        outputs=(
            Port("k_out", "float", ("B", "Hkv", "S_out", "D"), "merged keys"),
            Port("v_out", "float", ("B", "Hkv", "S_out", "D"), "merged values"),
        ),
    ),
    OP_LOWRANK_ATTENTION: OpSpec(
        name=OP_LOWRANK_ATTENTION,
        plugin="lowrank_attention",
        doc="One decode row per sample over post-RoPE low-rank factors (scores (q Dk^T) Kbar^T, output "
        "(p Vbar) Dv) and dense entries in one softmax; see lowrank_reference.lowrank_decode_attention.",
        inputs=(
            Port("q", "float", ("B", "H", "D"), "post-RoPE queries of the decode row"),
            Port("kbar", "float", ("B", "T", "Rk"), "post-RoPE key factor rows (left singular vectors x S)"),
            Port("dk", "float", ("B", "Rk", "C"), "key basis, C = Hkv * D (heads concatenated)"),
            Port("vbar", "float", ("B", "T", "Rv"), "value factor rows"),
            Port("dv", "float", ("B", "Rv", "C"), "value basis"),
            Port("rows", "int64", ("B",), "valid factor rows; rows >= rows[b] are padding"),
            Port("k", "float", ("B", "Hkv", "S", "D"), "dense keys (text)"),
            Port("v", "float", ("B", "Hkv", "S", "D"), "dense values"),
            Port("dense_len", "int64", ("B",), "valid dense entries"),
        ),
        outputs=(
            Port("out", "float", ("B", "H", "D"), "attention output, q's dtype; zeros if nothing is visible"),
        ),
        attrs={"scale": Attr("float", 1.0, "softmax scale, usually head_dim ** -0.5")},
    ),
    OP_PAGED_ATTENTION: OpSpec(
        name=OP_PAGED_ATTENTION,
        plugin="paged_attention",
        doc="Causal attention reading K/V from one layer's pool through per-request, per-KV-head slot "
        "tables; see paged_reference.paged_attention_reference (no pre-RoPE rotation in this op).",
        inputs=(
            Port(
                "q",
                "float",
                ("B", "H", "Q", "D"),
                "queries; query i sees its row's first lengths - Q + i + 1 columns",
            ),
            Port("k_pool", "float", ("Hkv", "S", "D"), "one layer's key pool"),
            Port("v_pool", "float", ("Hkv", "S", "D"), "one layer's value pool"),
            Port(
                "table", "int64", ("B", "Hkv", "C"), "slot of each column; past lengths: padding; < 0: a hole"
            ),
            Port("lengths", "int64", ("B", "Hkv"), "valid columns per request and KV head (0 gives zeros)"),
        ),
        outputs=(Port("out", "float", ("B", "H", "Q", "D"), "attention output, q's dtype"),),
        attrs={"scale": Attr("float", 1.0, "softmax scale")},
    ),
}

# Reverse map for a pass that meets a node already in TensorRT form.
OP_BY_PLUGIN: dict[str, str] = {spec.plugin: name for name, spec in OPS.items()}


def get_spec(op: str) -> OpSpec:
    """The spec of ``op`` (ONNX op type or plugin name); the error lists the known ops."""
    name = OP_BY_PLUGIN.get(op, op)
    if name not in OPS:
        raise ValueError(f"unknown vlkv op {op!r}; known: {sorted(OPS)} (plugins {sorted(OP_BY_PLUGIN)})")
    return OPS[name]


def node_attributes(op: str, **attrs: float | int) -> dict[str, float | int]:
    """Every declared attribute of ``op``: the defaults overridden by ``attrs``; unknown names are an error."""
    spec = get_spec(op)
    unknown = set(attrs) - set(spec.attrs)
    if unknown:
        raise ValueError(f"{spec.name} has no attribute(s) {sorted(unknown)}; it takes {sorted(spec.attrs)}")
    out: dict[str, float | int] = {}
    for name, attr in spec.attrs.items():
        value = attrs.get(name, attr.default)
        out[name] = float(value) if attr.kind == "float" else int(value)
    return out


def make_node(
    op: str, inputs: list[str], outputs: list[str], form: str = "canonical", name: str | None = None, **attrs
):
    """An ``onnx.NodeProto`` for ``op`` in one of the forms "canonical", "ort" or "trt"."""
    from onnx import helper

    spec = get_spec(op)
    if len(inputs) != len(spec.inputs) or len(outputs) != len(spec.outputs):
        raise ValueError(
            f"{spec.name} takes inputs {[p.name for p in spec.inputs]} and outputs {[p.name for p in spec.outputs]}"
        )
    values = node_attributes(spec.name, **attrs)
    if form == "canonical":
        return helper.make_node(spec.name, inputs, outputs, name=name, domain=DOMAIN, **values)
    if form == "ort":
        return helper.make_node(spec.name, inputs, outputs, name=name, domain=ORT_DOMAIN, **values)
    if form == "trt":
        return helper.make_node(
            spec.plugin, inputs, outputs, name=name, domain="",
            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, aot=1, **values,
        )  # fmt: skip
    raise ValueError(f"form must be 'canonical', 'ort' or 'trt', got {form!r}")


def convert_model(model, form: str):
    """Copy of ``model`` with every vlkv node (any form) rewritten into ``form``; other nodes untouched."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    del out.graph.node[:]
    for node in nodes:
        is_vlkv = (node.domain in (DOMAIN, ORT_DOMAIN) and node.op_type in OPS) or (
            node.domain == "" and node.op_type in OP_BY_PLUGIN
        )
        if not is_vlkv:
            out.graph.node.append(node)
            continue
        spec = get_spec(node.op_type)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name in spec.attrs}
        out.graph.node.append(
            make_node(spec.name, list(node.input), list(node.output), form, node.name, **attrs)
        )
    wanted = {"canonical": DOMAIN, "ort": ORT_DOMAIN, "trt": None}[form]
    imports = [o for o in out.opset_import if o.domain not in (DOMAIN, ORT_DOMAIN)]
    del out.opset_import[:]
    out.opset_import.extend(imports)
    if wanted is not None:
        out.opset_import.append(onnx.helper.make_opsetid(wanted, DOMAIN_VERSION))
    return out


_SCHEMAS_REGISTERED = False


def register_onnx_schemas() -> None:
    """Register the canonical ops with ``onnx.defs`` so the checker and tooling know them (idempotent)."""
    global _SCHEMAS_REGISTERED
    if _SCHEMAS_REGISTERED:
        return
    from onnx import defs

    attr_types = {"float": defs.OpSchema.AttrType.FLOAT, "int": defs.OpSchema.AttrType.INT}
    for spec in OPS.values():
        if defs.has(spec.name, DOMAIN):
            continue
        constraints = [("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "floating tensors")]

        def formal(port: Port) -> defs.OpSchema.FormalParameter:
            type_str = "T" if port.elem_type == "float" else f"tensor({port.elem_type})"
            if port.name == "colsum":
                type_str = "tensor(float)"
            return defs.OpSchema.FormalParameter(port.name, type_str, f"{port.shape}: {port.doc}")

        schema = defs.OpSchema(
            spec.name,
            DOMAIN,
            DOMAIN_VERSION,
            spec.doc,
            inputs=[formal(p) for p in spec.inputs],
            outputs=[formal(p) for p in spec.outputs],
            type_constraints=constraints,
            attributes=[
                defs.OpSchema.Attribute(n, attr_types[a.kind], a.doc, required=False)
                for n, a in spec.attrs.items()
            ],
        )
        defs.register_schema(schema)
    _SCHEMAS_REGISTERED = True
