"""Plain-PyTorch paged attention: K/V read from one layer's pool through per-request slot tables.

The ground truth for the Triton kernel (``paged_attention_kernels``) and the CPU form (``paged_cpu``).

Layout (the runtime's :class:`~vlkv.runtime.kv.KVPool` and slot tables):
- ``k_pool, v_pool (H_kv, S, D)``: one layer's pool; KV head ``h`` owns slots ``[0, S)`` of row ``h``;
- ``table (B, H_kv, C)`` int64: column ``c`` of request ``b``, head ``h`` is an entry at slot
  ``table[b, h, c]``; columns at or past ``lengths[b, h]`` are padding (any value, never read); a
  *negative* slot inside the length is a hole (that head holds no entry in that column: skipped);
- causality by column: query ``i`` of ``Q`` attends the first ``lengths - Q + i + 1`` columns of its
  row (a decode row attends every column; a prefill chunk's own tokens are the last ``Q`` columns).

GQA: query head ``j`` reads KV head ``j // (H_q // H_kv)``.

Pre-RoPE entries (a shared record linked at the reader's positions) are rotated on read: ``rot (B, H_kv, C)``
int64 names the row of ``cos, sin (R, D_r)`` that rotates an entry's key, ``-1`` for a key stored
post-RoPE (read as is). The rotation is HF's ``apply_rotary_pos_emb`` on the first ``D_r`` dims,
``k·cos + rotate_half(k)·sin`` with ``rotate_half(x) = cat(-x[D_r/2:], x[:D_r/2])``, in float32 and
rounded to the pool's dtype: the key the model would have stored at that position.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_paged_args(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor | None,
    table: Tensor,
    lengths: Tensor,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> tuple[int, bool]:
    """Validate a paged-attention call (the arguments of :func:`paged_attention_reference`; ``v_pool``
    None for a form that reads no values); return the GQA group ``H_q // H_kv`` and whether any key is
    rotated on read (``rot`` given)."""
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H_q, Q, D), got {tuple(q.shape)}")
    if k_pool.dim() != 3 or (
        v_pool is not None and (v_pool.dim() != 3 or k_pool.shape[:2] != v_pool.shape[:2])
    ):
        raise ValueError(
            f"k_pool and v_pool must be (H_kv, S, D) with the same (H_kv, S), got "
            f"{tuple(k_pool.shape)} and {None if v_pool is None else tuple(v_pool.shape)}"
        )
    batch, heads, _, dim = q.shape
    kv_heads = k_pool.shape[0]
    if k_pool.shape[2] != dim:
        raise ValueError(f"q head_dim {dim} != k_pool head_dim {k_pool.shape[2]}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if table.dim() != 3 or tuple(table.shape[:2]) != (batch, kv_heads):
        raise ValueError(f"table must be (B, H_kv, C) = ({batch}, {kv_heads}, C), got {tuple(table.shape)}")
    if tuple(lengths.shape) != (batch, kv_heads):
        raise ValueError(f"lengths must be (B, H_kv) = ({batch}, {kv_heads}), got {tuple(lengths.shape)}")
    if table.dtype not in (torch.int32, torch.int64) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table and lengths must be int32/int64, got {table.dtype} and {lengths.dtype}")
    if rot is None:
        return heads // kv_heads, False
    if rot.shape != table.shape:
        raise ValueError(f"rot must be (B, H_kv, C) = {tuple(table.shape)}, got {tuple(rot.shape)}")
    if cos is None or sin is None or cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError("rot needs cos and sin, both (R, D_r)")
    if cos.shape[-1] % 2 or cos.shape[-1] > dim:
        raise ValueError(f"cos/sin width {cos.shape[-1]} must be even and at most the head dim {dim}")
    return heads // kv_heads, True


def held_columns(table: Tensor, lengths: Tensor) -> Tensor:
    """``(B, H_kv, C)`` bool, on table's device: the columns of ``table (B, H_kv, C)`` a row holds, inside
    its ``lengths (B, H_kv)`` and not a hole."""
    cols = torch.arange(table.shape[-1], device=table.device)
    return (table >= 0) & (cols < lengths.to(table.device)[..., None])


def visible_columns(table: Tensor, lengths: Tensor, num_q: int) -> tuple[Tensor, Tensor]:
    """Which columns each query row sees, and the slot each reads (holes and padding point at 0).

    table: (B, H_kv, C). lengths: (B, H_kv). Returns ``vis (B, H_kv, Q, C)`` bool and
    ``slots (B, H_kv, C)`` int64, both on table's device.
    """
    cols = torch.arange(table.shape[-1], device=table.device)
    lengths = lengths.to(device=table.device, dtype=torch.int64).clamp_min(0)
    held = held_columns(table, lengths)
    slots = torch.where(held, table.long(), torch.zeros((), dtype=torch.long, device=table.device))
    limit = lengths[..., None] - num_q + 1 + torch.arange(num_q, device=table.device)  # (B, H_kv, Q)
    vis = held[:, :, None, :] & (cols < limit[..., None])
    return vis, slots


def rows_of_table(rot: Tensor, cos: Tensor, sin: Tensor, sec: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The row form above from the rotary *table* form the Triton kernels take: ``rot (B, H_kv, C, P)``
    each entry's position components (component 0 ``< 0``: stored post-RoPE), ``cos, sin (T, D_r)`` the
    table by position, ``sec (D_r,)`` int64 the component each dim's angle reads (None: component 0, 1-D
    RoPE). Returns ``rot (B, H_kv, C)`` one row per entry (``-1`` where not rotated) and ``cos, sin
    (B·H_kv·C, D_r)`` its values: a row for every column, so for the paths that have no table form (the
    reference, the CPU read), not for long contexts on a GPU."""
    b, h, c, p = rot.shape
    flat = rot.reshape(-1, p).clamp(0, cos.shape[0] - 1)
    dims = torch.arange(cos.shape[1], device=rot.device)
    comp = torch.zeros_like(dims) if sec is None else sec.to(rot.device)
    at = flat[:, comp]  # (N, D_r) the position each dim's angle reads
    rows = torch.where(rot[..., 0] >= 0, torch.arange(b * h * c, device=rot.device).view(b, h, c), -1)
    return rows, cos[at, dims], sin[at, dims]


