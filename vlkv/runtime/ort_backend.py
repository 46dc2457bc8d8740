"""ONNX Runtime backend: the language decoder runs as one exported ONNX graph, the cache stays vlkv's.

Same interface as :class:`~vlkv.runtime.torch_backend.TorchBackend`, so the engine and every policy
run unchanged (``Engine(loaded, backend="onnxruntime")``, ``vlkv generate --backend onnxruntime``):

* **embeddings and vision** run in PyTorch (the HF vision tower, projector and token embedding, via
  the PyTorch backend's ``embed``); only the decoder layers, final norm and LM head run in ORT. The
  vision tower is run once per prompt at prefill, so it is not on the decode path being served;
* **the decoder** is ``vlkv.exporter.decoder_onnx``'s graph, exported on first use into a cache
  directory keyed by a hash of the LM config, its weights, the exporter's code and the package
  versions (``$VLKV_ONNX_CACHE``, default ``~/.cache/vlkv/onnx``), so later runs reuse it;
* **the cache**: each layer's valid K/V (``LayerKV.attention_kv``, every layer its own length) is fed
  as ``past_key_values.l.*`` with ``past_lengths``; the new rows are read back from ``present.l.*`` and
  written with ``LayerKV.append``, so positions, modality and policy scores move exactly as with
  the PyTorch backend and policies' edits apply identically;
* **statistics** come from the graph's ``attn_colsum/below/visible`` outputs (the decomposed
  ``AttnStats`` subgraph). A :class:`StatsRequest` with ``extra`` row sets costs one more graph run
  per extra set (the cache is appended once).

``$VLKV_ORT_THREADS`` sets ORT's intra-op thread count (default: one per physical core).

Not supported here (one-line ``UnsupportedStep`` error): per-layer ``attend`` indices (selected
decode attention) and ``row_filter`` (dropping rows inside the layer loop), which need the graph to
be split at layer boundaries.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepInputs, StepOutput, StepStats
from vlkv.runtime.cache import KVCache

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}
# ONNX Runtime's intra-op threads (default: one per physical core), like torch.set_num_threads.
THREADS_ENV = "VLKV_ORT_THREADS"


class UnsupportedStep(ValueError):
    """A step asks for something the ONNX Runtime backend cannot run (one line)."""


class OrtBackend:
    """Runs prefill / decode steps through ONNX Runtime (see the module docstring)."""

    name = "onnxruntime"

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
        from vlkv.exporter.decoder_onnx import cached_decoder

        self.model_path = cached_decoder(model, family, cache_dir, opset)
        options = ort.SessionOptions()
        if os.environ.get(THREADS_ENV):
            options.intra_op_num_threads = int(os.environ[THREADS_ENV])
        self.session = ort.InferenceSession(
            str(self.model_path), options, providers=providers or ["CPUExecutionProvider"]
        )
        self._stats_names = [
            f"attn_{s}.{i}" for i in range(self.num_layers) for s in ("colsum", "below", "visible")
        ]

    def embed(self, batch) -> Tensor:
        """``(B, T, hidden)`` prompt embeddings with image features spliced in (PyTorch)."""
        return self._torch.embed(batch)

    @torch.no_grad()
    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        """Run ``inputs`` through the graph, append their K/V to ``cache``, return logits and stats
        (shapes as :class:`~vlkv.runtime.backend.StepOutput`)."""
        if inputs.attend is not None and any(a is not None for a in inputs.attend):
            raise UnsupportedStep(
                "the onnxruntime backend cannot run per-layer attend indices; use --backend torch"
            )
        if inputs.row_filter is not None:
            raise UnsupportedStep(
                "the onnxruntime backend cannot filter rows inside the layer loop; use --backend torch"
            )
        b, q = inputs.input_ids.shape
        new_len = inputs.new_len.to(torch.long)
        past = cache.lengths()  # (L, B), before the append
        valid = torch.arange(q)[None, :] < new_len[:, None]
        feeds = self._feeds(inputs, cache, past, valid)
        requests = {"": stats, **(stats.extra if stats is not None else {})}
        wanted = [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        names = ["logits", *wanted, *(self._stats_names if stats is not None else [])]
        main = dict(zip(names, self._run(names, feeds, requests[""], valid)))
        for i, layer in enumerate(cache.layers):
            slots = (past[i][:, None] + torch.arange(q)[None, :])[:, None, :, None]
            slots = slots.expand(b, self.num_kv_heads, q, self.head_dim)
            k_new = torch.from_numpy(main[f"present.{i}.key"]).gather(2, slots)
            v_new = torch.from_numpy(main[f"present.{i}.value"]).gather(2, slots)
            layer.append(k_new, v_new, inputs.positions, inputs.modality, new_len)
        out_stats = StepStats([None] * self.num_layers)
        if stats is not None:
            out_stats[:] = self._stats(main, stats, cache)
            for name, req in stats.extra.items():
                extra = dict(zip(self._stats_names, self._run(self._stats_names, feeds, req, valid)))
                out_stats.extra[name] = self._stats(extra, req, cache)
        logits = torch.from_numpy(main["logits"]).float()
        cache.processed += new_len.to(cache.processed)
        attended = (past + new_len[None]).double()
        return StepOutput(
            logits=logits if inputs.all_logits else logits[:, 0], stats=out_stats, attended=attended
        )

    def _feeds(
        self, inputs: StepInputs, cache: KVCache, past: Tensor, valid: Tensor
    ) -> dict[str, np.ndarray]:
        b, q = inputs.input_ids.shape
        hidden = inputs.inputs_embeds
        if hidden is None:
            hidden = self.adapter.embed_tokens(inputs.input_ids.to(self.device))
        pos = inputs.positions.to(torch.long)
        position_ids = pos[..., 0] if self.pos_dims == 1 else pos.permute(2, 0, 1)
        if inputs.all_logits:
            index = torch.arange(q)[None, :].expand(b, q)
        else:
            index = (inputs.new_len - 1).clamp(min=0)[:, None]
        np_dtype = _NUMPY_DTYPES[self.dtype]
        feeds = {
            "inputs_embeds": hidden.to(self.dtype).contiguous().numpy().astype(np_dtype, copy=False),
            "position_ids": position_ids.contiguous().numpy(),
            "past_lengths": past.contiguous().numpy(),
            "new_lengths": inputs.new_len.to(torch.long).numpy(),
            "logits_index": index.to(torch.long).contiguous().numpy(),
        }
        for i, layer in enumerate(cache.layers):
            k, v = layer.attention_kv()
            feeds[f"past_key_values.{i}.key"] = k.contiguous().numpy()
            feeds[f"past_key_values.{i}.value"] = v.contiguous().numpy()
        return feeds

    def _run(self, names: list[str], feeds: dict, request: StatsRequest | None, valid: Tensor) -> list:
        rows = valid if request is None or request.rows is None else request.rows.cpu() & valid
        threshold = 0.0 if request is None or request.threshold is None else request.threshold
        feeds = {
            **feeds,
            "stats_rows": rows.to(torch.long).numpy(),
            "stats_threshold": np.array([threshold], dtype=np.float32),
        }
        return self.session.run(names, feeds)

    def _stats(self, out: dict, request: StatsRequest, cache: KVCache) -> list:
        """Per-layer :class:`vlkv.plugins.AttnStats` (None where not wanted), trimmed to each layer's slots."""
        from vlkv.plugins import AttnStats

        result = []
        for i, layer in enumerate(cache.layers):
            if not request.wants(i):
                result.append(None)
                continue
            colsum = torch.from_numpy(out[f"attn_colsum.{i}"])[:, :, : layer.max_length]
            below = torch.from_numpy(out[f"attn_below.{i}"]) if request.threshold is not None else None
            result.append(
                AttnStats(
                    colsum=colsum.contiguous(),
                    below=below,
                    visible=torch.from_numpy(out[f"attn_visible.{i}"]),
                )
            )
        return result
