"""A paged decode step in two halves, for steps that also want their attention probabilities (statistics).

``paged_decode_probs`` gives one decode row's softmax per request and query head over its table row's
columns; ``paged_decode_out`` multiplies them by the values read through the same table. Both read a
request of at least ``inplace_min`` entries whose heads hold one ascending run of slots in place (a pool
view) and gather every other request into one padded copy (only K for the first half, only V for the
second), as ``paged_cpu`` does. Plain PyTorch: the same code runs on any device.

Arguments as ``paged_reference.paged_attention_reference`` (one query row: q (B, H_q, 1, D)); GQA:
G = H_q // H_kv query heads per KV head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins.paged_cpu import INPLACE_MIN, _gather, shared_runs
from vlkv.plugins.paged_reference import check_paged_args, held_columns, rotate_keys


def _route(table: Tensor, host: list[list[int]], inplace_min: int, rot: Tensor | None):
    """``({request: first slot}, [requests gathered together])``: requests of one shared run of at
    least ``inplace_min`` entries (no pre-RoPE key) are read in place; empty requests in neither."""
    inplace, together = {}, []
    for b, lens in enumerate(host):
        n = max(lens)
        if n == 0:
            continue
        if n >= inplace_min and min(lens) == n and not (rot is not None and bool((rot[b, :, :n] >= 0).any())):
            runs = shared_runs(table[b, :, :n])
            if runs is not None and len(runs) == 1:
                inplace[b] = runs[0][2]
                continue
        together.append(b)
    return inplace, together


def _gathered(pool: Tensor, table: Tensor, held: Tensor, idx: Tensor) -> Tensor:
    """``(R, H_kv, C, D)`` rows of ``pool`` for requests ``idx`` (slot 0 where not held)."""
    kv_heads, cap, dim = pool.shape
    heads_off = torch.arange(kv_heads, device=table.device)[None, :, None] * cap
    flat = (torch.where(held[idx], table[idx], 0) + heads_off).reshape(-1)
    return _gather(pool, flat).view(idx.numel(), kv_heads, table.shape[2], dim)


def paged_decode_probs(
    q: Tensor,
    k_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    inplace_min: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One decode row per request (same arguments as ``paged_reference.paged_attention_reference``, no
    v_pool): ``probs (B, H_kv, G, C)`` float32, the softmax of ``q·k · scale`` over the held columns of its
    row (0 elsewhere; a row holding nothing is all 0), and ``vis (B, H_kv, 1, C)`` bool of the held
    columns, or None when every column of every row is held."""
    group, rope = check_paged_args(q, k_pool, None, table, lengths, rot, cos, sin)
    batch, _, num_q, dim = q.shape
    if num_q != 1:
        raise ValueError(f"paged_decode_probs takes one query row per request, got {num_q}")
    kv_heads, cols = k_pool.shape[0], table.shape[2]
    lengths = lengths.clamp(0, cols)
    held = held_columns(table, lengths)  # (B, H_kv, C)
    vis = None if bool(held.all()) else held[:, :, None, :]
    qg = q.reshape(batch, kv_heads, group, dim).float()
    scores = torch.full((batch, kv_heads, group, cols), float("-inf"), device=q.device)
    inplace, together = _route(
        table, lengths.tolist(), INPLACE_MIN if inplace_min is None else inplace_min, rot
    )
    for b, start in inplace.items():
        n = int(lengths[b, 0])
        k = k_pool[:, start : start + n]
        k = k if k.dtype == torch.float32 else k.float()
        scores[b, :, :, :n] = torch.matmul(k, qg[b].transpose(-1, -2)).transpose(-1, -2)  # K @ q^T: in place
    if together:
        idx = torch.tensor(together, device=q.device)
        k = _gathered(k_pool, table, held, idx)
        if rope:
            k = rotate_keys(k, torch.where(held[idx], rot[idx], -1), cos, sin)
        scores[idx] = torch.matmul(qg[idx], k.float().transpose(-1, -2))
    scores.mul_(scale)
    if vis is not None:
        scores.masked_fill_(~vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    empty = ~held.any(-1)  # (B, H_kv): softmax of an all -inf row is NaN; the row is defined as 0
    if bool(empty.any()):
        probs.masked_fill_(empty[..., None, None], 0.0)
    return probs, vis


def paged_decode_out(
    probs: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, inplace_min: int | None = None
) -> Tensor:
    """``probs (B, H_kv, G, C)`` times the values read through the table → ``(B, H_kv, G, D_v)`` in the
    pool's dtype (the probabilities go to that dtype first, as a fused attention kernel feeds P·V)."""
    batch, kv_heads, group, cols = probs.shape
    lengths = lengths.clamp(0, cols)
    out = torch.zeros(batch, kv_heads, group, v_pool.shape[-1], dtype=v_pool.dtype, device=probs.device)
    held = held_columns(table, lengths)
    p = probs.to(v_pool.dtype)
    inplace, together = _route(
        table, lengths.tolist(), INPLACE_MIN if inplace_min is None else inplace_min, None
    )
    for b, start in inplace.items():
        n = int(lengths[b, 0])
        out[b] = torch.matmul(p[b, :, :, :n], v_pool[:, start : start + n])
    if together:
        idx = torch.tensor(together, device=probs.device)
        out[idx] = torch.matmul(p[idx], _gathered(v_pool, table, held, idx))
    return out
