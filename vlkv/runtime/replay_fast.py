"""The replay's fast scoring: scores from the pass that produces the replay's output.

The reference (:func:`vlkv.runtime.replay.replay_attention_max`) runs a second attention per layer:
``(B, H, r, S + r)`` logits, a masked softmax over them, then a max over rows. Every probability it
takes the max of is ``exp(l - lse)`` with ``l = scale · q·k`` and ``lse`` the row's log-sum-exp,
which the attention kernel that produces the output already computes. So:

* :func:`attention_with_lse` returns the replay rows' attention output *and* each row's ``lse``
  from one kernel call (on CPU ATen's flash kernel, the one ``scaled_dot_product_attention`` runs
  there; elsewhere SDPA plus a row-blocked log-sum-exp);
* :func:`scores_from_lse` takes ``max over rows of (l - lse + log w)`` over the *cached* columns only
  (the rows' own columns score nothing), in blocks of rows, and one ``exp`` per (head, entry) at the
  end: ``exp`` is monotone, so ``exp(max(.)) = max(exp(.))``. No softmax, no ``(S + r)``-wide mask,
  no ``exp`` over the ``(r, S)`` matrix. KVgrad uses this pair: its backward needs the kernel's
  memory-efficient attention gradient.
* :func:`attend_and_score` (KVzip, no gradient) computes the probabilities once per block of rows
  and takes both the output and the scores from them: ``q · k`` over the cache once instead of twice
  and, block by block, only the own rows up to the block's last (not the masked upper triangle). The
  products and the (fused) softmax run in the replay's dtype, the scale folded into ``q``: with a
  bf16 replay no float32 copy of the ``(r, S + r)`` matrix is made (KVzip's bf16 replay went from
  2.1× to about 1.5× a plain prefill on the 2-core VM).

The result equals the reference up to float rounding (tests/runtime/test_replay.py compares them
at fp32 and checks the kept sets are the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# replay rows per block of the score pass: bounds its scratch to (B, H, ROW_BLOCK, S) floats
ROW_BLOCK = 256


def float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``mask (B, 1, r, S + r)`` bool (True = visible) → additive 0 / -inf of ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention output and each row's log-sum-exp from one kernel call (differentiable in ``out``).

    Args:
        q: ``(B, H, r, D)``; k, v: ``(B, H_kv, S + r, D)``; mask: ``(B, 1, r, S + r)`` bool, every row
            seeing at least one column, or None for causal attention over ``r`` keys
            (row ``i`` sees keys ``<= i``).

    Returns:
        ``out (B, H, r, D)`` in ``q``'s dtype and ``lse (B, H, r)`` float32 (no gradient).
    """
    g = q.shape[1] // k.shape[1]
    if q.device.type == "cpu":
        # the kernel SDPA itself runs on CPU; it returns the row statistics SDPA drops
        ke, ve = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            ke,
            ve,
            is_causal=mask is None,
            attn_mask=None if mask is None else float_mask(mask, q.dtype),
            scale=scale,
        )
        return out, lse.detach().float()
    if mask is None:
        r = q.shape[2]
        mask = torch.ones(r, r, dtype=torch.bool, device=q.device).tril()[None, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g != 1)
    return out, _blocked_lse(q.detach(), k.detach(), mask, scale)


