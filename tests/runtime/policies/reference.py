"""Brute-force references for the modality-aware policy tests (eager attention, manual layer loops)."""

from __future__ import annotations

import torch


def eager_attentions(loaded, embeds, positions) -> list[torch.Tensor]:
    """HF eager attention probabilities per layer, ``(B, H, n, n)`` float32, from the language model run
    on the runtime's own embeddings ``(B, n, hidden)`` and positions ``(B, n, P)``."""
    lm = loaded.model.model.language_model
    cfg = lm.config
    saved = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        pos_ids = positions.permute(2, 0, 1) if positions.shape[-1] == 3 else positions[..., 0]
        with torch.no_grad():
            out = lm(inputs_embeds=embeds, position_ids=pos_ids, output_attentions=True, use_cache=False)
        return [a.float() for a in out.attentions]
    finally:
        cfg._attn_implementation = saved


def post_vision_brute(
    att: torch.Tensor, rows: range, p: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """VL-Cache Eq. 2 density and token scores from one sample's full attention ``att (H, n, n)``.

    Returns density (scalar) and scores ``(H_kv, n)`` summed over the post-vision rows and GQA group.
    """
    h, n, _ = att.shape
    sel = att[:, list(rows)]  # (H, |P|, n)
    causal = torch.tensor([[j <= q for j in range(n)] for q in rows])
    pruned = (sel < p * sel.amax(-1, keepdim=True)) & causal
    gamma = pruned.sum((-1, -2)).double() / causal.sum().double()  # (H,)
    scores = sel.sum(1).view(h // group, group, n).sum(1)
    return 1 - gamma.mean(), scores


@torch.no_grad()
def filtered_forward(engine, embeds, positions, keep_rows, after_layer: int) -> torch.Tensor:
    """Last-row logits of one prompt when rows outside ``keep_rows`` (a list) are dropped after
    ``after_layer``: HF layers with plain causal SDPA, no vlkv cache involved."""
    ad = engine.backend.adapter
    hidden = embeds
    cos_sin = ad.rotary(hidden, positions)
    for i, layer in enumerate(ad.layers):
        hidden = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if i == after_layer:
            hidden, positions = hidden[:, keep_rows], positions[:, keep_rows]
            cos_sin = ad.rotary(hidden, positions)
    return ad.lm_head(ad.norm(hidden))[:, -1].float()
