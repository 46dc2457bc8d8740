"""Dispatching ops: the Triton kernel where it can run, the PyTorch reference elsewhere.

The kernel runs when the tensors are on CUDA and triton is importable, or when ``VLKV_FORCE_TRITON=1``
(together with ``TRITON_INTERPRET=1`` this runs the kernels on CPU tensors, which is how the tests reach them).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from vlkv.plugins.reference import (
    AttnStats,
    attn_stats_reference,
    check_gqa,
    merge_kv_reference,
    selected_attention_reference,
)

FORCE_TRITON_ENV = "VLKV_FORCE_TRITON"


def triton_available() -> bool:
    """True when ``import triton`` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(*tensors: Tensor) -> bool:
    """Whether the ops below should launch the Triton kernel for these tensors."""
    if os.environ.get(FORCE_TRITON_ENV) == "1":
        if not triton_available():
            raise RuntimeError(
                f"{FORCE_TRITON_ENV}=1 but triton is not installed: pip install 'vlkv[triton]'"
            )
        return True
    return all(t.is_cuda for t in tensors) and triton_available()


def attn_stats(
    q: Tensor,
    k: Tensor,
    scale: float,
    query_rows: Tensor | None = None,
    causal: bool = True,
    threshold: float | None = None,
    key_lengths: Tensor | None = None,
    q_offset: Tensor | None = None,
    chunk_rows: int = 256,
    key_order: Tensor | None = None,
    query_order: Tensor | None = None,
) -> AttnStats:
    """Attention statistics; shapes and semantics as in ``reference.attn_stats_reference``.

    q: (B, H, Q, D). k: (B, Hkv, S, D). query_rows: (B, Q) bool. key_lengths, q_offset: (B,) int64.
    key_order (B, Hkv, S) / query_order (B, Q): masking by sequence order (a link step); the Triton
    kernel has no such mask yet, so those calls take the reference on every device.
    """
    if key_order is not None:
        return attn_stats_reference(
            q,
            k,
            scale,
            query_rows,
            causal,
            threshold,
            key_lengths,
            q_offset,
            chunk_rows,
            key_order,
            query_order,
        )
    if use_triton(q, k):
        from vlkv.plugins.triton_attn_stats import attn_stats_triton

        return attn_stats_triton(q, k, scale, query_rows, causal, threshold, key_lengths, q_offset)
    return attn_stats_reference(q, k, scale, query_rows, causal, threshold, key_lengths, q_offset, chunk_rows)


def selected_row_stats(
    q: Tensor,
    k_sel: Tensor,
    lengths: Tensor,
    scale: float,
    query_rows: Tensor | None = None,
    threshold: float | None = None,
) -> AttnStats:
    """Statistics of one decode row over each KV head's selected keys (A-VL's core step), on any device
    and without reading anything back: one softmax per (request, head) over its first ``lengths[b, h]``
    keys, as ``attn_stats_reference`` gives them with ``causal=False`` and those key lengths (one call
    per KV head when the heads' lengths differ), but in a few batched ops where the reference loops
    over the requests and reads each one's length (a host sync per request and layer).

    q: (B, H, 1, D). k_sel: (B, H_kv, K, D) the selected keys. lengths: (B, H_kv) int64 valid keys of
    each head (<= K). query_rows: (B, 1) bool, the requests whose row counts (None: all). Returns
    :class:`AttnStats` over the K selected columns (``colsum (B, H, K)``; a head with no key is all 0).
    """
    group = check_gqa(q, k_sel)
    batch, heads, num_q, dim = q.shape
    if num_q != 1:
        raise ValueError(f"selected_row_stats takes one query row per request, got {num_q}")
    kv_heads, width = k_sel.shape[1], k_sel.shape[2]
    qg = q.reshape(batch, kv_heads, group, dim).float()
    scores = torch.matmul(qg, k_sel.float().transpose(-1, -2)).mul_(scale)  # (B, H_kv, G, K)
    lengths = lengths.to(q.device)
    vis = (torch.arange(width, device=q.device) < lengths[..., None])[:, :, None, :]  # (B, H_kv, 1, K)
    probs = torch.softmax(scores.masked_fill_(~vis, float("-inf")), dim=-1).masked_fill_(~vis, 0.0)
    on = None if query_rows is None else query_rows.reshape(batch).to(device=q.device, dtype=torch.bool)
    colsum = probs.reshape(batch, heads, width)
    visible = lengths.repeat_interleave(group, dim=1)  # (B, H)
    below = None
    if threshold is not None:
        low = (probs < threshold * probs.amax(-1, keepdim=True)) & vis
        below = low.sum(-1).reshape(batch, heads)
    if on is not None:
        colsum = colsum * on[:, None, None]
        visible = visible * on[:, None]
        below = None if below is None else below * on[:, None]
    return AttnStats(colsum=colsum, below=below, visible=visible)


