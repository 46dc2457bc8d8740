"""Plain-PyTorch reference ops: the ground truth for every Triton kernel, ONNX op and TensorRT plugin.

All three ops share one GQA convention: query head ``h`` reads KV head ``h // (H // Hkv)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttnStats:
    """Attention statistics over a set of query rows (VL-Cache eq. 1-2 and token scores).

    colsum: (B, H, S) float32, sum over the selected query rows of the softmax probabilities, per query head.
    below: (B, H) int64, among visible entries of the selected rows, how many have prob < threshold * row max;
        None when no threshold was given.
    visible: (B, H) int64, number of visible (causal and valid) entries summed over the selected rows.
    """

    colsum: Tensor
    below: Tensor | None
    visible: Tensor


def check_gqa(q: Tensor, k: Tensor) -> int:
    """Return the GQA group size H // Hkv after validating the head counts and head dims."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    return heads // kv_heads


def resolve_lengths(
    batch: int, num_queries: int, num_keys: int, key_lengths: Tensor | None, q_offset: Tensor | None, device
) -> tuple[Tensor, Tensor]:
    """Fill the defaults of ``attn_stats``: key_lengths = S, q_offset = key_lengths - Q.

    Returns (key_lengths, q_offset), both (B,) int64 on ``device``. Shared by the reference and the kernels
    so that both read the same defaults.
    """
    if key_lengths is None:
        key_lengths = torch.full((batch,), num_keys, dtype=torch.int64, device=device)
    else:
        key_lengths = key_lengths.to(device=device, dtype=torch.int64).clamp(0, num_keys)
    if q_offset is None:
        q_offset = key_lengths - num_queries
    else:
        q_offset = q_offset.to(device=device, dtype=torch.int64)
    return key_lengths, q_offset


