"""CacheHitRate (VL-Cache Def. 3.1): how many of the tokens the first decode query really attends
to most did a policy keep?

For layer ``l``, sample ``b`` and KV head ``h``: the true scores are the first decode query's
full-cache attention over the prompt tokens, summed over the GQA group of ``h`` (a KV head's entries
serve exactly those query heads); ``T*`` is their top ``k`` (ties to the lower token index); ``I`` is
the set of prompt tokens the policy still holds in that head right after its prefill edits. The
rate is ``|T* ∩ I| / k``, averaged over KV heads and samples.

``k`` is, per layer and sample, the number of prompt entries the policy kept (``None``, VL-Cache's
setting: the best policy of that size scores 1), a fixed count (``int``), or a share of the prompt
(``float`` in (0, 1)). Kept entries are matched to prompt tokens by their original positions (all
three M-RoPE components), so merged or filtered caches are matched too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.backend import StatsRequest, StepInputs
from vlkv.runtime.cache import KVCache, Modality
from vlkv.runtime.policies.base import Policy, per_kv_head
from vlkv.runtime.policies.full import FullPolicy
from vlkv.runtime.prompt import Prompt, PromptBatch


def _keys(pos: Tensor, base: int) -> Tensor:
    """Positions ``(..., P)`` → one int64 key each (mixed radix ``base``)."""
    key = torch.zeros(pos.shape[:-1], dtype=torch.long, device=pos.device)
    for i in range(pos.shape[-1]):
        key = key * base + pos[..., i]
    return key


def kept_tokens(cache: KVCache, batch: PromptBatch) -> list[Tensor]:
    """Per layer, ``(B, H_kv, T)`` bool: prompt token ``t`` is held by KV head ``h`` of sample ``b``."""
    b, t = batch.input_ids.shape
    out = []
    for layer in cache.layers:
        h = layer.kv_heads
        held = torch.zeros(b, h, t, dtype=torch.bool)
        for i, p in enumerate(batch.prompts):
            n = p.positions.shape[0]
            base = int(p.positions.max()) + 2
            prompt_keys = _keys(p.positions, base)
            order = torch.argsort(prompt_keys)
            if torch.unique(prompt_keys).numel() != n:
                raise ValueError(
                    "prompt positions are not unique, so kept entries cannot be matched to tokens"
                )
            m = int(layer.lengths[i])
            keys = _keys(layer.positions[i, :, :m].cpu(), base)  # (H_kv, m)
            where = torch.searchsorted(prompt_keys[order], keys).clamp(max=n - 1)
            found = prompt_keys[order][where] == keys
            for head in range(h):
                held[i, head, order[where[head][found[head]]]] = True
        out.append(held)
    return out


@torch.no_grad()
def first_decode_attention(engine, batch: PromptBatch) -> tuple[list[Tensor], Tensor]:
    """The first decode query's full-cache attention over the prompt, per layer ``(B, H_kv, T)``
    float32 (GQA-group sums; 0 past each prompt), and the greedy first tokens ``(B,)``."""
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, FullPolicy(), cache)
    tokens = out.logits.argmax(-1)
    b = tokens.shape[0]
    inputs = StepInputs(
        tokens[:, None].to(batch.input_ids),
        cache.next_position[:, None],
        torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.ones(b, dtype=torch.long),
    )
    step = engine.backend.step(inputs, cache, StatsRequest())
    t = batch.input_ids.shape[1]
    prompt = torch.arange(t)[None, None, :] < batch.lengths[:, None, None]
    scores = []
    for st in step.stats:
        s = per_kv_head(st.colsum.float().cpu(), engine.backend.num_kv_heads)[:, :, :t]
        scores.append(torch.where(prompt, s, torch.zeros_like(s)))
    return scores, tokens


def hit_rates(
    true: list[Tensor], kept: list[Tensor], lengths: Tensor, k: int | float | None = None
) -> Tensor:
    """``(L, B)`` float64 hit rates from true scores and kept masks (both per layer ``(B, H_kv, T)``)."""
    if k is not None and not (isinstance(k, int) and k >= 1 or isinstance(k, float) and 0.0 < k < 1.0):
        raise ValueError(f"k must be None, an int >= 1 or a float in (0, 1), got {k!r}")
    rates = torch.zeros(len(true), lengths.shape[0], dtype=torch.float64)
    for layer, (scores, held) in enumerate(zip(true, kept)):
        for b, n in enumerate(lengths.tolist()):
            if k is None:
                kk = int(held[b, 0, :n].sum())
            elif isinstance(k, int):
                kk = k
            else:
                kk = round(k * n)
            kk = min(max(kk, 1), n)
            top = torch.sort(scores[b, :, :n], dim=-1, descending=True, stable=True).indices[:, :kk]
            rates[layer, b] = held[b, :, :n].gather(-1, top).double().mean()
    return rates


def hit_rate_report(engine, batch: PromptBatch, cache: KVCache, k: int | float | None = None) -> dict:
    """JSON-ready CacheHitRate of a cache right after a policy's prefill edits.

    Returns ``{"per_layer": [L floats], "mean": float, "per_sample": [B lists of L], "k": k}``.
    """
    true, _ = first_decode_attention(engine, batch)
    rates = hit_rates(true, kept_tokens(cache, batch), batch.lengths, k)
    return {
        "per_layer": rates.mean(1).tolist(),
        "mean": float(rates.mean()),
        "per_sample": rates.T.tolist(),
        "k": k,
    }


def cache_hit_rate(
    engine, prompts: list[Prompt], policy: Policy, k: int | float | None = None
) -> list[float]:
    """Per-layer CacheHitRate of ``policy`` on ``prompts`` (mean over samples and KV heads).

    Args:
        engine: a :class:`~vlkv.runtime.engine.Engine`.
        prompts: the batch (run together, as :meth:`Engine.generate` would).
        policy: any policy, at any budget.
        k: see the module docstring.
    """
    batch = engine.encode(list(prompts))
    cache = engine.new_cache(batch)
    engine.prefill(batch, policy, cache)
    return hit_rate_report(engine, batch, cache, k)["per_layer"]
