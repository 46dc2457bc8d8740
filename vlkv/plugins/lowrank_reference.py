"""Path (b) of AttentionPack: one decode query attends in the rank space of post-RoPE factors.

With post-RoPE keys ``K ≈ K̄·D_k`` and values ``V ≈ V̄·D_v`` (heads concatenated in the columns of
``D``), the factored part of attention never materialises K or V:
``scores = (q·D_kᵀ)·K̄ᵀ`` costs ``T·R + R·D`` per head instead of ``T·D``, and
``out = (p·V̄)·D_v`` likewise. The dense entries (text) join the same softmax. This is the plain
PyTorch reference a fused kernel is checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lowrank_decode_attention(
    q: Tensor,
    kbar: Tensor,
    dk: Tensor,
    vbar: Tensor,
    dv: Tensor,
    rows: Tensor,
    k: Tensor,
    v: Tensor,
    dense_len: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Attention of one query row per sample over factored rows plus dense entries.

    Args:
        q: ``(B, H, D)`` queries (post-RoPE), ``H`` a multiple of ``H_kv``.
        kbar: ``(B, T, R_k)`` post-RoPE key factors (rows past ``rows[b]`` are padding).
        dk: ``(B, R_k, H_kv·D)`` key bases. vbar: ``(B, T, R_v)``. dv: ``(B, R_v, H_kv·D)``.
        rows: ``(B,)`` int64 valid factored rows.
        k, v: ``(B, H_kv, S, D)`` dense entries; dense_len: ``(B,)`` int64 valid ones.
        scale: softmax scale (default ``D ** -0.5``).

    Returns:
        ``(B, H, D)`` attention output in ``q``'s dtype (computed in fp32); zeros for a sample with no
        visible row.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.float().view(b, hkv, g, d)
    # (B, H_kv, g, R): the query projected onto each KV head's slice of the key basis
    qd = torch.einsum("bjgd,brjd->bjgr", qf, dk.float().view(b, -1, hkv, d))
    s_lr = torch.einsum("bjgr,btr->bjgt", qd, kbar.float()) * scale
    s_dn = torch.einsum("bjgd,bjsd->bjgs", qf, k.float()) * scale
    t, s = kbar.shape[1], k.shape[2]
    s_lr = s_lr.masked_fill(~(torch.arange(t, device=q.device) < rows[:, None])[:, None, None], float("-inf"))
    s_dn = s_dn.masked_fill(
        ~(torch.arange(s, device=q.device) < dense_len[:, None])[:, None, None], float("-inf")
    )
    # a sample with nothing visible has an all -inf row: zeros, not NaN (the kernel's definition too)
    p = torch.softmax(torch.cat([s_lr, s_dn], -1), -1).nan_to_num(0.0)
    p_lr, p_dn = p[..., :t], p[..., t:]
    pv = torch.einsum("bjgt,btr->bjgr", p_lr, vbar.float())  # (B, H_kv, g, R_v)
    out = torch.einsum("bjgr,brjd->bjgd", pv, dv.float().view(b, -1, hkv, d))
    out = out + torch.einsum("bjgs,bjsd->bjgd", p_dn, v.float())
    return out.reshape(b, h, d).to(q.dtype)
