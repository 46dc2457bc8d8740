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

from torch import Tensor


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

    def __call__(self, k: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """Rotate ``k (B, H_kv, n, D)`` to ``positions (B, H_kv, n, P)`` (per head); ``inverse`` undoes it."""
        b, h, n, d = k.shape
        flat = k.reshape(b * h, 1, n, d)
        cos, sin = self.adapter.rotary(flat.new_zeros(b * h, n, d), positions.reshape(b * h, n, -1))
        if inverse:
            sin = -sin
        _, rotated = self._apply(flat, flat, cos.to(k.dtype), sin.to(k.dtype))
        return rotated.reshape(b, h, n, d)