@torch.no_grad()
def attend_and_score(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cache_len: Tensor,
    new_len: Tensor,
    col_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The replay rows' attention output and the cached entries' scores from one pass.

    Per block of ``ROW_BLOCK`` rows: ``q · k`` over the cache and the own rows up to the block's
    last (causal), one softmax, then the output is ``p · v`` and the scores are the max of ``p``'s
    cached columns over the block's valid rows. Each GQA group is one matrix product (its query heads'
    rows stacked), so nothing is broadcast or copied per head.

    Args:
        q: ``(B, H, r, D)``; k, v: ``(B, H_kv, S + r, D)``: ``S`` cached slots (valid below
            ``cache_len (B,)``), then the rows' own (row ``i`` sees own rows ``<= i``).
        new_len: ``(B,)`` valid replay rows (the others are padding and score nothing).
        col_weight: optional ``(B, H, S)`` factor per query head and entry (``||W_O v||``).

    Returns:
        ``out (B, H, r, D)`` in ``q``'s dtype, as SDPA under :func:`~vlkv.runtime.replay._replay_mask`;
        ``scores (B, H_kv, S)`` float32, as :func:`~vlkv.runtime.replay.replay_attention_max`.
    """
    b, h, r, d = q.shape
    hkv, s = k.shape[1], k.shape[2] - r
    g, dev = h // hkv, q.device
    cache_len, new_len = cache_len.to(dev), new_len.to(dev)
    # the products and the softmax run in q's dtype (the replay's: bf16 ones are several times faster
    # on CPUs with bf16 units); the scores' max is taken in float32
    kt = k.transpose(-1, -2).contiguous()  # (B, H_kv, D, S + r)
    qs = (q * scale).view(b, hkv, g, r, d)  # the scale folded into q: one pass over r rows, not r × S
    spare = torch.arange(s, device=dev)[None, :] >= cache_len[:, None]  # (B, S)
    spare = spare[:, None, None, None] if bool(spare.any()) else None
    pad = (torch.arange(r, device=dev)[None, :] >= new_len[:, None])[:, None, None, :, None]  # (B,1,1,r,1)
    best = torch.zeros(b, hkv, g, s, device=dev)
    out = torch.empty(b, hkv, g, r, d, dtype=q.dtype, device=dev)
    for i in range(0, r, ROW_BLOCK):
        e = min(i + ROW_BLOCK, r)
        cols = s + e  # the cache and the own rows up to this block's last
        qb = qs[:, :, :, i:e].reshape(b, hkv, g * (e - i), d)
        logits = torch.matmul(qb, kt[..., :cols]).view(b, hkv, g, e - i, cols)
        if spare is not None:
            logits[..., :s].masked_fill_(spare, float("-inf"))
        ahead = torch.arange(e, device=dev)[None, :] > torch.arange(i, e, device=dev)[:, None]  # (rb, e)
        logits[..., s:].masked_fill_(ahead, float("-inf"))
        p = torch.softmax(logits, dim=-1)  # every row sees itself: never empty
        pv = torch.matmul(p.view(b, hkv, g * (e - i), cols), v[:, :, :cols])
        out[:, :, :, i:e] = pv.view(b, hkv, g, e - i, d)
        cached = p[..., :s]
        rows_pad = pad[:, :, :, i:e]
        if bool(rows_pad.any()):  # padding rows score nothing
            cached = cached.masked_fill(rows_pad, 0.0)
        torch.maximum(best, cached.amax(dim=3).float(), out=best)
    if col_weight is not None:  # constant over rows, so it commutes with the row max
        best = best * col_weight.to(dev, torch.float32).view(b, hkv, g, s)
    if spare is not None:
        best.masked_fill_(spare[:, :, :, 0], 0.0)
    return out.view(b, h, r, d), best.amax(dim=2)


@torch.no_grad()
def _blocked_lse(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``(B, H, r)`` float32 log-sum-exp of the masked logits, ``ROW_BLOCK`` rows at a time."""
    b, h, r, d = q.shape
    hkv = k.shape[1]
    kt = k.float().transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, S + r)
    parts = []
    for i in range(0, r, ROW_BLOCK):
        qb = q[:, :, i : i + ROW_BLOCK].float().view(b, hkv, h // hkv, -1, d)
        logits = torch.matmul(qb, kt).mul_(scale).view(b, h, -1, kt.shape[-1])
        logits.masked_fill_(~mask[:, :, i : i + ROW_BLOCK], float("-inf"))
        parts.append(torch.logsumexp(logits, dim=-1))
    return torch.cat(parts, dim=2)


@torch.no_grad()
def scores_from_lse(
    q: Tensor,
    k_cached: Tensor,
    scale: float,
    lse: Tensor,
    cache_len: Tensor,
    new_len: Tensor,
    row_weight: Tensor | None = None,
    col_weight: Tensor | None = None,
) -> Tensor:
    """Max attention each cached entry receives from the valid replay rows, per KV head, from ``lse``.

    Args:
        q: ``(B, H, r, D)`` replay queries; k_cached: ``(B, H_kv, S, D)`` the cached keys.
        lse: ``(B, H, r)`` float32 each row's log-sum-exp over everything it sees (cache + own rows).
        cache_len: ``(B,)`` valid cached entries; new_len: ``(B,)`` valid replay rows.
        row_weight: optional ``(B, r)`` >= 0 factor per row (KVgrad's gradient norm).
        col_weight: optional ``(B, H, S)`` factor per query head and entry (KVgrad's ``||W_O v||``).

    Returns:
        ``(B, H_kv, S)`` float32, as :func:`~vlkv.runtime.replay.replay_attention_max`; 0 at invalid slots.
    """
    b, h, r, d = q.shape
    hkv, s = k_cached.shape[1], k_cached.shape[2]
    dev = q.device
    cache_len, new_len = cache_len.to(dev), new_len.to(dev)
    # row shift: l - shift = log(p · w); padding rows and zero weights never win the max
    shift = lse.to(dev, torch.float32).clone()
    if row_weight is not None:
        shift -= row_weight.to(dev, torch.float32).log()[:, None, :]
    pad = torch.arange(r, device=dev)[None, :] >= new_len[:, None]  # (B, r)
    shift.masked_fill_(pad[:, None, :], float("inf"))
    shift = shift.view(b, hkv, h // hkv, r, 1)
    kt = k_cached.float().transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, S)
    best = torch.full((b, hkv, h // hkv, s), float("-inf"), device=dev)
    for i in range(0, r, ROW_BLOCK):
        qb = q[:, :, i : i + ROW_BLOCK].float().view(b, hkv, h // hkv, -1, d)
        logits = torch.matmul(qb, kt).mul_(scale).sub_(shift[:, :, :, i : i + ROW_BLOCK])
        torch.maximum(best, logits.amax(dim=3), out=best)
    att = best.exp_()
    if col_weight is not None:  # constant over rows, so it commutes with the row max
        att = att * col_weight.to(dev, torch.float32).view(b, hkv, h // hkv, s)
    out = att.amax(dim=2)
    valid = torch.arange(s, device=dev)[None, None, :] < cache_len[:, None, None]
    # where (not multiply): spare slots past cache_len may hold anything, inf/nan included
    return torch.where(valid, out, torch.zeros((), device=dev))
