"""The decoder split at layer boundaries: one ONNX graph per layer plus a head graph.

The ONNX Runtime backend runs these one after the other, so between two layers it can do what a
single graph cannot: gather each layer's K/V by a policy's attend indices (A-VL's core-only decode)
and drop rows after a layer (A-VL's prefill filter), exactly as the PyTorch backend does.

``layer.{l}.onnx`` (``q`` new rows, ``P`` past slots fed, ``R`` row sets, ``S = P + q``)
    inputs   ``hidden_states``  (B, q, hidden)    model dtype
             ``position_ids``   (B, q) int64, or ``(3, B, q)`` for M-RoPE (Qwen2-VL)
             ``past_key``, ``past_value``  (B, Hkv, P, D)  post-RoPE, valid prefix per sample and head
             ``past_lengths``   (B, Hkv) int64    valid past slots per sample and KV head
             ``new_lengths``    (B,) int64        valid new rows per sample
             ``stats_rows``     (R, B, q) int64   nonzero = the row enters row set ``r``'s statistics
             ``stats_threshold`` (R,) float32     relative threshold of row set ``r``'s below counts
    outputs  ``hidden_out``     (B, q, hidden)
             ``key``, ``value`` (B, Hkv, q, D)   the new rows' K/V (the caller appends them)
             ``attn_colsum`` (R, B, H, S) float32, ``attn_below`` / ``attn_visible`` (R, B, H) int64,
             over the slots after the step (``vlkv.runtime.onnx.layer_step``)
``head.onnx``
    inputs   ``hidden_states`` (B, q, hidden), ``logits_index`` (B, r) int64 → ``logits`` (B, r, V)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from vlkv.runtime.models.adapter import FamilyAdapter, make_adapter
from vlkv.runtime.onnx import export, export_cache, layer_step, nodes
from vlkv.runtime.onnx.layer_step import LayerStep

# Bump when the graphs' I/O contract changes (it enters the cache key with the code of these modules).
EXPORT_FORMAT = 1
HEAD_FILE = "head.onnx"
LAYER_INPUTS = (
    "hidden_states",
    "position_ids",
    "past_key",
    "past_value",
    "past_lengths",
    "new_lengths",
    "stats_rows",
    "stats_threshold",
)
LAYER_OUTPUTS = ("hidden_out", "key", "value", "attn_colsum", "attn_below", "attn_visible")
HEAD_INPUTS = ("hidden_states", "logits_index")
_CODE = [Path(m.__file__) for m in (export, layer_step, nodes)] + [Path(__file__)]


def layer_file(index: int) -> str:
    return f"layer.{index}.onnx"


def positions_to_rotary(adapter: FamilyAdapter, hidden: Tensor, position_ids: Tensor):
    """cos/sin ``(B, q, D)`` of ``position_ids`` ``(B, q)`` or ``(3, B, q)`` (the graphs' layout)."""
    positions = position_ids[..., None] if adapter.layout.pos_dims == 1 else position_ids.permute(1, 2, 0)
    return adapter.rotary(hidden, positions)


class LayerGraph(nn.Module):
    """Decoder layer ``index`` with its own rotary embedding (see the module docstring for the I/O)."""

    def __init__(self, adapter: FamilyAdapter, index: int):
        super().__init__()
        self.adapter = adapter
        self.step = LayerStep(adapter.layers[index], adapter.layout)

    def forward(self, hidden, position_ids, past_k, past_v, past_len, new_len, rows, threshold):
        cos, sin = positions_to_rotary(self.adapter, hidden, position_ids)
        out, k, v, _, _, colsum, below, visible = self.step(
            hidden, cos, sin, past_k, past_v, past_len, new_len, rows, threshold
        )
        return out, k, v, colsum, below, visible


class HeadGraph(nn.Module):
    """Final norm and LM head on the rows ``logits_index`` picks."""

    def __init__(self, adapter: FamilyAdapter):
        super().__init__()
        self.norm, self.lm_head = adapter.norm, adapter.lm_head

    def forward(self, hidden: Tensor, logits_index: Tensor) -> Tensor:
        index = logits_index[..., None].expand(-1, -1, hidden.shape[-1])
        return self.lm_head(torch.gather(self.norm(hidden), 1, index))


def layer_example(
    adapter: FamilyAdapter, dtype: torch.dtype, past: int = 5, seed: int = 0
) -> dict[str, Tensor]:
    """Random valid inputs of a layer graph: batch 2, 3 rows, ``past`` slots, 4 row sets (distinct sizes,
    so that no two dynamic axes are traced as equal)."""
    lay = adapter.layout
    gen = torch.Generator().manual_seed(seed)
    b, q, r = 2, 3, 4
    # per-head lengths differ, as after per-head selection or with attend indices
    past_len = (past - (torch.arange(b)[:, None] + torch.arange(lay.num_kv_heads)[None]) % 3).clamp(min=0)
    pos = past + torch.arange(q)[None].expand(b, q)
    kv = (b, lay.num_kv_heads, past, lay.head_dim)
    return {
        "hidden_states": torch.randn(b, q, adapter.text_config.hidden_size, generator=gen).to(dtype),
        "position_ids": pos.contiguous() if lay.pos_dims == 1 else pos[None].expand(3, b, q).contiguous(),
        "past_key": torch.randn(*kv, generator=gen).to(dtype),
        "past_value": torch.randn(*kv, generator=gen).to(dtype),
        "past_lengths": past_len,
        "new_lengths": torch.tensor([q, q - 1]),
        "stats_rows": torch.ones(r, b, q, dtype=torch.long),
        "stats_threshold": torch.full((r,), 0.05),
    }


def layer_axes(pos_dims: int) -> dict[str, dict[int, str]]:
    b, q, r = "batch_size", "sequence_length", "row_sets"
    return {
        "hidden_states": {0: b, 1: q},
        "position_ids": {0: b, 1: q} if pos_dims == 1 else {1: b, 2: q},
        "past_key": {0: b, 2: "past_sequence_length"},
        "past_value": {0: b, 2: "past_sequence_length"},
        "past_lengths": {0: b},
        "new_lengths": {0: b},
        "stats_rows": {0: r, 1: b, 2: q},
        "stats_threshold": {0: r},
        "hidden_out": {0: b, 1: q},
        "key": {0: b, 2: q},
        "value": {0: b, 2: q},
        "attn_colsum": {0: r, 1: b, 3: "total_sequence_length"},
        "attn_below": {0: r, 1: b},
        "attn_visible": {0: r, 1: b},
    }


def export_layer_graphs(model: nn.Module, family: str, out_dir: str | Path, opset: int = 17) -> Path:
    """Write ``layer.{l}.onnx`` for every layer and ``head.onnx`` into ``out_dir``; returns it."""
    out_dir = Path(out_dir)
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    check_exportable(adapter)
    dtype = next(model.parameters()).dtype
    feeds = layer_example(adapter, dtype)
    axes = layer_axes(adapter.layout.pos_dims)
    for i in range(adapter.layout.num_layers):
        graph = LayerGraph(adapter, i).eval()
        export.trace_to_onnx(graph, feeds, out_dir / layer_file(i), list(LAYER_OUTPUTS), axes, opset)
    head_feeds = dict(zip(HEAD_INPUTS, (feeds["hidden_states"], torch.tensor([[2], [1]]))))
    head_axes = {
        "hidden_states": {0: "batch_size", 1: "sequence_length"},
        "logits_index": {0: "batch_size", 1: "logits_rows"},
        "logits": {0: "batch_size", 1: "logits_rows"},
    }
    export.trace_to_onnx(
        HeadGraph(adapter).eval(), head_feeds, out_dir / HEAD_FILE, ["logits"], head_axes, opset
    )
    return out_dir


def cached_layer_graphs(model, family: str, cache_dir: str | Path | None = None, opset: int = 17) -> Path:
    """Directory of ``model``'s layer graphs in the export cache (``export_cache``, ``cache_dir`` or
    ``$VLKV_ONNX_CACHE``), verified against its checksums; exported when missing or damaged."""
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    head = {
        "graph": "layers",
        "format": EXPORT_FORMAT,
        "family": family,
        "opset": opset,
        "config": adapter.text_config.to_dict(),
    }
    key = export_cache.export_key(head, [adapter.layers, adapter.norm, adapter.lm_head], _CODE)
    head_path = export_cache.cached_export(
        cache_dir, key, HEAD_FILE, lambda tmp: export_layer_graphs(model, family, tmp, opset)
    )
    return head_path.parent


def check_exportable(adapter: FamilyAdapter) -> None:
    """Raise ``ValueError`` for what the written-out attention does not implement."""
    cfg = adapter.text_config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise ValueError(f"sliding_window={cfg.sliding_window}: sliding-window attention is not exported")