def rotate_keys(k: Tensor, rot: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the keys ``k (..., n, D)`` whose ``rot (..., n)`` row is >= 0 by ``cos, sin (R, D_r)``;
    returns ``k`` in its dtype (rotated rows computed in at least float32, then rounded)."""
    dr = cos.shape[-1]
    if dr % 2 or dr > k.shape[-1]:
        raise ValueError(f"cos/sin width {dr} must be even and at most the head dim {k.shape[-1]}")
    on = rot >= 0
    idx = rot.clamp_min(0)
    wide = torch.promote_types(k.dtype, torch.float32)  # at least float32
    c, s = cos[idx].to(wide), sin[idx].to(wide)  # (..., n, D_r): the rows first, a table may be long
    x = k[..., :dr].to(wide)
    half = torch.cat([-x[..., dr // 2 :], x[..., : dr // 2]], dim=-1)
    rotated = torch.cat([(x * c + half * s).to(k.dtype), k[..., dr:]], dim=-1)
    return torch.where(on[..., None], rotated, k)


def paged_attention_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    rot: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
) -> Tensor:
    """Causal attention of every query row over its request's entries, read through the slot table.

    The arguments every form of this op takes (``ops.paged_attention``, ``paged_cpu``, the Triton launcher
    and ``paged_probs`` say "same arguments as paged_attention_reference" and add their own):

    - q: (B, H_q, Q, D), a float dtype; H_q a multiple of H_kv (GQA: query head j reads KV head j // G).
    - k_pool: (H_kv, S, D), v_pool: (H_kv, S, D_v): one layer's pool, any strides.
    - table: (B, H_kv, C) int32/int64 slots; columns at or past a row's length are padding (never read),
      a negative slot inside it is a hole (skipped).
    - lengths: (B, H_kv) int32/int64: query i attends its row's first ``lengths - Q + i + 1`` columns.
    - scale: float multiplying ``q·k``.
    - rot: None or (B, H_kv, C) int64 rows of ``cos, sin (R, D_r)`` (D_r even, at most D) rotating
      pre-RoPE keys on read, -1 for a key stored post-RoPE (see the module docstring).

    Returns (B, H_q, Q, D_v) in q's dtype; scores, softmax and the weighted sum in float32. A query row
    that sees no entry (length 0, all holes) yields zeros.
    """
    _, rope = check_paged_args(q, k_pool, v_pool, table, lengths, rot, cos, sin)
    num_q = q.shape[2]
    kv_heads = k_pool.shape[0]
    table = table.to(q.device)
    vis, slots = visible_columns(table, lengths.to(q.device), num_q)
    rows = torch.arange(kv_heads, device=q.device)[None, :, None]
    k = k_pool[rows, slots]  # (B, H_kv, C, D): the gather this op exists to avoid
    if rope:  # padding and holes may name any row: only held entries rotate
        rot = torch.where(held_columns(table, lengths), rot.to(q.device), -1)
        k = rotate_keys(k, rot, cos.to(q.device), sin.to(q.device))
    return attend_gathered(q, k, v_pool[rows, slots], vis, scale)


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, scale: float) -> Tensor:
    """The attention of the references once the entries are gathered: ``q (B, H_q, Q, D)`` over
    ``k (B, H_kv, C, D)``, ``v (B, H_kv, C, D_v)`` where ``vis (B, H_kv, Q, C)`` (query head j reads KV
    head j // G). Scores, softmax and the weighted sum in float32; a row that sees nothing yields zeros.
    Returns (B, H_q, Q, D_v) in q's dtype."""
    batch, heads, num_q, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.float().reshape(batch, kv_heads, group * num_q, dim)  # row r: head r // Q, query r % Q
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # (B, H_kv, G·Q, C)
    vis_rows = vis.repeat(1, 1, group, 1)  # (B, H_kv, G·Q, C), the same query order as qg
    scores.masked_fill_(~vis_rows, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # a row that sees nothing is all -inf (NaN after softmax): the op defines its output as zeros
    probs = probs.masked_fill(~vis_rows.any(-1, keepdim=True), 0.0)
    out = torch.matmul(probs, v.float())  # (B, H_kv, G·Q, D_v)
    return out.reshape(batch, heads, num_q, v.shape[-1]).to(q.dtype)
