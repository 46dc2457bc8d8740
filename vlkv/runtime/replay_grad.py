"""KVgrad's replay attention: a hand-written backward that scores the cached entries as it goes.

KVgrad scores entry ``c`` of layer ``l`` as ``max over rows p and query heads h`` of
``P[h, p, c] · w_p · ||W_O,h v_c||`` with ``w_p = ||d Phi / d A_p||``, ``A`` the layer's attention
module output (:mod:`vlkv.runtime.replay`). Through autograd that took a second pass over ``q · k``
after the backward, and autograd through the CPU flash kernel (forward and backward with an explicit
``(r, S + r)`` mask) was most of KVgrad's cost. Here the attention is a :class:`torch.autograd.Function`
whose backward recomputes ``P = exp(l - lse)`` block by block (flash-style, from ``q``, ``k`` and the
saved log-sum-exp) to get ``dq`` and the own rows' ``dk``/``dv``, and takes the scores from that
same ``P``: ``w`` is known by then, because the gradient reaches the attention module's output
(a tensor hook stores its row norms in :class:`GradScores`) before it reaches the attention core.
No second ``q · k`` for the scores, and the matrix products run in the replay's dtype (bf16 products
are several times faster on CPUs with bf16 units), the scores' max in float32.

The forward keeps each block's probabilities (one fused softmax, in the replay's dtype) for the
backward while a chunk's total stays under :data:`KEEP_PROBS_BYTES` (about ``B · H · r · (S + r)``
elements per layer: 0.43 GB in bf16 for a 512-token chunk over 1024 tokens, 30 layers, 9 heads);
past it a layer's forward stores only the log-sum-exp and its backward recomputes ``P`` flash-style
(memory O(ROW_BLOCK × context)). Keeping ``P`` saves the backward's ``q · k``, its masking and its
``exp``: the attention's backward went from 2.9 s to 2.0 s of a 1024-token bf16 replay.

``GradScores.through_probs = False`` (``attn_grad="values"``) holds ``P`` constant in the backward:
``dv = Pᵀ dout`` for the own rows, no ``dq``/``dk`` (so no ``dP``, no second matrix over ``(r, S + r)``
and no ``q``/``k`` projections' backward); the gradient reaches lower layers through the values, the
residual stream and the MLPs. An approximation of the row weights ``w_p`` only: the probabilities
the scores take the max of are the exact ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from vlkv.runtime.cache import KVCache

# replay rows per block: bounds the scratch to (B, H, ROW_BLOCK, S + r) floats
ROW_BLOCK = 256
# bytes of attention probabilities one replay chunk may keep from its forward for its backward
# (over every layer); past it a layer's backward recomputes them from q, k and the log-sum-exp
KEEP_PROBS_BYTES = 2 << 30


@dataclass
class GradScores:
    """Per-chunk exchange between the tensor hooks, the attention's backward and the caller.

    Attributes:
        col: layer -> ``(B, H, S)`` float32 ``||W_O,h v||`` of the cached entries.
        row_weight: layer -> ``(B, r)`` float32 ``||d Phi / d A_p||``, filled by the hooks.
        scores: layer -> ``(B, H_kv, S)`` float32 scores, filled by the backward.
        keep_bytes: the forward keeps each layer's attention probabilities (in the replay's dtype)
            for the backward while their total stays below this; 0 = always recompute them.
    """

    col: Callable[[int], Tensor]
    row_weight: dict[int, Tensor] = field(default_factory=dict)
    scores: dict[int, Tensor] = field(default_factory=dict)
    keep_bytes: int = KEEP_PROBS_BYTES
    kept_bytes: int = 0
    through_probs: bool = True

    def __post_init__(self) -> None:
        if self.keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {self.keep_bytes}")

    def may_keep(self, nbytes: int) -> bool:
        """Whether one more layer's ``nbytes`` of probabilities fit; counts them when they do."""
        if self.kept_bytes + nbytes > self.keep_bytes:
            return False
        self.kept_bytes += nbytes
        return True


def attend_with_scores(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cache_len: Tensor,
    new_len: Tensor,
    layer: int,
    sink: GradScores,
) -> Tensor:
    """Replay attention whose backward also writes layer ``layer``'s scores into ``sink``.

    Args:
        q: ``(B, H, r, D)``; k, v: ``(B, H_kv, S + r, D)``: ``S`` cached slots (valid below
            ``cache_len (B,)``), then the rows' own (row ``i`` sees own rows ``<= i``).
        new_len: ``(B,)`` valid replay rows (padding rows score nothing).

    Returns:
        ``(B, H, r, D)`` in ``q``'s dtype, as SDPA under :func:`~vlkv.runtime.replay._replay_mask`.
    """
    return _ReplayAttention.apply(q, k, v, scale, cache_len.to(q.device), new_len.to(q.device), layer, sink)


