"""The model's rotary as a table by position: what the static decode step (``runtime/static_step.py``) and
the eager paged read (``kv/paged.rope_by_position``) rotate linked (pre-RoPE) keys by, and what the paged
low-rank read (``kv/paged_factors``) rotates factored keys by.

One ``cos/sin`` row per rotated entry (the eager read's form until session 18) needs the entries found by
a boolean mask and the table sized by the largest position: reads back (3 host syncs a layer), and a
count ``R`` that changes with evictions, so it fits neither a step whose shapes are fixed nor one whose
device half reads nothing back. Here the rows come from a table by position, built once per model, dtype and device: ``cos, sin (T,
D_r)`` the model's own rotary at positions ``0 … T-1`` (the same values the eager step's rows hold: the
rotary computes each angle as ``position · inv_freq`` elementwise). The append kernel writes, beside the
read table, each pre-RoPE column's positions (``rot (B, H_kv, C, P)``, ``-1`` elsewhere); the paged read
loads a key's rows of the table as it rotates it. 1-D RoPE reads row ``rot[..., 0]``; M-RoPE (Qwen2-VL:
temporal, height and width sections) reads, per dim ``d``, row ``rot[..., sec[d]]``, ``sec (D_r,)`` the
component each dim's angle comes from (found from the model's rotary, not assumed).

``T``: the larger of the model's ``max_position_embeddings`` and the pool's slots per layer (at most
``MAX_ROWS``; at least ``MIN_ROWS``), rounded up to a power of two. Linked entries are prompt tokens (a
record linked at the reader's positions) and a prompt is held whole in the pool when it is prefilled, so
a linked entry's position (1-D: its index in the prompt; M-RoPE's components are at most that) is below
the pool's slot count: the table covers every position a linked entry can have in a pool of up to
``MAX_ROWS`` slots a layer. A position past the table would read its last row (``rope_on_load`` clamps:
no read outside the table; the host half has no positions on the host to check). A pool that grows past
the table gets a larger one (new buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# the smallest table (rows): a model without max_position_embeddings still covers a long prompt
MIN_ROWS = 4096
# the most rows a pool's size asks for (2^18: 128 MB of bf16 cos and sin at D = 128)
MAX_ROWS = 1 << 18


@dataclass(frozen=True)
class RopeTable:
    """Attributes:
    cos, sin: ``(T, D_r)`` the model's rotary rows at positions ``0 … T-1``, in the pool's dtype.
    sec: ``(D_r,)`` int64 the position component each dim's angle reads (M-RoPE), or None (1-D RoPE:
        component 0 everywhere).
    """

    cos: Tensor
    sin: Tensor
    sec: Tensor | None

    def __post_init__(self) -> None:
        if self.cos.dim() != 2 or self.cos.shape != self.sin.shape or self.cos.shape[-1] % 2:
            raise ValueError(
                f"RopeTable: cos/sin must be (T, D_r) with D_r even, got {tuple(self.cos.shape)}"
            )
        if self.sec is not None and (self.sec.shape != (self.cos.shape[1],) or self.sec.dtype != torch.long):
            raise ValueError(
                f"RopeTable.sec: must be int64 ({self.cos.shape[1]},), got {tuple(self.sec.shape)}"
            )

    @property
    def rows(self) -> int:
        """``T``."""
        return self.cos.shape[0]


def table_rows(adapter, slots: int = 0) -> int:
    """``T`` for a model over a pool of ``slots`` slots a layer (see the module docstring)."""
    cfg = getattr(getattr(adapter, "lm", None), "config", None)
    top = max(int(getattr(cfg, "max_position_embeddings", 0) or 0), min(slots, MAX_ROWS), MIN_ROWS)
    return 1 << (top - 1).bit_length()


@torch.no_grad()
def rope_table(adapter, pos_dims: int, head_dim: int, dtype: torch.dtype, device, rows: int) -> RopeTable:
    """The model's :class:`RopeTable` of ``rows`` positions: ``adapter.rotary`` (``FamilyAdapter``: cos/sin
    for ``(B, n, P)`` positions) at every component equal to the row's position, then, with ``P > 1``,
    one probe row per component (that component 1, the others 0: ``sin`` is nonzero exactly at the dims
    whose angle reads it) for ``sec``."""
    pos = torch.arange(rows, device=device)[None, :, None].expand(1, rows, pos_dims)
    cos, sin = adapter.rotary(torch.zeros(1, rows, head_dim, dtype=dtype, device=device), pos)
    sec = None
    if pos_dims > 1:
        probe = torch.eye(pos_dims, dtype=torch.long, device=device)[None]  # (1, P, P)
        _, s = adapter.rotary(torch.zeros(1, pos_dims, head_dim, dtype=torch.float32, device=device), probe)
        hit = s[0] != 0  # (P, D_r)
        if not bool((hit.sum(0) == 1).all()):
            raise ValueError("the model's rotary: some dim's angle reads no single position component")
        sec = hit.to(torch.long).argmax(0)
    return RopeTable(cos[0].contiguous(), sin[0].contiguous(), sec)


def table_as_rows(rot: Tensor, table: RopeTable) -> tuple[Tensor, Tensor, Tensor]:
    """The eager read's form of a table read (a reference for tests): ``rot (B, H_kv, C, P)`` positions
    (component 0 < 0: post-RoPE) → ``rot (B, H_kv, C)`` int64 one row per entry (``-1`` where not
    rotated) and ``cos, sin (B·H_kv·C, D_r)`` that row's values, dim ``d`` from component ``sec[d]``
    (``paged_reference.rows_of_table``)."""
    from vlkv.plugins.paged_reference import rows_of_table

    return rows_of_table(rot, table.cos, table.sin, table.sec)
