"""PyTorch backend: drives a transformers VLM layer by layer on a vlkv :class:`KVCache`.

It plugs into transformers through its two public extension points rather than forking the
model code: a cache object whose ``update(k, v, layer_idx)`` writes into our per-layer,
per-sample state, and an attention function registered under the name ``"vlkv"`` in
``AttentionInterface``. The runtime calls each HF decoder layer itself, so it controls
positions, masks and per-layer cache lengths; statistics come from
:func:`vlkv.plugins.attn_stats`, which works in query chunks (or in a Triton kernel on GPU)
and never materialises a full ``T × T`` matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepInputs, StepOutput
from vlkv.runtime.cache import KVCache
from vlkv.runtime.models.adapter import FamilyAdapter, make_adapter
from vlkv.runtime.prompt import PromptBatch, PromptError

ATTN_NAME = "vlkv"


class _StepContext:
    """Per-step state handed to the attention function in place of HF's attention mask."""

    def __init__(self, cache: KVCache, inputs: StepInputs, stats: StatsRequest | None):
        self.cache, self.inputs, self.request = cache, inputs, stats
        self.past: dict[int, Tensor] = {}
        self.stats: list = [None] * len(cache.layers)
        q = inputs.input_ids.shape[1]
        valid = torch.arange(q, device=inputs.new_len.device)[None, :] < inputs.new_len[:, None]
        self.rows = valid if stats is None or stats.rows is None else stats.rows & valid

    def update(self, k: Tensor, v: Tensor, layer_idx: int, cache_kwargs=None) -> tuple[Tensor, Tensor]:
        """HF ``Cache.update`` contract: store the new K/V, return what attention reads."""
        layer = self.cache.layers[layer_idx]
        self.past[layer_idx] = layer.append(
            k, v, self.inputs.positions, self.inputs.modality, self.inputs.new_len
        )
        return layer.attention_kv()

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``q (B, H, q, D)``, ``k/v (B, H_kv, S, D)`` → ``(B, q, H, D)``."""
        past = self.past[layer_idx]
        nq, s = q.shape[2], k.shape[2]
        new_len = self.inputs.new_len.to(past)
        j = torch.arange(s, device=q.device)
        i = torch.arange(nq, device=q.device)
        # key j is visible to row i of sample b iff it is causal w.r.t. the row's slot and valid
        mask = (j[None, None, :] <= (past[:, None, None] + i[None, :, None])) & (
            j[None, None, :] < (past + new_len)[:, None, None]
        )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        if self.request is not None and self.request.wants(layer_idx):
            from vlkv.plugins import attn_stats

            self.stats[layer_idx] = attn_stats(
                q,
                k,
                scale,
                query_rows=self.rows,
                causal=True,
                threshold=self.request.threshold,
                key_lengths=past + new_len,
                q_offset=past,
            )
        return out.transpose(1, 2).contiguous()

    # transformers may ask a cache for these; answer with this step's view
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.layers[layer_idx].max_length


def vlkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered with transformers as ``"vlkv"``.

    Outside a vlkv step (e.g. ``model.generate``) it defers to transformers' SDPA path so the
    model stays usable as an ordinary HF model.
    """
    if isinstance(attention_mask, _StepContext):
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

    @torch.no_grad()
    def step(self, inputs: StepInputs, cache: KVCache, stats: StatsRequest | None = None) -> StepOutput:
        ctx = _StepContext(cache, inputs, stats)
        hidden = inputs.inputs_embeds
        if hidden is None:
            hidden = self.adapter.embed_tokens(inputs.input_ids.to(self.device))
        positions = inputs.positions.to(self.device)
        cos_sin = self.adapter.rotary(hidden, positions)
        for layer in self.adapter.layers:
            hidden = layer(hidden, attention_mask=ctx, position_embeddings=cos_sin, past_key_values=ctx)
        hidden = self.adapter.norm(hidden)
        if inputs.all_logits:
            logits = self.adapter.lm_head(hidden)
        else:
            last = (inputs.new_len - 1).clamp(min=0).to(self.device)
            logits = self.adapter.lm_head(hidden[torch.arange(hidden.shape[0], device=self.device), last])
        cache.processed += inputs.new_len.to(cache.processed)
        return StepOutput(logits=logits.float(), stats=ctx.stats)