def attn_stats_reference(
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
    """Column sums and sparsity counts of softmax(q k^T * scale), chunked over query rows.

    q: (B, H, Q, D) post-RoPE queries. k: (B, Hkv, S, D) keys, H % Hkv == 0.
    query_rows: (B, Q) bool, rows to include (None = all).
    key_lengths: (B,) int64, keys j >= key_lengths[b] are padding (None = S).
    q_offset: (B,) int64, cache slot of query row 0 (None = key_lengths - Q: the queries are the last Q keys).
    causal: row i of sample b sees key j iff j <= q_offset[b] + i and j < key_lengths[b]; otherwise every
        valid key. Softmax is float32 over the visible keys; rows with no visible key contribute nothing.
    key_order: optional (B, Hkv, S) int64 sequence index of every key, with query_order (B, Q) int64:
        row i sees key j iff key_order[b, h, j] <= query_order[b, i] (and j < key_lengths[b]), per KV
        head, in place of ``causal`` — a link step's rows are a non-contiguous selection of the prompt.
    At most chunk_rows x S x H scores of one sample exist at once.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    group = check_gqa(q, k)
    batch, heads, num_q, dim = q.shape
    kv_heads, num_k = k.shape[1], k.shape[2]
    device = q.device
    key_lengths, q_offset = resolve_lengths(batch, num_q, num_k, key_lengths, q_offset, device)
    if query_rows is None:
        query_rows = torch.ones(batch, num_q, dtype=torch.bool, device=device)
    query_rows = query_rows.to(device=device, dtype=torch.bool)

    colsum = torch.zeros(batch, kv_heads, group, num_k, dtype=torch.float32, device=device)
    below = torch.zeros(batch, heads, dtype=torch.int64, device=device)
    visible = torch.zeros(batch, dtype=torch.int64, device=device)
    by_order = key_order is not None
    if by_order:
        if query_order is None:
            raise ValueError("key_order needs query_order")
        key_order, query_order = key_order.to(device), query_order.to(device)
        visible = torch.zeros(batch, kv_heads, dtype=torch.int64, device=device)
    key_idx = torch.arange(num_k, device=device)
    for b in range(batch):
        # only the requested rows are computed: a 64-row window of a 2k prompt costs 64 rows, not 2k
        sel = query_rows[b].nonzero().squeeze(1)  # (R,) ascending
        if sel.numel() == 0:
            continue
        klen = int(key_lengths[b])
        kb_t = k[b, :, :klen].float().transpose(-1, -2)  # (Hkv, D, klen)
        for start in range(0, sel.numel(), chunk_rows):
            idx = sel[start : start + chunk_rows]
            rows = idx.numel()
            # keys past the chunk's last causal slot are invisible to all its rows: skip those columns
            hi = klen
            if causal and not by_order:
                hi = max(0, min(klen, int(q_offset[b]) + int(idx[-1]) + 1))
            if hi == 0:
                continue
            if by_order:  # (Hkv, C, hi): per KV head, by sequence order
                vis = key_order[b][:, None, :hi] <= query_order[b, idx][None, :, None]
            elif causal:  # (C, hi)
                vis = key_idx[None, :hi] <= q_offset[b] + idx[:, None]
            else:
                vis = None  # every valid key of every row
            # Fold the G query heads of a KV head into the row dimension: one bmm, no copy of K per head.
            qb = q[b][:, idx].float().reshape(kv_heads, group * rows, dim)
            scores = torch.bmm(qb, kb_t[:, :, :hi]).mul_(scale).view(kv_heads, group, rows, hi)
            hv = None if vis is None else vis[:, None] if by_order else vis  # broadcasts over (Hkv, G, C, hi)
            if hv is not None:
                scores.masked_fill_(~hv, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            # A row with no visible key is all -inf, which softmax turns into NaN; it contributes nothing.
            if hv is not None:
                empty = ~hv.any(dim=-1)
                if bool(empty.any()):
                    probs.masked_fill_(empty[..., None], 0.0)
            colsum[b, :, :, :hi] += probs.sum(dim=-2)
            if by_order:
                visible[b] += vis.sum(dim=(-1, -2))
            else:
                visible[b] += rows * hi if vis is None else vis.sum()
            if threshold is not None:
                cut = threshold * probs.amax(dim=-1, keepdim=True)
                low = probs < cut
                if hv is not None:
                    low &= hv
                below[b] += low.sum(dim=(-1, -2)).reshape(heads)
    visible = visible.repeat_interleave(group, dim=1) if by_order else visible[:, None].expand(batch, heads)
    return AttnStats(
        colsum=colsum.reshape(batch, heads, num_k),
        below=below if threshold is not None else None,
        visible=visible.contiguous(),
    )


def selected_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """Attention of every query row over the selected keys of its KV head (no causal mask).

    q: (B, H, Q, D). k, v: (B, Hkv, S, D).
    indices: (B, Hkv, K) int64 slot indices into S; entries at positions >= lengths are padding (any value).
    lengths: (B, Hkv) int64 number of valid indices.
    Returns (B, H, Q, D) in q's dtype (softmax in float32); a (sample, KV head) with length 0 yields zeros.
    """
    group = check_gqa(q, k)
    batch, heads, num_q, dim = q.shape
    kv_heads, num_sel = k.shape[1], indices.shape[-1]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on (B, Hkv, S)")
    valid = torch.arange(num_sel, device=q.device)[None, None, :] < lengths.to(q.device)[..., None]
    # Padding entries may hold any value, so point them at slot 0 before gathering.
    idx = torch.where(valid, indices.to(q.device), torch.zeros_like(indices, device=q.device))
    k_sel = k.gather(2, idx[..., None].expand(-1, -1, -1, k.shape[-1])).float()  # (B, Hkv, K, D)
    v_sel = v.gather(2, idx[..., None].expand(-1, -1, -1, v.shape[-1])).float()
    qg = q.float().reshape(batch, kv_heads, group * num_q, dim)  # query heads of a KV head as rows
    scores = torch.matmul(qg, k_sel.transpose(-1, -2)).mul_(scale)  # (B, Hkv, G * Q, K)
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # An empty selection is an all -inf row (NaN after softmax); the op defines its output as zeros.
    probs.masked_fill_((lengths.to(q.device) <= 0)[:, :, None, None], 0.0)
    out = torch.matmul(probs, v_sel)  # (B, Hkv, G * Q, Dv)
    return out.reshape(batch, heads, num_q, v.shape[-1]).to(q.dtype)


def merge_kv_reference(k: Tensor, v: Tensor, assign: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Segment mean of K/V rows into target slots.

    k, v: (B, Hkv, S, D). assign: (B, Hkv, S) int64 target slot in [0, S_out) or -1 (drop).
    counts: (B, Hkv, S_out) int64 number of sources per target (S_out = counts.shape[-1]).
    Returns k_out, v_out: (B, Hkv, S_out, D) means accumulated in float32 and cast to k's dtype;
    targets with count 0 are zero.
    """
    if assign.shape != k.shape[:3]:
        raise ValueError(f"assign {tuple(assign.shape)} must be (B, Hkv, S) = {tuple(k.shape[:3])}")
    num_out = counts.shape[-1]
    assign = assign.to(k.device)
    # Dropped sources go to a spare slot S_out that is sliced off afterwards.
    target = torch.where(assign >= 0, assign, torch.full_like(assign, num_out))
    denom = counts.to(device=k.device, dtype=torch.float32)[..., None]
    outs = []
    for x in (k, v):
        acc = torch.zeros(*x.shape[:2], num_out + 1, x.shape[-1], dtype=torch.float32, device=x.device)
        acc.scatter_add_(2, target[..., None].expand(-1, -1, -1, x.shape[-1]), x.float())
        mean = acc[:, :, :num_out] / denom.clamp_min(1.0)
        outs.append(torch.where(denom > 0, mean, torch.zeros_like(mean)).to(k.dtype))
    return outs[0], outs[1]