def _masked_logits(
    qb: Tensor,
    k: Tensor,
    scale: float,
    s: int,
    i: int,
    e: int,
    spare: Tensor | None,
    exact: bool = True,
) -> Tensor:
    """``(B, H_kv, G, e - i, S + e)`` scaled logits of rows ``i:e``, masked with -inf.

    ``qb (B, H_kv, G · (e - i), D)``; ``spare (B, 1, 1, 1, S)`` bool or None (every cached slot valid).
    float32 when ``exact``, else in ``qb``'s dtype (what the product returns: no cast, no scaling pass).
    """
    b, hkv, _, _ = qb.shape
    cols = s + e
    logits = torch.matmul(qb, k[:, :, :cols].transpose(-1, -2))
    if exact:
        logits = logits.float().mul_(scale)
    logits = logits.view(b, hkv, -1, e - i, cols)
    if spare is not None:
        logits[..., :s].masked_fill_(spare, float("-inf"))
    ahead = torch.arange(e, device=qb.device)[None, :] > torch.arange(i, e, device=qb.device)[:, None]
    logits[..., s:].masked_fill_(ahead, float("-inf"))
    return logits


def _spare(cache_len: Tensor, s: int) -> Tensor | None:
    spare = torch.arange(s, device=cache_len.device)[None, :] >= cache_len[:, None]  # (B, S)
    return spare[:, None, None, None] if bool(spare.any()) else None


