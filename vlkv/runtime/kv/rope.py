"""Rotary embedding on read: turn pre-RoPE keys into the keys a model would compute at given positions.

Where RoPE is applied (the decision, measured in docs/architecture.md): a request's own (private)
entries are stored *post*-RoPE, exactly what attention reads, so the common path pays nothing;
shared entries (a stored record linked into several requests at different positions) are stored
*pre*-RoPE, once, and rotated on every read to the positions the reading request gives them.

:class:`Rope` uses the model's own pieces — its rotary module for ``cos``/``sin`` (so rope scaling,
and Qwen2-VL's M-RoPE sections, are whatever the model does) and the ``apply_rotary_pos_emb`` of the
attention module's own file (so partial rotary is too) — rather than a re-implementation. Inverse
rotation (``sin → -sin``) recovers pre-RoPE keys from the post-RoPE keys a step produced.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from vlkv.runtime.kv.rope_table import RopeTable, rope_table, table_rows


class Rope:
    """Rotate keys with a model's rotary embedding.

    Args:
        adapter: a :class:`~vlkv.runtime.models.adapter.FamilyAdapter` (``rotary`` and ``layers``).
    """

    def __init__(self, adapter):
        self.adapter = adapter
        attn = adapter.layers[0].self_attn
        module = sys.modules[type(attn).__module__]
        if not hasattr(module, "apply_rotary_pos_emb"):
            raise ValueError(
                f"{type(attn).__name__}: its module has no apply_rotary_pos_emb to rotate stored keys"
            )
        self._apply = module.apply_rotary_pos_emb
        self._table: tuple[Tensor, Tensor] | None = None  # 1-D RoPE: cos/sin rows by position
        self._tables: dict[tuple, RopeTable] = {}  # (P, D, dtype, device) → table(): rows by position

    def cos_sin(self, like: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(N, n, D)`` cos/sin for ``positions (N, n, P)`` int64 (``P`` 1, or M-RoPE's sections), on
        ``like``'s device with its head dim ``D`` (last dim): the rows :meth:`__call__` rotates by, and
        what a paged read's pre-RoPE ``cos/sin`` arguments are built from (``kv/paged.py``).

        1-D RoPE reads rows of a table the model's rotary module filled once (grown by doubling),
        so a read costs a gather, not a recomputation; M-RoPE asks the module every time."""
        if positions.shape[-1] != 1:
            return self.adapter.rotary(like.new_zeros(*positions.shape[:2], like.shape[-1]), positions)
        top = int(positions.max()) + 1 if positions.numel() else 1
        if self._table is None or self._table[0].shape[0] < top or self._table[0].device != like.device:
            size = max(1024, 1 << (top - 1).bit_length())
            pos = torch.arange(size, device=like.device)[None, :, None]
            cos, sin = self.adapter.rotary(like.new_zeros(1, size, like.shape[-1]), pos)
            self._table = (cos[0], sin[0])
        idx = positions[..., 0]
        return self._table[0][idx], self._table[1][idx]

    def table(self, like: Tensor, pos_dims: int, slots: int) -> RopeTable:
        """The model's :class:`~vlkv.runtime.kv.rope_table.RopeTable` (rows by position; M-RoPE's ``sec``)
        in ``like``'s dtype, device and head dim, covering a pool of ``slots`` slots a layer: built once
        (again, larger, for a grown pool), so a read takes rows by position with no read back of the
        positions (what :meth:`cos_sin`'s 1-D table needs to size itself)."""
        key = (pos_dims, like.shape[-1], like.dtype, str(like.device))
        rows = table_rows(self.adapter, slots)
        got = self._tables.get(key)
        if got is None or got.rows < rows:
            got = rope_table(self.adapter, pos_dims, like.shape[-1], like.dtype, like.device, rows)
            self._tables[key] = got
        return got

    def __call__(self, k: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """Rotate ``k (B, H_kv, n, D)`` to ``positions (B, H_kv, n, P)`` (per head); ``inverse`` undoes it."""
        b, h, n, d = k.shape
        flat = k.reshape(b * h, 1, n, d)
        cos, sin = self.cos_sin(flat, positions.reshape(b * h, n, -1))
        if inverse:
            sin = -sin
        _, rotated = self._apply(flat, flat, cos.to(k.dtype), sin.to(k.dtype))
        return rotated.reshape(b, h, n, d)
