"""ONNX Runtime backend: the language decoder runs as exported ONNX graphs, layer by layer; the cache stays vlkv's.

Same interface and semantics as :class:`~vlkv.runtime.torch_backend.TorchBackend`, so the engine and
every policy run unchanged (``Engine(loaded, backend="onnxruntime")``, ``vlkv generate --backend
onnxruntime``):

* **embeddings and vision** run in PyTorch (the HF vision tower, projector and token embedding, via
  the PyTorch backend's ``embed``); the decoder layers, final norm and LM head run in ORT. The vision
  tower runs once per prompt at prefill, so it is not on the decode path being served;
* **the decoder** is ``vlkv.runtime.onnx.layer_graphs``: one graph per layer plus a head graph,
  exported on first use into the export cache (``vlkv.runtime.onnx.export_cache``: keyed by the LM
  config, its weights, the graphs' code and the package versions; ``$VLKV_ONNX_CACHE``, default
  ``~/.cache/vlkv/onnx``). Each start verifies the entry's checksums; a truncated or modified file
  is named in one log line and the graphs are re-exported, never run;
* **the cache**: each layer's valid K/V (``LayerKV.attention_kv``, every layer its own length) is fed
  with per-sample, per-head past lengths; the layer's new K/V rows come back and are written with
  ``LayerKV.append``, so positions, modality and policy scores move exactly as with the PyTorch
  backend and policies' edits apply identically;
* **A-VL's plans**: with an :class:`~vlkv.runtime.backend.AttendIndex` the layer is fed only the
  indexed past K/V (per-head lengths), so decode really computes over the core; a
  :class:`~vlkv.runtime.backend.RowFilter` drops rows between two layer graphs, keeping the
  survivors' original positions;
* **statistics** come from each layer graph's ``attn_colsum/below/visible`` outputs, read off the
  attention's own softmax; the main :class:`StatsRequest` and its ``extra`` row sets are computed in
  the same run (one row set each).

``$VLKV_ORT_THREADS`` sets ORT's intra-op thread count (default: one per physical core).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs, StepOutput, StepStats
from vlkv.runtime.cache import KVCache, LayerKV

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}
# ONNX Runtime's intra-op threads (default: one per physical core), like torch.set_num_threads.
THREADS_ENV = "VLKV_ORT_THREADS"


class OrtBackend:
    """Runs prefill / decode steps through ONNX Runtime (see the module docstring)."""

    name = "onnxruntime"
    supports_link = False  # the layer graphs mask by slot; a link step masks by sequence order
    supports_replay = False  # the layer graphs append what they attend to and take no gradients

    def __init__(
        self,
        model,
        family: str,
        image_token_id: int,
        cache_dir: str | Path | None = None,
        providers: list[str] | None = None,
        opset: int = 17,
    ):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ImportError(
                f"the onnxruntime backend needs onnxruntime ({exc}): pip install 'vlkv[onnx]'"
            ) from None
        from vlkv.runtime.onnx.layer_graphs import HEAD_FILE, cached_layer_graphs, layer_file
        from vlkv.runtime.torch_backend import TorchBackend

        # the PyTorch backend does embeddings + vision; it also fixes the layout attributes
        self._torch = TorchBackend(model, family, image_token_id)
        self.adapter = self._torch.adapter
        for attr in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "pos_dims", "dtype", "device"):
            setattr(self, attr, getattr(self._torch, attr))
        if self.dtype not in _NUMPY_DTYPES:
            raise ValueError(f"the onnxruntime backend runs float32 or float16 models, got {self.dtype}")
        if self.device.type != "cpu":
            raise ValueError(f"the onnxruntime backend takes a model on the CPU, got {self.device}")
        self.model_dir = cached_layer_graphs(model, family, cache_dir, opset)
        options = ort.SessionOptions()
        if os.environ.get(THREADS_ENV):
            options.intra_op_num_threads = int(os.environ[THREADS_ENV])
        providers = providers or ["CPUExecutionProvider"]

        def session(name: str):
            return ort.InferenceSession(str(self.model_dir / name), options, providers=providers)

        self.layer_sessions = [session(layer_file(i)) for i in range(self.num_layers)]
        self.head_session = session(HEAD_FILE)

    def embed(self, batch) -> Tensor:
        """``(B, T, hidden)`` prompt embeddings with image features spliced in (PyTorch)."""
        return self._torch.embed(batch)

    def replay(self, request, cache, context, lengths, template_ids):
        """Not available here (:func:`vlkv.runtime.replay.replay_refusal` says why, in one line)."""
        from vlkv.runtime.replay import replay_refusal

        raise ValueError(replay_refusal(self.name, request.gradient))

    @torch.no_grad()
    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        """Run ``inputs`` through the layer graphs, append their K/V to ``cache``, return logits and
        stats (shapes as :class:`~vlkv.runtime.backend.StepOutput`)."""
        if inputs.selective:
            raise ValueError(
                "a link step (attention by sequence order) needs the PyTorch backend: --backend torch"
            )
        if any(getattr(layer, "holes", None) is not None for layer in cache.layers):
            raise ValueError(
                "a cache with per-head budgets (holes) needs the PyTorch backend: --backend torch"
            )
        requests = {} if stats is None else {"": stats, **stats.extra}
        out_stats = StepStats([None] * self.num_layers, {n: [None] * self.num_layers for n in requests if n})
        rows = {n: _rows(inputs, r) for n, r in requests.items()}
        hidden = inputs.inputs_embeds
        if hidden is None:
            hidden = self.adapter.embed_tokens(inputs.input_ids.to(self.device))
        hidden = hidden.to(self.dtype)
        step, flt, attended = inputs, inputs.row_filter, []
        for i, layer in enumerate(cache.layers):
            index = inputs.attend[i] if inputs.attend is not None else None
            hidden, used = self._layer(i, layer, hidden, step, index, requests, rows, out_stats)
            attended.append(used)
            if flt is not None and i == flt.after_layer and i + 1 < self.num_layers:
                step, rows, hidden = _filter_rows(flt.choose(out_stats, i), step, rows, hidden)
        logits = self._head(hidden, step)
        cache.processed += inputs.new_len.to(cache.processed)
        return StepOutput(logits=logits, stats=out_stats, attended=torch.stack(attended))

    def _layer(
        self,
        i: int,
        layer: LayerKV,
        hidden: Tensor,
        step: StepInputs,
        index: AttendIndex | None,
        requests: dict[str, StatsRequest],
        rows: dict[str, Tensor],
        out_stats: StepStats,
    ) -> tuple[Tensor, Tensor]:
        """Run layer ``i`` on ``hidden (B, q, hidden)``, append its K/V, fill its stats; returns the
        layer's output hidden states and ``(B,)`` float64 entries each sample's last row attended."""
        b, q = step.input_ids.shape
        past = layer.lengths.clone()  # (B,) before the append
        k, v = layer.attention_kv()
        selected = None
        if index is None:
            past_heads = past[:, None].expand(b, self.num_kv_heads)
        else:  # the core: only the listed past slots (plus the new entry) enter the attention
            k, v, past_heads, selected = _gather_attended(k, v, index, past)
        wanted = [n for n, r in requests.items() if r.wants(i)]
        feeds = {
            "hidden_states": hidden.contiguous().numpy(),
            "position_ids": _position_ids(step, self.pos_dims),
            "past_key": k.contiguous().numpy(),
            "past_value": v.contiguous().numpy(),
            "past_lengths": past_heads.to(torch.long).contiguous().numpy(),
            "new_lengths": step.new_len.to(torch.long).numpy(),
        }
        if wanted:
            feeds["stats_rows"] = torch.stack([rows[n] for n in wanted]).to(torch.long).numpy()
            thresholds = [requests[n].threshold or 0.0 for n in wanted]
            feeds["stats_threshold"] = np.array(thresholds, dtype=np.float32)
        else:  # one all-zero row set: the graph always computes statistics
            feeds["stats_rows"] = np.zeros((1, b, q), dtype=np.int64)
            feeds["stats_threshold"] = np.zeros(1, dtype=np.float32)
        out, k_new, v_new, colsum, below, visible = self.layer_sessions[i].run(None, feeds)
        layer.append(
            torch.from_numpy(k_new), torch.from_numpy(v_new), step.positions, step.modality, step.new_len
        )
        for r, name in enumerate(wanted):
            st = self._stats(layer, colsum[r], below[r], visible[r], requests[name], selected)
            if name:
                out_stats.extra[name][i] = st
            else:
                out_stats[i] = st
        used = (past + step.new_len.to(past)) if selected is None else selected[1].double().mean(1)
        return torch.from_numpy(out), used.double()

    def _stats(self, layer: LayerKV, colsum, below, visible, request: StatsRequest, selected):
        """:class:`vlkv.plugins.AttnStats` over the layer's slots after the append: ``colsum (B, H, S')``
        is trimmed to them, or, after an attend index, scattered back from the attended slots."""
        from vlkv.plugins import AttnStats

        colsum = torch.from_numpy(colsum)
        width = layer.max_length
        if selected is None:
            colsum = colsum[:, :, :width].contiguous()
        else:
            idx, lens = selected
            group = self.num_heads // self.num_kv_heads
            ok = torch.arange(idx.shape[-1])[None, None, :] < lens[..., None]
            part = colsum[:, :, : idx.shape[-1]] * ok.repeat_interleave(group, dim=1)
            colsum = torch.zeros(*colsum.shape[:2], width, dtype=colsum.dtype)
            colsum.scatter_add_(2, idx.repeat_interleave(group, dim=1), part)
        return AttnStats(
            colsum=colsum,
            below=torch.from_numpy(below) if request.threshold is not None else None,
            visible=torch.from_numpy(visible),
        )

    def _head(self, hidden: Tensor, step: StepInputs) -> Tensor:
        """``(B, V)`` float32 logits of each sample's last valid row, or ``(B, q, V)`` with ``all_logits``."""
        b, q = step.input_ids.shape
        if step.all_logits:
            index = torch.arange(q)[None, :].expand(b, q)
        else:
            index = (step.new_len - 1).clamp(min=0)[:, None]
        feeds = {
            "hidden_states": hidden.contiguous().numpy(),
            "logits_index": index.to(torch.long).contiguous().numpy(),
        }
        logits = torch.from_numpy(self.head_session.run(None, feeds)[0]).float()
        return logits if step.all_logits else logits[:, 0]