class _ReplayAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, cache_len, new_len, layer, sink):
        b, h, r, d = q.shape
        hkv, s = k.shape[1], k.shape[2] - r
        g = h // hkv
        qg = q.reshape(b, hkv, g, r, d)
        spare = _spare(cache_len, s)
        out = torch.empty(b, hkv, g, r, d, dtype=q.dtype, device=q.device)
        # every block's (B, H_kv, G · rows, S + e) probabilities: about B · H · r · (S + r) elements
        kept: list[Tensor] | None = [] if sink.may_keep(b * h * r * (s + r) * q.element_size()) else None
        if kept is not None:  # one fused softmax per block in the replay's dtype; no lse needed
            lse = torch.empty(0, device=q.device)
            qs = (q * scale).reshape(b, hkv, g, r, d)
            for i in range(0, r, ROW_BLOCK):
                e = min(i + ROW_BLOCK, r)
                qb = qs[:, :, :, i:e].reshape(b, hkv, g * (e - i), d)
                p = torch.softmax(_masked_logits(qb, k, 1.0, s, i, e, spare, exact=False), dim=-1)
                p = p.view(b, hkv, g * (e - i), s + e)
                out[:, :, :, i:e] = torch.matmul(p, v[:, :, : s + e]).view(b, hkv, g, e - i, d)
                kept.append(p)
        else:  # float32 statistics; the backward recomputes p = exp(l - lse)
            lse = torch.empty(b, hkv, g, r, device=q.device)
            for i in range(0, r, ROW_BLOCK):
                e = min(i + ROW_BLOCK, r)
                qb = qg[:, :, :, i:e].reshape(b, hkv, g * (e - i), d)
                logits = _masked_logits(qb, k, scale, s, i, e, spare)
                m = logits.amax(-1, keepdim=True)  # every row sees itself: finite
                p = logits.sub_(m).exp_()
                total = p.sum(-1, keepdim=True)
                lse[:, :, :, i:e] = (m + total.log()).squeeze(-1)
                p = p.div_(total).to(q.dtype).view(b, hkv, g * (e - i), s + e)
                out[:, :, :, i:e] = torch.matmul(p, v[:, :, : s + e]).view(b, hkv, g, e - i, d)
        ctx.save_for_backward(q, k, v, out, lse, cache_len, new_len)
        ctx.scale, ctx.layer, ctx.sink, ctx.kept = scale, layer, sink, kept
        return out.view(b, h, r, d)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cache_len, new_len = ctx.saved_tensors
        scale, layer, sink = ctx.scale, ctx.layer, ctx.sink
        b, h, r, d = q.shape
        hkv, s = k.shape[1], k.shape[2] - r
        g, dev = h // hkv, q.device
        qg = q.reshape(b, hkv, g, r, d)
        dog = dout.reshape(b, hkv, g, r, d).to(q.dtype)
        spare = _spare(cache_len, s)
        weight = sink.row_weight.get(layer)
        if weight is not None:  # padding rows never win the max
            weight = weight.to(dev, torch.float32) * (torch.arange(r, device=dev)[None, :] < new_len[:, None])
        best = torch.zeros(b, hkv, g, s, device=dev)
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(k)  # the cached part gets none: it is the cache, not the graph's
        dv = torch.zeros_like(v)
        for i in range(0, r, ROW_BLOCK):
            e = min(i + ROW_BLOCK, r)
            rows, cols = g * (e - i), s + e
            qb = qg[:, :, :, i:e].reshape(b, hkv, rows, d)
            if ctx.kept is not None:  # the forward's own (the replay dtype's rounding at bf16)
                p = ctx.kept[i // ROW_BLOCK].view(b, hkv, g, e - i, cols)
            else:
                p = _masked_logits(qb, k, scale, s, i, e, spare).sub_(lse[:, :, :, i:e, None]).exp_()
            if weight is not None:  # float32 products (a bf16 p promotes)
                torch.maximum(best, (p[..., :s] * weight[:, None, None, i:e, None]).amax(dim=3), out=best)
            dob = dog[:, :, :, i:e]
            if not sink.through_probs:  # probabilities held constant: the values' gradient only
                p_own = p[..., s:].to(q.dtype).reshape(b, hkv, rows, e).transpose(-1, -2)
                dv[:, :, s:cols] += torch.matmul(p_own, dob.reshape(b, hkv, rows, d))
                continue
            # dv's factor, before p's storage turns into ds: the kept block itself when it is not float32
            p_own = p[..., s:] if p.dtype != torch.float32 else p[..., s:].to(q.dtype, copy=True)
            p = p.float()
            dp = torch.matmul(dob.reshape(b, hkv, rows, d), v[:, :, :cols].transpose(-1, -2)).float()
            delta = (dob.float() * out[:, :, :, i:e].float()).sum(-1, keepdim=True)  # (B, H_kv, G, rb, 1)
            ds = p.mul_(dp.view_as(p).sub_(delta))  # p's storage reused
            ds = ds.mul_(scale).to(q.dtype).view(b, hkv, rows, cols)
            dq[:, :, :, i:e] = torch.matmul(ds, k[:, :, :cols]).view(b, hkv, g, e - i, d)
            dk[:, :, s:cols] += torch.matmul(ds[..., s:].transpose(-1, -2), qb)
            p_own = p_own.view(b, hkv, rows, e).transpose(-1, -2)
            dv[:, :, s:cols] += torch.matmul(p_own, dob.reshape(b, hkv, rows, d))
        if weight is not None:
            best = best * sink.col(layer).to(dev, torch.float32).view(b, hkv, g, s)
            if spare is not None:
                best.masked_fill_(spare[:, :, :, 0], 0.0)
            sink.scores[layer] = best.amax(dim=2)
        ctx.kept = None
        if not sink.through_probs:
            return None, None, dv, None, None, None, None, None
        return dq.view(b, h, r, d), dk, dv, None, None, None, None, None


def value_output_norm(values: Tensor, o_weight: Tensor, num_heads: int) -> Tensor:
    """``||W_O,h v||`` per query head: what entry ``v`` writes into the residual stream through head ``h``.

    Args:
        values: ``(B, H_kv, S, D)``.
        o_weight: ``(hidden, H * D)`` the output projection's weight.

    Returns:
        ``(B, H, S)`` float32.
    """
    b, hkv, s, d = values.shape
    w = o_weight.float().view(-1, num_heads, d)  # (hidden, H, D)
    gram = torch.einsum("chd,che->hde", w, w)  # (H, D, D): ||W v||^2 = v^T W^T W v
    v = values.float().repeat_interleave(num_heads // hkv, dim=1)  # (B, H, S, D)
    sq = torch.einsum("bhsd,hde,bhse->bhs", v, gram, v)
    return sq.clamp(min=0).sqrt()


def col_weight(backend, cache: KVCache, cols: dict[int, Tensor]):
    """layer -> ``(B, H, S)`` ``||W_O,h v||`` of the cached values, computed once per replay."""

    def col(i: int) -> Tensor:
        if i not in cols:
            _, cv = cache.layers[i].attention_kv()
            w = backend.adapter.layers[i].self_attn.o_proj.weight
            cols[i] = value_output_norm(cv, w, backend.num_heads)
        return cols[i]

    return col