def selected_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """Attention over selected K/V rows; see ``reference.selected_attention_reference``.

    q: (B, H, Q, D). k, v: (B, Hkv, S, D). indices: (B, Hkv, K) int64. lengths: (B, Hkv) int64.
    Returns (B, H, Q, D) in q's dtype.
    """
    if use_triton(q, k, v):
        from vlkv.plugins.triton_selected_attention import selected_attention_triton

        return selected_attention_triton(q, k, v, indices, lengths, scale)
    return selected_attention_reference(q, k, v, indices, lengths, scale)


def merge_kv(k: Tensor, v: Tensor, assign: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Segment mean of K/V rows; see ``reference.merge_kv_reference``.

    k, v: (B, Hkv, S, D). assign: (B, Hkv, S) int64. counts: (B, Hkv, S_out) int64.
    Returns k_out, v_out: (B, Hkv, S_out, D) in k's dtype.
    """
    if use_triton(k, v):
        from vlkv.plugins.triton_merge_kv import merge_kv_triton

        return merge_kv_triton(k, v, assign, counts)
    return merge_kv_reference(k, v, assign, counts)


def lowrank_attention(
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
    """One decode row attending to post-RoPE low-rank factors plus dense entries (AttentionPack path (b));
    see ``lowrank_reference.lowrank_decode_attention``.

    q: (B, H, D). kbar: (B, T, R_k), dk: (B, R_k, H_kv·D), vbar: (B, T, R_v), dv: (B, R_v, H_kv·D).
    rows, dense_len: (B,) int64. k, v: (B, H_kv, S, D). Returns (B, H, D) in q's dtype.
    """
    if use_triton(q, kbar, dk, vbar, dv, k, v):
        from vlkv.plugins.triton_lowrank_attention import lowrank_attention_triton

        return lowrank_attention_triton(q, kbar, dk, vbar, dv, rows, k, v, dense_len, scale)
    from vlkv.plugins.lowrank_reference import lowrank_decode_attention

    return lowrank_decode_attention(q, kbar, dk, vbar, dv, rows, k, v, dense_len, scale)


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    num_splits: int | None = None,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    plan=None,
    sec: Tensor | None = None,
) -> Tensor:
    """Causal attention reading K/V from one layer's pool through per-request, per-KV-head slot tables:
    same arguments and result as ``paged_reference.paged_attention_reference``, plus ``num_splits``,
    and ``sec``: given, ``rot (B, H_kv, C, P)`` / ``cos, sin (T, D_r)`` are the rotary table form
    (``paged_reference.rows_of_table``), which the Triton kernel reads as is and the other paths turn into
    rows.

    CUDA (or ``VLKV_FORCE_TRITON=1``): the Triton kernel (``num_splits`` column splits, None = from the
    launch size); CPU: ``paged_cpu`` (in-place runs, else one gather; ``plan``: a
    ``paged_cpu.PagedCpuPlan`` of these tables, reused across layers); elsewhere the reference.
    """
    if use_triton(q, k_pool, v_pool):
        from vlkv.plugins.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_pool, v_pool, table, lengths, scale, num_splits, rot, cos, sin, sec
        )
    if sec is not None:
        from vlkv.plugins.paged_reference import rows_of_table

        rot, cos, sin = rows_of_table(rot, cos, sin, sec)
    if q.device.type == "cpu":
        from vlkv.plugins.paged_cpu import paged_attention_cpu

        return paged_attention_cpu(
            q, k_pool, v_pool, table, lengths, scale, rot=rot, cos=cos, sin=sin, plan=plan
        )
    from vlkv.plugins.paged_reference import paged_attention_reference

    return paged_attention_reference(q, k_pool, v_pool, table, lengths, scale, rot, cos, sin)
