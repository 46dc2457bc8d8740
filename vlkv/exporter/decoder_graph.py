"""The single-graph language decoder: one ONNX graph for prefill and decode over per-layer caches.

The graph runs one step of the LM on a vlkv cache (see ``vlkv.runtime.cache``); it is what TensorRT
builds its decoder engine from. I/O, named as optimum names them where a counterpart exists
(toolchain.md A9); ``L`` layers, ``q`` new rows, ``P_l`` the past slots fed for layer ``l`` (each layer
has its own dynamic axis ``past_sequence_length_l``):

inputs
    ``inputs_embeds``     (B, q, hidden)     token embeddings, image features already spliced in
    ``position_ids``      (B, q) int64       1-D RoPE positions; for M-RoPE (Qwen2-VL) ``(3, B, q)``,
                                             the (temporal, height, width) layout of HF's ``get_rope_index``
    ``past_lengths``      (L, B) int64       valid past entries per layer and sample (right-padded past)
    ``new_lengths``       (B,) int64         valid new rows per sample (right-padded rows)
    ``logits_index``      (B, r) int64       rows whose logits are computed (the last valid row, or all)
    ``stats_rows``        (B, q) int64       nonzero = the row enters the attention statistics
    ``stats_threshold``   (1,) float32       relative threshold p of the below-threshold counts
    ``past_key_values.l.key|value``  (B, Hkv, P_l, D)  post-RoPE keys / values of layer ``l``
outputs
    ``logits``            (B, r, V)
    ``present.l.key|value``  (B, Hkv, P_l + q, D)  the cache after the step: slots ``[0, past[b])`` are
                                             the past, ``[past[b], past[b] + q)`` the new rows (so with no
                                             padding it is optimum's ``concat(past, new)``); the rest is 0
    ``attn_colsum.l``     (B, H, P_l + q) float32  softmax column sums over the ``stats_rows``
    ``attn_below.l``      (B, H) int64       visible entries with prob < threshold × row max
    ``attn_visible.l``    (B, H) int64       visible entries over the ``stats_rows``

Each layer is ``vlkv.runtime.onnx.layer_step.LayerStep`` (the module the ONNX Runtime backend's
per-layer graphs are traced from): attention scores are computed once per layer and the statistics
are read off the same softmax, as plain ONNX ops. The statistics' boundary tensors (query, present
key, rows, key lengths, query offset, threshold) carry stable names, recorded in the model's
``metadata_props`` (``vlkv.exporter.subgraphs``), so ``vlkv.exporter.graph_rewrite`` can hang the
``AttnStats`` plugin on them; the nodes only the statistics use then drop out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vlkv.plugins.onnx_ops import OP_ATTN_STATS
from vlkv.runtime.models.adapter import FamilyAdapter
from vlkv.runtime.onnx.layer_graphs import check_exportable, positions_to_rotary
from vlkv.runtime.onnx.layer_step import STATS_ROLES, LayerStep

# Bump when the graph's I/O contract or its statistics subgraph changes (it enters the cache key).
EXPORT_FORMAT = 2
DECODER_FILE = "decoder.onnx"
STATS_OUTPUTS = ("colsum", "below", "visible")
# A private domain for the tracing-time marks; none survives the export.
MARK_DOMAIN = "vlkv.mark"


@dataclass(frozen=True)
class DecoderIO:
    """Names and dynamic axes of the decoder graph for ``num_layers`` layers (see the module docstring)."""

    num_layers: int
    pos_dims: int

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    @property
    def stats_names(self) -> list[str]:
        return [f"attn_{s}.{i}" for i in range(self.num_layers) for s in STATS_OUTPUTS]

    @property
    def input_names(self) -> list[str]:
        head = ["inputs_embeds", "position_ids", "past_lengths", "new_lengths", "logits_index"]
        return head + ["stats_rows", "stats_threshold"] + self.past_names

    @property
    def output_names(self) -> list[str]:
        return ["logits"] + self.present_names + self.stats_names

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        b, q = "batch_size", "sequence_length"
        pos = {0: b, 1: q} if self.pos_dims == 1 else {1: b, 2: q}
        axes = {
            "inputs_embeds": {0: b, 1: q},
            "position_ids": pos,
            "past_lengths": {1: b},
            "new_lengths": {0: b},
            "logits_index": {0: b, 1: "logits_rows"},
            "stats_rows": {0: b, 1: q},
            "logits": {0: b, 1: "logits_rows"},
        }
        for i in range(self.num_layers):
            past, total = f"past_sequence_length_{i}", f"total_sequence_length_{i}"
            for kv in ("key", "value"):
                axes[f"past_key_values.{i}.{kv}"] = {0: b, 2: past}
                axes[f"present.{i}.{kv}"] = {0: b, 2: total}
            axes[f"attn_colsum.{i}"] = {0: b, 2: total}
            axes[f"attn_below.{i}"] = {0: b}
            axes[f"attn_visible.{i}"] = {0: b}
        return axes


class _Mark(torch.autograd.Function):
    """Identity that the legacy exporter writes as ``vlkv.mark::Mark(name=...)``.

    The TorchScript exporter names intermediate tensors itself (``/Add_3_output_0``); a mark pins a
    stable name on a statistics boundary tensor, so the rewrite pass finds it without guessing.
    :func:`install_marks` turns marks into ``Identity`` nodes whose outputs carry those names.
    """

    @staticmethod
    def forward(ctx, x: Tensor, name: str) -> Tensor:
        return x.clone()

    @staticmethod
    def symbolic(g, x, name: str):
        out = g.op(f"{MARK_DOMAIN}::Mark", x, name_s=name)
        out.setType(x.type())  # an identity: same type and shape, so shape inference goes on through it
        return out


def _marker(layer: int):
    def mark(x: Tensor, role: str) -> Tensor:
        return _Mark.apply(x, f"stats.{layer}.{role}") if torch.onnx.is_in_onnx_export() else x

    return mark


class DecoderStep(nn.Module):
    """One decoder step on explicit per-layer KV (see the module docstring for the I/O contract)."""

    def __init__(self, adapter: FamilyAdapter):
        super().__init__()
        check_exportable(adapter)
        self.adapter, self.layout = adapter, adapter.layout
        self.steps = nn.ModuleList(
            LayerStep(layer, adapter.layout, _marker(i)) for i, layer in enumerate(adapter.layers)
        )
        self.norm, self.lm_head = adapter.norm, adapter.lm_head

    @property
    def scale(self) -> float:
        return self.steps[0].scale

    def forward(
        self,
        inputs_embeds: Tensor,
        position_ids: Tensor,
        past_lengths: Tensor,
        new_lengths: Tensor,
        logits_index: Tensor,
        stats_rows: Tensor,
        stats_threshold: Tensor,
        *past: Tensor,
    ):
        hidden = inputs_embeds
        cos, sin = positions_to_rotary(self.adapter, hidden, position_ids)
        presents, stats = [], []
        for idx, step in enumerate(self.steps):
            hidden, _, _, present_k, present_v, *layer_stats = step(
                hidden,
                cos,
                sin,
                past[2 * idx],
                past[2 * idx + 1],
                past_lengths[idx],
                new_lengths,
                stats_rows,
                stats_threshold,
            )
            presents += [present_k, present_v]
            stats += layer_stats
        hidden = self.norm(hidden)
        index = logits_index[..., None].expand(-1, -1, hidden.shape[-1])
        logits = self.lm_head(torch.gather(hidden, 1, index))
        return (logits, *presents, *stats)


def install_marks(proto, io: DecoderIO, scale: float) -> list[dict]:
    """Turn each ``Mark`` node of ``proto`` into ``Identity`` writing its stable name (in place) and
    return the per-layer ``AttnStats`` subgraph records."""
    from onnx import helper

    records = [
        {"op": OP_ATTN_STATS, "layer": i, "inputs": [], "outputs": [f"attn_{s}.{i}" for s in STATS_OUTPUTS]}
        for i in range(io.num_layers)
    ]
    renames: dict[str, str] = {}
    nodes = []
    for node in proto.graph.node:
        if node.domain != MARK_DOMAIN:
            nodes.append(node)
            continue
        name = helper.get_attribute_value(node.attribute[0]).decode()
        renames[node.output[0]] = name
        nodes.append(helper.make_node("Identity", [node.input[0]], [name], name=f"mark/{name}"))
        _, layer, role = name.split(".")
        records[int(layer)]["inputs"].append((STATS_ROLES.index(role), name))
    for node in nodes:
        node.input[:] = [renames.get(n, n) for n in node.input]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    for rec in records:
        rec["inputs"] = [name for _, name in sorted(rec["inputs"])]
        rec["scale"] = scale
        if len(rec["inputs"]) != len(STATS_ROLES):
            raise RuntimeError(f"layer {rec['layer']}: stats boundary marks {rec['inputs']} are incomplete")
    kept = [o for o in proto.opset_import if o.domain != MARK_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)
    return records


def example_inputs(
    layout,
    hidden_size: int,
    dtype: torch.dtype,
    past: list[int],
    batch: int = 2,
    rows: int = 3,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Random, valid inputs of the decoder graph by name: ``past[l]`` slots for layer ``l``.

    Sample ``b`` gets ``past[l] - b`` valid past entries (clamped at 0) and ``rows - b`` valid new rows
    (at least 1), so padding is exercised in every layer.
    """
    gen = torch.Generator().manual_seed(seed)
    io = DecoderIO(layout.num_layers, layout.pos_dims)
    new_len = torch.tensor([max(rows - s, 1) for s in range(batch)])
    past_len = torch.tensor([[max(p - s, 0) for s in range(batch)] for p in past])
    pos = past_len.max(0).values[:, None] + torch.arange(rows)[None, :]  # (B, q)
    feeds = {
        "inputs_embeds": torch.randn(batch, rows, hidden_size, generator=gen).to(dtype),
        "position_ids": pos if layout.pos_dims == 1 else pos[None].expand(3, -1, -1).contiguous(),
        "past_lengths": past_len,
        "new_lengths": new_len,
        "logits_index": torch.arange(rows)[None].expand(batch, -1).contiguous(),
        "stats_rows": torch.ones(batch, rows, dtype=torch.long),
        "stats_threshold": torch.tensor([0.05]),
    }
    for i, p in enumerate(past):
        for kv in ("key", "value"):
            shape = (batch, layout.num_kv_heads, p, layout.head_dim)
            feeds[f"past_key_values.{i}.{kv}"] = torch.randn(*shape, generator=gen).to(dtype)
    assert list(feeds) == io.input_names
    return feeds
