"""Language-decoder export: one ONNX graph for prefill and decode over per-layer caches of any lengths.

The graph runs one step of the LM on a vlkv cache (see ``vlkv.runtime.cache``). I/O, named as optimum
names them where a counterpart exists (toolchain.md A9); ``L`` layers, ``q`` new rows, ``P_l`` the
past slots fed for layer ``l`` (each layer has its own dynamic axis ``past_sequence_length_l``):

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

Masking is the PyTorch backend's: key ``j`` is visible to new row ``i`` of sample ``b`` iff
``j <= past[b] + i`` and ``j < past[b] + new_len[b]``. The statistics are a *decomposed* subgraph of
plain ONNX ops per layer, computed exactly as ``vlkv.plugins.attn_stats_reference``; its boundary tensors
are recorded in the model's ``metadata_props`` (:data:`SUBGRAPHS_KEY`) so that
``vlkv.exporter.graph_rewrite`` can swap it for the ``AttnStats`` plugin node.

The wrapper re-implements the decoder step from the HF modules' own weights (norms, projections,
rotary embedding, MLP are the HF modules; only attention is written out) and is exported with the
legacy TorchScript exporter, which is fast and handles the per-layer dynamic axes (A6).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from vlkv.exporter.graph_rewrite import SUBGRAPHS_KEY
from vlkv.plugins.onnx_ops import OP_ATTN_STATS
from vlkv.runtime.models.adapter import FamilyAdapter, make_adapter

# Bump when the graph's I/O contract changes: the ONNX Runtime backend's export cache keys on it.
EXPORT_FORMAT = 1
DECODER_FILE = "decoder.onnx"
# ORT 1.31 reads IR <= 13; onnx 1.23 would write 14 (toolchain.md, onnx_ort.IR_VERSION).
IR_VERSION = 10
# Above this many bytes of weights the model is saved with external data (protobuf's 2 GiB limit).
EXTERNAL_DATA_BYTES = 1 << 30
CACHE_ENV = "VLKV_ONNX_CACHE"
# Stage check, ONNX Runtime vs PyTorch (atol = rtol) per model dtype; float16 rounds at ~1e-3 per op.
STAGE_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}
# Elements of each weight tensor that enter the cache key (plus the tensor's sum): hashing all of a
# 7B model's bytes would cost seconds on every start; distinct weights differ in a strided sample.
_KEY_SAMPLE = 4096


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
        return [f"attn_{s}.{i}" for i in range(self.num_layers) for s in ("colsum", "below", "visible")]

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


# Boundary tensors of one layer's statistics subgraph, in the order of the AttnStats plugin's inputs
# (vlkv.plugins.onnx_ops) plus the threshold, which the plugin takes as an attribute.
STATS_INPUTS = ("query", "key", "rows", "key_lengths", "q_offset", "threshold")
STATS_OUTPUTS = ("colsum", "below", "visible")
# A private domain for the tracing-time marks; none survives the export.
MARK_DOMAIN = "vlkv.mark"


class _Mark(torch.autograd.Function):
    """Identity that the legacy exporter writes as ``vlkv.mark::Mark(name=...)``.

    The TorchScript exporter names intermediate tensors itself (``/Add_3_output_0``) and may share
    nodes between subgraphs; a mark pins a stable name on a subgraph's boundary tensor, so the
    rewrite pass can find the subgraph without guessing. :func:`_install_marks` turns marks into
    ``Identity`` nodes whose outputs carry those names.
    """

    @staticmethod
    def forward(ctx, x: Tensor, name: str) -> Tensor:
        return x.clone()

    @staticmethod
    def symbolic(g, x, name: str):
        out = g.op(f"{MARK_DOMAIN}::Mark", x, name_s=name)
        out.setType(x.type())  # an identity: same type and shape, so shape inference goes on through it
        return out


def _mark(x: Tensor, name: str) -> Tensor:
    return _Mark.apply(x, name) if torch.onnx.is_in_onnx_export() else x


class _Reshape(torch.autograd.Function):
    """``Reshape`` with ONNX semantics (0 copies the input's dim, -1 is inferred) as ONE node.

    Tracing ``x.view(b, q, H, D)`` with dynamic ``b, q`` writes a Shape/Gather/Unsqueeze/Concat chain
    per call; the graph has hundreds of them, which slows both the export and every ORT step.
    """

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.long)))


class _Expand(torch.autograd.Function):
    """``Expand`` to a constant broadcast shape (1 = keep that dim of ``x``) as ONE node."""

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return x.expand([-1 if s == 1 else s for s in shape])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Expand", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.long)))


def _expand(x: Tensor, *shape: int) -> Tensor:
    return _Expand.apply(x, shape)


def _reshape(x: Tensor, *shape: int) -> Tensor:
    """``x`` reshaped to ``shape`` (0 = keep that dim of ``x``, -1 = inferred)."""
    return _Reshape.apply(x, shape)


class AttnStatsGraph(nn.Module):
    """Decomposed attention statistics (plain ONNX ops once exported), between marked boundaries.

    Same semantics as ``attn_stats_reference(q, k, scale, rows != 0, True, threshold, key_lengths,
    q_offset)``, without its row chunking (ONNX Runtime materialises ``(B, H, Q, S)`` scores, as the
    decomposed attention next to it does; the plugin that replaces this subgraph does not).
    """

    def __init__(self, scale: float, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.scale, self.heads, self.kv_heads, self.head_dim = scale, heads, kv_heads, head_dim

    def forward(
        self, q: Tensor, k: Tensor, rows: Tensor, key_lengths: Tensor, q_offset: Tensor, threshold: Tensor
    ):
        """q ``(B, H, Q, D)``, k ``(B, Hkv, S, D)``, rows ``(B, Q)`` int64, key_lengths/q_offset ``(B,)``
        int64, threshold ``(1,)`` float32 → colsum ``(B, H, S)`` float32, below/visible ``(B, H)`` int64."""
        h, hkv, nq = self.heads, self.kv_heads, q.shape[2]
        qg = _reshape(q.float(), 0, hkv, h // hkv, -1, self.head_dim)
        scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * self.scale  # (B, Hkv, G, Q, S)
        j = torch.arange(k.shape[2], device=q.device)
        i = torch.arange(nq, device=q.device)
        vis = (j[None, None, :] < key_lengths[:, None, None]) & (rows[:, :, None] != 0)
        vis = vis & (j[None, None, :] <= (q_offset[:, None] + i[None, :])[:, :, None])  # (B, Q, S)
        vis = vis[:, None, None]
        scores = scores.masked_fill(~vis, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        # A row with no visible key has max -inf; shifting by 0 keeps exp() at 0 instead of NaN.
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        expd = torch.exp(scores - row_max) * vis.float()
        probs = expd / expd.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        colsum = _reshape(probs.sum(dim=-2), 0, h, -1)
        visible = vis.long().sum(dim=(-1, -2, -3, -4))[:, None].expand(-1, h)
        cut = threshold * probs.amax(dim=-1, keepdim=True)
        below = _reshape(((probs < cut) & vis).long().sum(dim=(-1, -2)), -1, h)
        return colsum, below, visible


class DecoderStep(nn.Module):
    """One decoder step on explicit per-layer KV (see the module docstring for the I/O contract)."""

    def __init__(self, adapter: FamilyAdapter):
        super().__init__()
        cfg = adapter.text_config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            raise ValueError(f"sliding_window={cfg.sliding_window}: sliding-window attention is not exported")
        self.adapter = adapter
        self.layout = adapter.layout
        self.layers = adapter.layers
        self.norm, self.lm_head = adapter.norm, adapter.lm_head
        lay = self.layout
        self.stats = AttnStatsGraph(
            self.layers[0].self_attn.scaling, lay.num_heads, lay.num_kv_heads, lay.head_dim
        )

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
        lay = self.layout
        positions = position_ids[..., None] if lay.pos_dims == 1 else position_ids.permute(1, 2, 0)
        hidden = inputs_embeds
        cos, sin = self.adapter.rotary(hidden, positions)
        presents, stats = [], []
        for idx, layer in enumerate(self.layers):
            residual = hidden
            attn, k, v, layer_stats = self._attention(
                idx,
                layer.self_attn,
                layer.input_layernorm(hidden),
                cos,
                sin,
                past[2 * idx],
                past[2 * idx + 1],
                past_lengths[idx],
                new_lengths,
                stats_rows,
                stats_threshold,
            )
            hidden = residual + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            presents += [k, v]
            stats += list(layer_stats)
        hidden = self.norm(hidden)
        index = logits_index[..., None].expand(-1, -1, hidden.shape[-1])
        logits = self.lm_head(torch.gather(hidden, 1, index))
        return (logits, *presents, *stats)

    def _attention(self, layer, attn, x, cos, sin, past_k, past_v, past_len, new_len, rows, threshold):
        """x ``(B, q, hidden)``; past_k/v ``(B, Hkv, P, D)``; past_len/new_len ``(B,)`` →
        output ``(B, q, hidden)``, present K/V ``(B, Hkv, P + q, D)`` and the layer's statistics."""
        lay = self.layout
        b, nq, _ = x.shape
        q = _reshape(attn.q_proj(x), 0, -1, lay.num_heads, lay.head_dim).transpose(1, 2)
        k = _reshape(attn.k_proj(x), 0, -1, lay.num_kv_heads, lay.head_dim).transpose(1, 2)
        v = _reshape(attn.v_proj(x), 0, -1, lay.num_kv_heads, lay.head_dim).transpose(1, 2)
        half = lay.head_dim // 2
        q, k = _rope(q, cos, sin, half), _rope(k, cos, sin, half)
        j = torch.arange(past_k.shape[2] + nq, device=x.device)  # slots after the step
        # slot j of sample b holds past entry j (j < past[b]) or new row j - past[b] (zero-padded)
        rel = (j[None, :] - past_len[:, None]).clamp(min=0)  # (B, P + q), always < P + q
        index = _expand(rel[:, None, :, None], 1, lay.num_kv_heads, 1, lay.head_dim)
        is_past = (j[None, :] < past_len[:, None])[:, None, :, None]
        zeros_p, zeros_q = torch.zeros_like(past_k), torch.zeros_like(k)
        present_k = _append(past_k, k, index, is_past, zeros_p, zeros_q)
        present_v = _append(past_v, v, index, is_past, zeros_p, zeros_q)
        total = past_len + new_len
        # key j visible to row i of sample b iff causal w.r.t. the row's slot and valid
        i = torch.arange(nq, device=x.device)
        vis = (j[None, None, :] <= (past_len[:, None] + i[None, :])[:, :, None]) & (
            j[None, None, :] < total[:, None, None]
        )
        group = lay.num_heads // lay.num_kv_heads
        qg = _reshape(q.float(), 0, lay.num_kv_heads, group, -1, lay.head_dim)
        scores = torch.matmul(qg, present_k.float().unsqueeze(2).transpose(-1, -2)) * attn.scaling
        # finfo.min, not -inf: a padding row with no visible key stays finite instead of NaN
        scores = scores.masked_fill(~vis[:, None, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, present_v.float().unsqueeze(2)).to(x.dtype)  # (B, Hkv, G, q, D)
        out = _reshape(_reshape(out, 0, lay.num_heads, -1, lay.head_dim).transpose(1, 2), 0, 0, -1)
        args = (q, present_k, rows, total, past_len, threshold)
        marked = [_mark(t, f"stats.{layer}.{role}") for t, role in zip(args, STATS_INPUTS)]
        layer_stats = self.stats(*marked[:5], threshold=marked[5])
        return attn.o_proj(out), present_k, present_v, layer_stats


def _rope(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    """x ``(B, heads, q, D)``, cos/sin ``(B, q, D)``, ``half = D // 2``: HF's ``apply_rotary_pos_emb``
    for one tensor (``half`` is a Python int so the slices export as constants)."""
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _append(
    past: Tensor, new: Tensor, index: Tensor, is_past: Tensor, zeros_p: Tensor, zeros_q: Tensor
) -> Tensor:
    """past ``(B, Hkv, P, D)``, new ``(B, Hkv, q, D)`` → ``(B, Hkv, P + q, D)`` with the new rows right
    after each sample's valid past (``LayerKV.append``). ``index (B, Hkv, P + q, D)`` int64 and
    ``is_past (B, 1, P + q, 1)`` bool come from the layer's past lengths; zeros are ``past``/``new``-shaped.

    The zero tail of length P keeps every index in range without a dynamic ``clamp(max=q - 1)``.
    """
    gathered = torch.gather(torch.cat([new, zeros_p], dim=2), 2, index)
    return torch.where(is_past, torch.cat([past, zeros_q], dim=2), gathered)


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


def export_decoder(model: nn.Module, family: str, path: str | Path, opset: int = 17) -> Path:
    """Export ``model``'s language decoder to ``path`` (see the module docstring); returns the path."""
    import onnx

    if opset < 14:
        raise ValueError(f"opset must be >= 14, got {opset}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    step = DecoderStep(adapter).eval()
    lay = adapter.layout
    io = DecoderIO(lay.num_layers, lay.pos_dims)
    dtype = next(model.parameters()).dtype
    # distinct past lengths per layer so that no two dynamic axes are traced as equal
    feeds = example_inputs(
        lay, adapter.text_config.hidden_size, dtype, [3 + i for i in range(lay.num_layers)]
    )
    # a temporary directory: above 2 GiB the exporter writes one external-data file per weight
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "raw.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
            torch.onnx.export(
                step,
                tuple(feeds.values()),
                str(raw),
                input_names=io.input_names,
                output_names=io.output_names,
                dynamic_axes=io.dynamic_axes(),
                opset_version=opset,
                dynamo=False,
            )
        proto = onnx.load(str(raw))
    proto = _install_marks(proto, io, float(step.stats.scale))
    size = sum(t.ByteSize() for t in proto.graph.initializer)
    if size > EXTERNAL_DATA_BYTES:
        onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(proto, str(path))
    return path


def _install_marks(proto, io: DecoderIO, scale: float):
    """Turn each ``Mark`` node into ``Identity`` writing its stable name; record the stats boundaries."""
    import onnx
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
        records[int(layer)]["inputs"].append((STATS_INPUTS.index(role), name))
    for node in nodes:
        node.input[:] = [renames.get(n, n) for n in node.input]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    for rec in records:
        rec["inputs"] = [name for _, name in sorted(rec["inputs"])]
        rec["scale"] = scale
        if len(rec["inputs"]) != len(STATS_INPUTS):
            raise RuntimeError(f"layer {rec['layer']}: stats boundary marks {rec['inputs']} are incomplete")
    kept = [o for o in proto.opset_import if o.domain != MARK_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)
    proto.ir_version = IR_VERSION
    meta = proto.metadata_props.add()
    meta.key, meta.value = SUBGRAPHS_KEY, json.dumps(records)
    fmt = proto.metadata_props.add()
    fmt.key, fmt.value = "vlkv.export_format", str(EXPORT_FORMAT)
    onnx.checker.check_model(proto)
    return proto


# ---------------------------------------------------------------- export cache
def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vlkv" / "onnx")


def export_key(step_module: torch.nn.Module, family: str, text_config, opset: int) -> str:
    """Hex sha256 naming an export: format, family, opset, versions, LM config and weights."""
    import onnx
    import transformers

    h = hashlib.sha256()
    head = {
        "format": EXPORT_FORMAT,
        "family": family,
        "opset": opset,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "config": text_config.to_dict(),
        # the exporter's own code: a changed graph must never be served from an old cache entry
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for name, t in step_module.state_dict().items():
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _KEY_SAMPLE)][:_KEY_SAMPLE].float().cpu().numpy()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{float(flat.sum(dtype=torch.float64))!r}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()


def cached_decoder(model, family: str, cache_dir: str | Path | None = None, opset: int = 17) -> Path:
    """Path of ``model``'s exported decoder, exporting it into the cache directory when missing."""
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    key = export_key(DecoderStep(adapter), family, adapter.text_config, opset)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / key[:24]
    if (target / DECODER_FILE).is_file():
        return target / DECODER_FILE
    root.mkdir(parents=True, exist_ok=True)
    # export beside the target, then rename: a concurrent or interrupted export never leaves half a file
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    try:
        export_decoder(model, family, tmp / DECODER_FILE, opset=opset)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its export is identical
            if not (target / DECODER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / DECODER_FILE


# ---------------------------------------------------------------- build stage
def export(recipe, out_dir: str | Path) -> Path:
    """The ``decoder_onnx`` stage: ``out_dir/decoder.onnx`` for ``recipe.model`` plus ``metrics.json``.

    The graph comes from the export cache (:func:`cached_decoder`, shared with the ONNX Runtime
    backend). It is checked against the PyTorch wrapper with ONNX Runtime and Polygraphy
    (:data:`STAGE_TOLERANCE`; bfloat16 cannot be fed from numpy and is not checked); a mismatch fails
    the stage.
    """
    from vlkv.exporter.errors import StageError
    from vlkv.exporter.source import load_source_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_source_model(recipe.model)
    family = recipe.model.family
    cached = cached_decoder(model, family, opset=recipe.decoder.opset)
    for src in cached.parent.iterdir():
        shutil.copy2(src, out_dir / src.name)
    path = out_dir / DECODER_FILE
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    lay = adapter.layout
    metrics: dict = {
        "layers": lay.num_layers,
        "export_format": EXPORT_FORMAT,
        "opset": recipe.decoder.opset,
        "cache_entry": cached.parent.name,
    }
    tol = STAGE_TOLERANCE.get(recipe.model.dtype)
    if tol is None:
        metrics["validation"] = f"skipped: numpy / ONNX Runtime on CPU cannot feed {recipe.model.dtype}"
    else:
        result = _validate(adapter, path, next(model.parameters()).dtype, tol)
        metrics.update(result.as_metrics())
        if not (result.passed and result.polygraphy_passed):
            raise StageError(
                f"decoder ONNX differs from PyTorch: max abs err {result.max_abs_err:.3g} (atol {tol})"
            )
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return path


def _validate(adapter, path: Path, dtype: torch.dtype, tol: float):
    """ONNX Runtime + Polygraphy vs the PyTorch wrapper on a prefill (no past) and a decode feed whose
    layers all hold different past lengths; returns ``vlkv.exporter.comparison.Comparison``."""
    from vlkv.exporter.comparison import compare_onnx

    lay = adapter.layout
    step = DecoderStep(adapter).eval()
    names = DecoderIO(lay.num_layers, lay.pos_dims).output_names
    hidden = adapter.text_config.hidden_size
    cases = [
        example_inputs(lay, hidden, dtype, [0] * lay.num_layers, batch=2, rows=5, seed=1),
        example_inputs(lay, hidden, dtype, [4 + 3 * i for i in range(lay.num_layers)], rows=1, seed=2),
    ]
    feeds, reference = [], []
    with torch.no_grad():
        for case in cases:
            outs = step(*case.values())
            feeds.append({k: v.numpy() for k, v in case.items()})
            reference.append({n: o.contiguous().numpy() for n, o in zip(names, outs)})
    return compare_onnx(path, feeds, reference, atol=tol, rtol=tol)