def _valid(new_len: Tensor, q: int) -> Tensor:
    return torch.arange(q)[None, :] < new_len[:, None]


def _rows(inputs: StepInputs, request: StatsRequest) -> Tensor:
    """``(B, q)`` bool rows of ``request`` (its ``rows`` or every valid row)."""
    valid = _valid(inputs.new_len, inputs.input_ids.shape[1])
    return valid if request.rows is None else request.rows.cpu() & valid


def _position_ids(step: StepInputs, pos_dims: int) -> np.ndarray:
    """``(B, q)`` or, for M-RoPE, ``(3, B, q)`` int64 positions as the graphs take them."""
    pos = step.positions.to(torch.long)
    return (pos[..., 0] if pos_dims == 1 else pos.permute(2, 0, 1)).contiguous().numpy()


def _gather_attended(k: Tensor, v: Tensor, index: AttendIndex, past: Tensor):
    """The attended past K/V ``(B, Hkv, K, D)`` and lengths ``(B, Hkv)``, plus ``(slots (B, Hkv, K + 1),
    lengths (B, Hkv))``: the cache slot of each attended position after the step, the new entry's
    slot ``past[b]`` right after each head's listed ones (the PyTorch backend's ``_with_new_slot``)."""
    idx, lens = index.indices.cpu(), index.lengths.cpu()
    b, h, width = idx.shape
    ok = torch.arange(width)[None, None, :] < lens[..., None]
    safe = torch.where(ok, idx, torch.zeros_like(idx))[..., None].expand(-1, -1, -1, k.shape[-1])
    slots = torch.cat([safe[..., 0], idx.new_zeros(b, h, 1)], dim=2)
    slots.scatter_(2, lens[..., None], past[:, None, None].expand(b, h, 1))
    return k.gather(2, safe), v.gather(2, safe), lens, (slots, lens + 1)


def _filter_rows(keep: Tensor, step: StepInputs, rows: dict[str, Tensor], hidden: Tensor):
    """Keep only ``keep (B, q)`` rows (plus each sample's last valid row) for the next layers, kept
    rows first in their original order: the PyTorch backend's ``filter_rows``. Returns the compacted
    step inputs, stats row sets and hidden states ``(B, q', hidden)``."""
    b, q = step.input_ids.shape
    keep = keep.to(dtype=torch.bool) & _valid(step.new_len, q)
    last = (step.new_len - 1).clamp(min=0)
    keep[torch.arange(b), last] |= step.new_len > 0
    new_len = keep.sum(1)
    width = max(int(new_len.max()), 1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]

    def gather(t: Tensor) -> Tensor:  # rows of a (B, q, ...) tensor in ``order``
        index = order.view(b, width, *([1] * (t.dim() - 2))).expand(b, width, *t.shape[2:])
        return t.gather(1, index)

    kept = StepInputs(gather(step.input_ids), gather(step.positions), gather(step.modality), new_len)
    valid = _valid(new_len, width)
    return kept, {n: gather(r) & valid for n, r in rows.items()}, gather(hidden)
