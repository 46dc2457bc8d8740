"""One decoder layer on explicit K/V, written out for export: attention scores once, statistics from them.

The norms, projections and MLP are the HF layer's own modules; only attention is written out, because
the cache is vlkv's (right-padded, every layer and possibly every KV head its own length). The same
module is traced into the ONNX Runtime backend's per-layer graphs (``layer_graphs``) and, in a loop,
into the exporter's single decoder graph (``vlkv.exporter.decoder_graph``).

Slots after the step (``S = P + q``): slot ``j`` of sample ``b`` and KV head ``h`` holds past entry ``j``
when ``j < past[b, h]`` and new row ``j - past[b, h]`` after it; the rest is 0 (``LayerKV.append``).
Key ``j`` is visible to new row ``i`` iff ``j <= past + i`` and ``j < past + new_len[b]`` (the PyTorch
backend's mask). Scores are float32 whatever the model dtype; a masked score is ``finfo(float32).min``,
not ``-inf``, so a row with no visible key stays finite instead of NaN.

The statistics (``vlkv.plugins.attn_stats_reference`` semantics) are read off the attention's own
softmax, for ``R`` row sets at once: the backend asks for several row sets per step (a policy's main
request and its named extras) and pays for the ``(q, S)`` scores once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlkv.runtime.models.adapter import LayerLayout
from vlkv.runtime.onnx.nodes import expand, reshape

# Roles of the tensors a mark hook sees, in the order of the AttnStats plugin's inputs (plus the
# threshold, which the plugin takes as an attribute); see vlkv.exporter.decoder_graph.
STATS_ROLES = ("query", "key", "rows", "key_lengths", "q_offset", "threshold")
Mark = Callable[[Tensor, str], Tensor]


def _no_mark(x: Tensor, role: str) -> Tensor:
    return x


class LayerStep(nn.Module):
    """One HF decoder layer (``layer``: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
    ``mlp``) on explicit K/V; ``mark(tensor, role)`` sees each statistics boundary tensor (identity by
    default; the exporter pins names on them)."""

    def __init__(self, layer: nn.Module, layout: LayerLayout, mark: Mark | None = None):
        super().__init__()
        self.layer, self.layout = layer, layout
        self.scale = float(layer.self_attn.scaling)
        self.mark = mark or _no_mark

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        past_k: Tensor,
        past_v: Tensor,
        past_len: Tensor,
        new_len: Tensor,
        rows: Tensor,
        threshold: Tensor,
    ) -> tuple[Tensor, ...]:
        """Run the layer.

        Args:
            hidden: ``(B, q, hidden)`` model dtype.
            cos, sin: ``(B, q, D)`` the rotary embedding of the rows' positions.
            past_k, past_v: ``(B, Hkv, P, D)`` post-RoPE past keys / values (valid prefix per sample/head).
            past_len: ``(B,)`` or ``(B, Hkv)`` int64 valid past slots per sample (or per sample and head).
            new_len: ``(B,)`` int64 valid new rows per sample.
            rows: ``(R, B, q)`` or ``(B, q)`` int64, nonzero = the row enters that row set's statistics.
            threshold: ``(R,)`` float32, the relative threshold of each row set's below counts.

        Returns:
            ``hidden (B, q, hidden)``, new ``k, v (B, Hkv, q, D)``, ``present_k, present_v (B, Hkv, S, D)``,
            ``colsum (R, B, H, S)`` float32, ``below (R, B, H)`` int64, ``visible (R, B, H)`` int64 (the
            statistics without the ``R`` axis when ``rows`` is ``(B, q)``).
        """
        layer = self.layer
        attn, k, v, present_k, present_v, stats = self._attention(
            layer.input_layernorm(hidden), cos, sin, past_k, past_v, past_len, new_len, rows, threshold
        )
        hidden = hidden + attn
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return (hidden, k, v, present_k, present_v, *stats)

    def _attention(self, x, cos, sin, past_k, past_v, past_len, new_len, rows, threshold):
        lay, attn, mark = self.layout, self.layer.self_attn, self.mark
        h, hkv, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
        nq = x.shape[1]
        q = reshape(attn.q_proj(x), 0, -1, h, d).transpose(1, 2)
        k = reshape(attn.k_proj(x), 0, -1, hkv, d).transpose(1, 2)
        v = reshape(attn.v_proj(x), 0, -1, hkv, d).transpose(1, 2)
        q, k = rope(q, cos, sin, d // 2), rope(k, cos, sin, d // 2)
        past_len = mark(past_len, "q_offset")
        total = mark(past_len + (new_len if past_len.dim() == 1 else new_len[:, None]), "key_lengths")
        past_h, total_h = reshape(past_len, 0, -1), reshape(total, 0, -1)  # (B, 1 or Hkv)
        j = torch.arange(past_k.shape[2] + nq, device=x.device)  # slots after the step
        rel = (j[None, None, :] - past_h[:, :, None]).clamp(min=0)  # (B, 1|Hkv, S), always < S
        index = expand(rel[..., None], 1, hkv, 1, d)
        is_past = (j[None, None, :] < past_h[:, :, None])[..., None]
        zeros_p, zeros_q = torch.zeros_like(past_k), torch.zeros_like(k)
        present_k = append(past_k, k, index, is_past, zeros_p, zeros_q)
        present_v = append(past_v, v, index, is_past, zeros_p, zeros_q)
        q, keys = mark(q, "query"), mark(present_k, "key")  # the present itself is an output: not marked
        i = torch.arange(nq, device=x.device)
        causal = j[None, None, None, :] <= past_h[:, :, None, None] + i[None, None, :, None]
        vis = causal & (j[None, None, None, :] < total_h[:, :, None, None])  # (B, 1|Hkv, q, S)
        qg = reshape(q.float(), 0, hkv, h // hkv, -1, d)
        scores = torch.matmul(qg, keys.float().unsqueeze(2).transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~vis[:, :, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)  # (B, Hkv, G, q, S)
        out = torch.matmul(probs, present_v.float().unsqueeze(2)).to(x.dtype)  # (B, Hkv, G, q, D)
        out = reshape(reshape(out, 0, h, -1, d).transpose(1, 2), 0, 0, -1)
        stats = self._stats(probs, vis, mark(rows, "rows"), mark(threshold, "threshold"))
        return attn.o_proj(out), k, v, present_k, present_v, stats

    def _stats(self, probs: Tensor, vis: Tensor, rows: Tensor, threshold: Tensor):
        """probs ``(B, Hkv, G, q, S)`` float32, vis ``(B, 1|Hkv, q, S)`` bool, rows ``(R, B, q)`` or
        ``(B, q)``, threshold ``(R,)`` → colsum ``(R, B, H, S)``, below / visible ``(R, B, H)``."""
        h, hkv = self.layout.num_heads, self.layout.num_kv_heads
        single = rows.dim() == 2
        rows = rows[None] if single else rows
        seen = vis.float().sum(-1)  # (B, 1|Hkv, q): visible keys per row, exact below 2**24
        # a row with no visible key has uniform probs over masked slots: it contributes nothing
        sel = (rows != 0)[:, :, None, :] & (seen > 0)[None]  # (R, B, 1|Hkv, q)
        weights = sel[:, :, :, None, None, :].float()  # (R, B, 1|Hkv, 1, 1, q)
        colsum = reshape(torch.matmul(weights, probs[None]), 0, 0, h, -1)  # (R, B, H, S)
        # integer counts: per-row counts are exact in float32; rows are summed in int64
        visible = (seen.long()[None] * sel.long()).sum(-1)  # (R, B, 1|Hkv)
        visible = reshape(expand(visible[..., None], 1, 1, hkv, h // hkv), 0, 0, -1)
        cut = threshold[:, None, None, None, None, None] * probs.amax(dim=-1, keepdim=True)[None]
        low = ((probs[None] < cut) & vis[None, :, :, None]).float().sum(-1).long()  # (R, B, Hkv, G, q)
        below = reshape((low * sel[:, :, :, None, :].long()).sum(-1), 0, 0, -1)  # (R, B, H)
        if single:
            return colsum[0], below[0], visible[0]
        return colsum, below, visible


def rope(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    """x ``(B, heads, q, D)``, cos/sin ``(B, q, D)``, ``half = D // 2``: HF's ``apply_rotary_pos_emb``
    for one tensor (``half`` is a Python int so the slices export as constants)."""
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def append(
    past: Tensor, new: Tensor, index: Tensor, is_past: Tensor, zeros_p: Tensor, zeros_q: Tensor
) -> Tensor:
    """past ``(B, Hkv, P, D)``, new ``(B, Hkv, q, D)`` → ``(B, Hkv, P + q, D)`` with the new rows right
    after each sample's (and head's) valid past. ``index (B, Hkv, P + q, D)`` int64 and ``is_past
    (B, 1|Hkv, P + q, 1)`` bool come from the past lengths; zeros are ``past``/``new``-shaped.

    The zero tail of length P keeps every index in range without a dynamic ``clamp(max=q - 1)``.
    """
    gathered = torch.gather(torch.cat([new, zeros_p], dim=2), 2, index)
    return torch.where(is_past, torch.cat([past, zeros_q], dim=2), gathered)
