"""The replay step: extra query rows run over a prefilled cache without writing to it (KVzip, KVgrad).

After prefill, a query-agnostic policy asks the backend to *replay* the context: a short text
template ("Repeat the previous context:") followed by the context itself, as new query rows over
the cached context. The statistics are, per layer, the largest attention each cached entry
receives from any replay row, per KV head (max over the GQA group and over rows).

Chunking follows KVzip's reference form: the context is replayed in chunks of ``chunk_size``
tokens, each chunk preceded by the template, and chunk ``c`` attends to the cached context plus
its *own* rows only (causally), never to earlier replay chunks: the cache holds the context alone
for every chunk, exactly as KVzip truncates the cache back to the context after each chunk. So the
scores do not depend on the chunk boundaries of earlier chunks, and peak memory is
O(chunk × context) per layer. Each replay row's softmax runs over every cached entry (not a
window), so the score is the attention the model really pays; every entry collects the max over
all chunks' rows (not only the rows of the chunk that reconstructs it).

The context is replayed as its prompt *embeddings* (``Backend.embed``), so an image span is
replayed as its projected image features: the same rows for text and images.

KVgrad adds, per chunk, a backward pass of ``Phi = sum_p ||h_p||^2`` (``h`` = last decoder layer's
output on the valid replay rows) and weights each (row, query head, entry) attention by the gradient
norm of ``Phi`` with respect to that row's attention output and by ``||W_O,h v||`` of the entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.runtime import replay_grad as _replay_grad
from vlkv.runtime.cache import KVCache
from vlkv.runtime.replay_dtype import AUTO, REPLAY_DTYPES, replay_layers
from vlkv.runtime.replay_fast import attend_and_score, attention_with_lse, scores_from_lse
from vlkv.runtime.replay_grad import GradScores, attend_with_scores, col_weight
from vlkv.runtime.replay_grad import value_output_norm as value_output_norm  # public here since 0.2

DEFAULT_TEMPLATE = "\n\nRepeat the previous context:"
REPLAY_MODES = ("context", "prompt")
# KVgrad's backward through each layer's attention: "full" (the exact gradient) or "values" (the
# attention probabilities held constant: through the values, the residual stream and the MLPs only)
ATTN_GRADS = ("full", "values")


@dataclass
class ReplayRequest:
    """What a query-agnostic policy asks the backend to replay after prefill.

    Attributes:
        template: text prepended to every replayed chunk.
        chunk_size: context tokens per replay chunk, >= 1.
        gradient: also weight by the objective's gradient and ``||W_O v||`` (KVgrad; PyTorch only).
        mode: ``"context"`` replays template + context (KVzip); ``"prompt"`` runs the template alone
            once (a fixed generic prompt such as "Describe the image.", cost independent of the context).
        every: replay only every ``every``-th chunk (1 = all; subsampled replay is cheaper); entries
            never scored by a replay row of their own chunk still get the max from the replayed rows.
        value_norm: also weight each (query head, entry) by ``||W_O,h v||`` without a backward pass
            (KVgrad's input factor alone; KVgrad itself always has it).
        exact: score with the reference pass (a second, materialised softmax per layer,
            :func:`replay_attention_max`) instead of the fast one (the scores from the attention
            kernel's own row statistics, :mod:`vlkv.runtime.replay_fast`); equal up to float rounding.
        dtype: the replay's compute dtype: ``"model"`` (the model's own), one of
            :data:`~vlkv.runtime.replay_dtype.REPLAY_DTYPES` (a cast copy of the decoder layers, kept per
            model; the cache and the scores stay as they are) or ``"auto"`` (bf16 where the hardware
            runs it natively, :func:`~vlkv.runtime.replay_dtype.resolve_dtype`). Below the model's
            dtype an approximation: it ranks with lower-precision queries.
        grad_layers: KVgrad's backward runs through the top ``grad_layers`` decoder layers only
            (-1 = all, the exact gradient); every lower layer's row weight is the gradient at the input
            of the lowest of them, i.e. through the residual stream alone. 0 = no backward at all:
            ``2 ||h_p||`` of the last layer's output. An approximation below -1.
        attn_grad: one of :data:`ATTN_GRADS`. ``"values"``: KVgrad's backward holds every layer's
            attention probabilities constant (no ``dq``/``dk``, no second pass over ``q · k``), so the
            gradient reaches lower layers through the values, the residual stream and the MLPs. An
            approximation (fast path only).
    """

    template: str = DEFAULT_TEMPLATE
    chunk_size: int = 512
    gradient: bool = False
    mode: str = "context"
    every: int = 1
    exact: bool = False
    value_norm: bool = False
    dtype: str = "model"
    grad_layers: int = -1
    attn_grad: str = "full"

    def __post_init__(self) -> None:
        if self.attn_grad not in ATTN_GRADS:
            raise ValueError(f"attn_grad must be one of {ATTN_GRADS}, got {self.attn_grad!r}")
        if self.exact and self.attn_grad != "full":
            raise ValueError("attn_grad='values' is an approximation of the fast pass; exact=True has none")
        if self.dtype not in ("model", AUTO) and self.dtype not in REPLAY_DTYPES:
            raise ValueError(
                f"dtype must be 'model', 'auto' or one of {tuple(REPLAY_DTYPES)}, got {self.dtype!r}"
            )
        if self.grad_layers < -1:
            raise ValueError(f"grad_layers must be >= -1 (-1 = all layers), got {self.grad_layers}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"mode must be one of {REPLAY_MODES}, got {self.mode!r}")


def replay_chunks(
    template: Tensor, context: Tensor, lengths: Tensor, request: ReplayRequest
) -> list[tuple[Tensor, Tensor]]:
    """The replay rows of every chunk, right-padded per sample.

    Args:
        template: ``(R0, hidden)`` template embeddings.
        context: ``(B, T, hidden)`` prompt embeddings (right-padded).
        lengths: ``(B,)`` int64 valid prompt tokens.

    Returns:
        per replayed chunk, ``rows (B, R0 + chunk, hidden)`` and ``new_len (B,)`` int64.
    """
    b = context.shape[0]
    lengths = lengths.to(context.device)
    head = template[None].expand(b, -1, -1)
    r0 = template.shape[0]
    if request.mode == "prompt":
        return [(head.contiguous(), torch.full((b,), r0, dtype=torch.long, device=context.device))]
    n_chunks = -(-int(lengths.max()) // request.chunk_size)
    out = []
    for c in range(0, n_chunks, request.every):
        start = c * request.chunk_size
        body = context[:, start : start + request.chunk_size]
        width = (lengths - start).clamp(0, body.shape[1])
        if not bool((width > 0).any()):
            continue
        new_len = torch.where(width > 0, width + r0, torch.zeros_like(width))
        out.append((torch.cat([head, body], dim=1), new_len))
    return out


def replay_attention_max(
    q: Tensor,
    k: Tensor,
    scale: float,
    cache_len: Tensor,
    new_len: Tensor,
    row_weight: Tensor | None = None,
    col_weight: Tensor | None = None,
) -> Tensor:
    """Max attention each cached entry receives from the valid replay rows, per KV head.

    Args:
        q: ``(B, H, r, D)`` replay queries.
        k: ``(B, H_kv, S + r, D)`` keys: ``S`` cached slots (valid below ``cache_len``), then the r rows'.
        cache_len: ``(B,)`` valid cached entries; new_len: ``(B,)`` valid replay rows.
        row_weight: optional ``(B, r)`` factor per row (KVgrad's gradient norm).
        col_weight: optional ``(B, H, S)`` factor per query head and entry (KVgrad's ``||W_O v||``).

    Returns:
        ``(B, H_kv, S)`` float32: ``max over rows and GQA group`` of softmax probability × weights;
        0 at invalid slots. Holds ``(B, H, r, S + r)`` at a time: O(chunk × context).
    """
    b, h, r, _ = q.shape
    hkv, total = k.shape[1], k.shape[2]
    s = total - r
    dev = q.device
    cache_len, new_len = cache_len.to(dev), new_len.to(dev)
    logits = torch.einsum("bkgrd,bksd->bkgrs", q.float().view(b, hkv, h // hkv, r, -1), k.float()).reshape(
        b, h, r, total
    )
    visible = _replay_mask(cache_len, new_len, s, r, dev)  # (B, r, S + r)
    probs = torch.softmax(logits.mul_(scale).masked_fill_(~visible[:, None], float("-inf")), dim=-1)
    att = probs[..., :s] * (torch.arange(r, device=dev)[None, :] < new_len[:, None])[:, None, :, None]
    if row_weight is not None:
        att = att * row_weight.to(dev, torch.float32)[:, None, :, None]
    best = att.amax(dim=2)  # (B, H, S)
    if col_weight is not None:  # constant over rows, so it commutes with the row max
        best = best * col_weight.to(dev, torch.float32)
    return best.view(b, hkv, h // hkv, s).amax(dim=2)


def _replay_mask(cache_len: Tensor, new_len: Tensor, s: int, r: int, device) -> Tensor:
    """``(B, r, S + r)`` bool: row ``i`` sees the valid cached slots and the replay rows ``<= i``.

    Padding rows (``i >= new_len``) still see themselves so no softmax row is empty.
    """
    j = torch.arange(s + r, device=device)
    i = torch.arange(r, device=device)
    cached = j[None, None, :] < cache_len[:, None, None]
    own = (j[None, :] >= s) & (j[None, :] - s <= i[:, None])  # (r, S + r)
    return cached.expand(-1, r, -1) | own[None]


def replay_refusal(backend: str, gradient: bool) -> str:
    """The one-line reason a backend without replay steps refuses KVzip (or KVgrad, which needs gradients)."""
    if gradient:
        return (
            f"kvgrad needs gradients through the model, which only the PyTorch backend has "
            f"(not {backend}): use --backend torch"
        )
    return f"the replay step (kvzip) is not available on the {backend} backend: use --backend torch"


class ReplayContext:
    """Per-chunk state handed to the attention function in place of HF's mask and cache.

    ``update`` returns the cached K/V with the chunk's K/V appended but writes nothing to the cache.
    """

    def __init__(
        self,
        cache: KVCache,
        new_len: Tensor,
        keep_queries: bool = False,
        exact: bool = False,
        col_weight=None,
    ):
        self.cache, self.new_len, self.exact = cache, new_len, exact
        # optional layer -> (B, H, S) float32 factor per query head and entry (``||W_O v||``)
        self.col_weight = col_weight
        self.scores: list[Tensor | None] = [None] * len(cache.layers)
        # KVgrad scores after the backward pass: per layer the queries and the chunk's keys (exact)
        # or the queries and their rows' log-sum-exp (fast)
        self.keep_queries = keep_queries
        self.saved: dict[int, tuple[Tensor, Tensor, float]] = {}
        # KVgrad fast: layers run with a graph score in their attention's backward (replay_grad.py)
        self.sink: GradScores | None = None
        self._masks: dict[tuple, Tensor] = {}

    def update(
        self, k: Tensor, v: Tensor, layer_idx: int, cache_kwargs=None, **kwargs
    ) -> tuple[Tensor, Tensor]:
        ck, cv = self.cache.layers[layer_idx].attention_kv(view=True)
        return torch.cat([ck.to(k.dtype), k], dim=2), torch.cat([cv.to(v.dtype), v], dim=2)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``q (B, H, r, D)``, ``k/v (B, H_kv, S + r, D)`` → ``(B, r, H, D)``."""
        r = q.shape[2]
        s = k.shape[2] - r
        cache_len = self.cache.layers[layer_idx].lengths.to(q.device)
        new_len = self.new_len.to(q.device)
        key = (s, r, q.device, *cache_len.tolist())  # layers share lengths before eviction: one mask
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = _replay_mask(cache_len, new_len, s, r, q.device)[:, None]
        if not self.exact and self.keep_queries and self.sink is not None and q.requires_grad:
            out = attend_with_scores(q, k, v, scale, cache_len, self.new_len, layer_idx, self.sink)
            return out.transpose(1, 2).contiguous()
        if not self.exact and self.keep_queries:  # KVgrad, below the backward: scores after it
            out, lse = attention_with_lse(q, k, v, mask, scale)
            self.saved[layer_idx] = (q.detach(), lse, scale)
            return out.transpose(1, 2).contiguous()
        col = self.col_weight(layer_idx) if self.col_weight is not None else None
        if not self.exact:
            out, self.scores[layer_idx] = attend_and_score(q, k, v, scale, cache_len, new_len, col)
            return out.transpose(1, 2).contiguous()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        if self.keep_queries:
            self.saved[layer_idx] = (q.detach(), k[:, :, s:].detach(), scale)
        else:
            with torch.no_grad():
                self.scores[layer_idx] = replay_attention_max(q, k, scale, cache_len, new_len, col_weight=col)
        return out.transpose(1, 2).contiguous()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.layers[layer_idx].max_length


def merge_max(total: list[Tensor | None], part: list[Tensor | None]) -> list[Tensor | None]:
    """Element-wise max of two per-layer score lists (``(B, H_kv, S)`` each, None = nothing yet)."""
    return [p if t is None else (t if p is None else torch.maximum(t, p)) for t, p in zip(total, part)]


def run_replay(
    backend, request: ReplayRequest, cache: KVCache, context: Tensor, lengths: Tensor, template_ids: Tensor
):
    """Replay ``context`` over ``cache`` on a PyTorch backend; the cache is left bit-identical.

    Args:
        backend: a :class:`~vlkv.runtime.torch_backend.TorchBackend`.
        context: ``(B, T, hidden)`` prompt embeddings; lengths: ``(B,)`` int64 valid tokens.
        template_ids: ``(R0,)`` int64 template token ids.

    Returns:
        per layer ``(B, H_kv, S)`` float32 scores over the layer's ``S = max_length`` slots.
    """
    if any(layer.holes is not None for layer in cache.layers):
        raise ValueError("replay scores a cache before per-head eviction; this cache already has holes")
    adapter, dev = backend.adapter, backend.device
    layers = replay_layers(adapter.layers, request.dtype)
    with torch.no_grad():
        template = adapter.embed_tokens(template_ids[None].to(dev))[0]
    total: list[Tensor | None] = [None] * len(cache.layers)
    cols: dict[int, Tensor] = {}  # KVgrad's ||W_O v|| per layer: the cache is the same for every chunk
    for rows, new_len in replay_chunks(template, context.to(dev), lengths, request):
        rows = rows.to(next(layers.parameters()).dtype)
        if request.gradient:
            part = _chunk_gradient(backend, layers, cache, rows, new_len, request, cols)
        else:
            col = col_weight(backend, cache, cols) if request.value_norm else None
            part = _chunk(backend, layers, cache, rows, new_len, request.exact, col)
        total = merge_max(total, part)
    return total


def _positions(cache: KVCache, r: int) -> Tensor:
    """``(B, r, P)`` positions of replay rows: right after the context, restarting for every chunk."""
    nxt = cache.next_position
    return nxt[:, None, :] + torch.arange(r, device=nxt.device)[None, :, None]


def _run_layers(backend, layers, ctx: ReplayContext, cache: KVCache, rows: Tensor, cos_sin=None) -> Tensor:
    """``rows (B, r, hidden)`` through ``layers`` (the model's decoder layers or a slice of them)."""
    adapter = backend.adapter
    if cos_sin is None:
        cos_sin = adapter.rotary(rows, _positions(cache, rows.shape[1]).to(rows.device))
    hidden = rows
    for layer in layers:
        hidden = adapter.run_layer(layer, hidden, ctx, cos_sin)
    return hidden


@torch.no_grad()
def _chunk(
    backend, layers, cache: KVCache, rows: Tensor, new_len: Tensor, exact: bool, col_weight=None
) -> list[Tensor | None]:
    ctx = ReplayContext(cache, new_len, exact=exact, col_weight=col_weight)
    _run_layers(backend, layers, ctx, cache, rows)
    return ctx.scores


def _chunk_gradient(
    backend,
    layers,
    cache: KVCache,
    rows: Tensor,
    new_len: Tensor,
    request: ReplayRequest,
    cols: dict[int, Tensor],
) -> list[Tensor | None]:
    """KVgrad: forward, ``d Phi / d (attention output)`` by a backward pass, then the weighted scores.

    ``layers``: the decoder layers the replay runs (the model's, or a cast copy); the backward runs
    through the top ``request.grad_layers`` of them (all for -1), the lower ones run without a graph.
    Fast path: those layers' attention scores in its own backward (:mod:`vlkv.runtime.replay_grad`);
    exact: autograd through SDPA, then :func:`replay_attention_max` per layer.
    ``cols``: ``||W_O v||`` per layer, filled on the first chunk and reused by the others."""
    adapter, exact = backend.adapter, request.exact
    n_layers = len(layers)
    split = 0 if request.grad_layers < 0 else n_layers - min(request.grad_layers, n_layers)
    frozen = [p for p in layers.parameters() if p.requires_grad]
    col = col_weight(backend, cache, cols)
    ctx = ReplayContext(cache, new_len, keep_queries=True, exact=exact)
    sink = ctx.sink = (
        None
        if exact
        else GradScores(
            col, keep_bytes=_replay_grad.KEEP_PROBS_BYTES, through_probs=request.attn_grad == "full"
        )
    )
    outputs: dict[int, Tensor] = {}

    def keep(i):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            outputs[i] = out
            if sink is not None and out.requires_grad:  # row norms of d Phi / d A, before the core's backward
                out.register_hook(lambda grad: sink.row_weight.__setitem__(i, grad.float().norm(dim=-1)))

        return hook

    hooks = [layers[i].self_attn.register_forward_hook(keep(i)) for i in range(split, n_layers)]
    cos_sin = adapter.rotary(rows, _positions(cache, rows.shape[1]).to(rows.device))
    try:
        for p in frozen:  # gradients w.r.t. activations only
            p.requires_grad_(False)
        with torch.no_grad():  # below the backward's reach: no graph
            base = _run_layers(backend, layers[:split], ctx, cache, rows, cos_sin)
        with torch.enable_grad():
            base = base.detach().requires_grad_(True)
            hidden = _run_layers(backend, layers[split:], ctx, cache, base, cos_sin)
            valid = (
                torch.arange(rows.shape[1], device=rows.device)[None, :] < new_len.to(rows.device)[:, None]
            )
            phi = (hidden.float().square().sum(-1) * valid).sum()
            if exact:
                wanted = [outputs[i] for i in range(split, n_layers)] + ([base] if split > 0 else [])
            else:  # the hooks and the attention's backward collect what they need on the way down
                wanted = [base]
            grads = torch.autograd.grad(phi, wanted)
    finally:
        for hook in hooks:
            hook.remove()
        for p in frozen:
            p.requires_grad_(True)
    # layers below the split: the gradient reaching the split through the residual stream alone
    below = grads[-1].float().norm(dim=-1) if split > 0 else None
    scores: list[Tensor | None] = [None] * len(cache.layers)
    with torch.no_grad():
        for i in range(n_layers):
            if sink is not None and i >= split:
                scores[i] = sink.scores[i]
                continue
            q, saved, scale = ctx.saved[i]
            row = below if i < split else grads[i - split].float().norm(dim=-1)
            layer = cache.layers[i]
            ck, _ = layer.attention_kv()
            if not exact:
                scores[i] = scores_from_lse(q, ck, scale, saved, layer.lengths, new_len, row, col(i))
                continue
            scores[i] = replay_attention_max(
                q,
                torch.cat([ck.to(saved.dtype), saved], dim=2),
                scale,
                layer.lengths,
                new_len,
                row_weight=row,
                col_weight=col(i),
            )
    return scores
