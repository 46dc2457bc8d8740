"""PyTorch backend: drives a transformers VLM layer by layer on a vlkv :class:`KVCache`.

It plugs into transformers through its two public extension points rather than forking the
model code: a cache object whose ``update(k, v, layer_idx)`` writes into our per-layer,
per-sample state, and an attention function registered under the name ``"vlkv"`` in
``AttentionInterface`` (both are one step's :class:`~vlkv.runtime.step_context.StepContext`). The runtime calls each HF decoder layer itself, so it controls
positions, masks and per-layer cache lengths; statistics come from
:func:`vlkv.plugins.attn_stats`, which works in query chunks (or in a Triton kernel on GPU)
and never materialises a full ``T × T`` matrix.

Two optional per-step plans come from policies through :class:`StepInputs`: ``attend`` makes a
layer's decode attention really compute over a gathered subset of its cache
(:func:`vlkv.plugins.selected_attention`), and ``row_filter`` drops prompt rows' hidden states
after one layer of the layer loop (FastV-style), keeping the survivors' original positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepInputs, StepOutput
from vlkv.runtime.cache import KVCache
from vlkv.runtime.models.adapter import FamilyAdapter, make_adapter
from vlkv.runtime.prompt import PromptBatch, PromptError
from vlkv.runtime.replay import ReplayContext, ReplayRequest, run_replay
from vlkv.runtime.step_context import StepContext

ATTN_NAME = "vlkv"


def vlkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered with transformers as ``"vlkv"``.

    Outside a vlkv step (e.g. ``model.generate``) it defers to transformers' SDPA path so the
    model stays usable as an ordinary HF model.
    """
    if isinstance(attention_mask, (StepContext, ReplayContext)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return attention_mask.attend(module.layer_idx, query, key, value, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, vlkv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


class TorchBackend:
    """Runs prefill / decode steps of a HF VLM with vlkv's cache (see module docstring)."""

    name = "torch"
    supports_link = True
    supports_replay = True  # KVzip/KVgrad replay steps, gradients included (vlkv/runtime/replay.py)

    def __init__(self, model, family: str, image_token_id: int):
        _register_attention()
        self.model = model.eval()
        self.adapter: FamilyAdapter = make_adapter(family, model, image_token_id)
        self.adapter.text_config._attn_implementation = ATTN_NAME
        lay = self.adapter.layout
        self.num_layers, self.num_heads, self.num_kv_heads = lay.num_layers, lay.num_heads, lay.num_kv_heads
        self.head_dim, self.pos_dims = lay.head_dim, lay.pos_dims
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # the fused CPU decode read is built (or loaded from its cache) here, at engine start
        from vlkv.plugins.paged_cpu import warm_up

        self.fused_cpu_read = warm_up(self.device, self.dtype)
        # a CPU fp32 model's weights into huge pages: the decode GEMMs stream them through ~512x fewer
        # TLB entries (1.05-1.11x a step at 8k x 4, bit-equal; VLKV_CPU_HUGE_WEIGHTS=0 leaves them)
        from vlkv.plugins import weight_pages

        weight_pages.place(self.adapter, self.device, self.dtype)
        # the Triton device path (CUDA): q/k/v and gate/up weights fused once, for the device layer's
        # few launches a decode layer (models/device_layer.py; VLKV_DEVICE_LAYER=0 leaves them)
        from vlkv.runtime.models import device_layer

        self.adapter.device_layer = device_layer.prepare(self.adapter.layers, self.device)
        # a static_step.StaticDecode where decode steps may take the fixed-buffer forward (a CUDA graph
        # with Engine(decode_graph=True)); None: every step eager
        self.static = None

    @torch.no_grad()
    def embed(self, batch: PromptBatch) -> Tensor:
        """``(B, T, hidden)`` embeddings with each prompt's image features in its image slots."""
        emb = self.adapter.embed_tokens(batch.input_ids.to(self.device))
        for b, p in enumerate(batch.prompts):
            if not p.spans.image_spans:
                continue
            feats = self.adapter.image_features({k: v.to(self.device) for k, v in p.vision.items()})
            slots = (p.input_ids == self.adapter.image_token_id).nonzero().squeeze(-1)
            if feats.shape[0] != slots.numel():
                raise PromptError(
                    f"image features ({feats.shape[0]}) do not match image tokens ({slots.numel()})"
                )
            emb[b, slots] = feats.to(emb.dtype)
        return emb

    def replay(
        self, request: ReplayRequest, cache: KVCache, context: Tensor, lengths: Tensor, template_ids: Tensor
    ) -> list[Tensor | None]:
        """Replay ``context (B, T, hidden)`` (``lengths (B,)``) after ``template_ids (R0,)`` over the
        prefilled cache without writing to it; per layer ``(B, H_kv, S)`` max attention per entry."""
        return run_replay(self, request, cache, context, lengths, template_ids)

    @torch.no_grad()
    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        if self.static is not None:
            out = self.static.step(inputs, cache, stats)
            if out is not None:
                return out
        ctx = StepContext(cache, inputs, stats)
        hidden = inputs.inputs_embeds
        if hidden is None:
            hidden = self.adapter.embed_tokens(inputs.input_ids.to(self.device))
        positions = inputs.positions.to(self.device)
        cos_sin = self.adapter.rotary(hidden, positions)
        flt = inputs.row_filter
        for i, layer in enumerate(self.adapter.layers):
            hidden = self.adapter.run_layer(layer, hidden, ctx, cos_sin, fast=True)
            if flt is not None and i == flt.after_layer and i + 1 < self.num_layers:
                hidden, positions = ctx.filter_rows(flt.choose(ctx.stats, i), hidden)
                cos_sin = self.adapter.rotary(hidden, positions.to(self.device))
        hidden = self.adapter.norm(hidden)
        if inputs.all_logits:
            logits = self.adapter.head(hidden, fast=True)
        else:
            last = (ctx.inputs.new_len - 1).clamp(min=0).to(self.device)
            logits = self.adapter.head(
                hidden[torch.arange(hidden.shape[0], device=self.device), last], fast=True
            )
        cache.processed += inputs.new_len.to(cache.processed)
        done = all(a is not None for a in ctx.attended)
        # stays on the device: the commit reads it back with everything else in one transfer
        attended = torch.stack([a.to(self.device) for a in ctx.attended]) if done else None
        return StepOutput(logits=logits.float(), stats=ctx.stats, attended=attended)
