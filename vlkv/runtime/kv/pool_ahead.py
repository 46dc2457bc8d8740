"""A fixed pool's allocation over every layer at once: the mixin :class:`~vlkv.runtime.kv.pool.KVPool`
takes its ``alloc_ahead`` / ``settle`` from.

A decode step allocates the same count of fresh slots in every layer, one layer after another (each
layer's reservation, ``kv/reservation.py``): per layer a slice of the free stack, a flip, a count and
two scatters. A fixed pool never resizes, so its layers' free stacks, refcounts and pre-RoPE flags are
views of one ``(L, H_kv, S)`` tensor each (``KVPool._stacked``), and the first layer's allocation can
take the same count in every layer with the same few ops; the later layers' are then handed out with
none. The static decode step's host half arms it (``runtime/static_step.prepare``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class AheadAlloc:
    """``alloc_ahead`` / ``settle`` over the pool's ``_stacked``, ``_free``, ``_refs``, ``_prerope``,
    ``_nfree`` / ``_nfree_host`` and ``_pending`` / ``_armed`` (``KVPool.alloc`` serves ``_pending``)."""

    _stacked: tuple[Tensor, Tensor, Tensor] | None
    _pending: dict[int, Tensor]
    _armed: bool

    def alloc_ahead(self) -> None:
        """A step about to allocate the same count in every layer: the next :meth:`alloc` (of ``n > 0``)
        takes ``n`` fresh slots in every layer at once, where the pool is fixed and every layer and head
        as deep; each layer's next ``alloc(layer, n)`` then hands out its ``(H_kv, n)``, the slots it
        would have chosen, with no op. Until :meth:`settle` only alloc / unalloc may run."""
        self._armed = self._stacked is not None and not self._pending

    def _take_all(self, n: int) -> bool:
        """``n`` slots per head of every layer into ``_pending`` (False: the layers differ in depth or
        hold fewer, nothing taken)."""
        depth = self._nfree_host[0][0]
        if depth < n or any(f != depth for per in self._nfree_host for f in per):
            return False
        free, refs, flags = self._stacked
        ids = free[:, :, depth - n : depth].flip(2)  # (L, H_kv, n): the top of every stack first
        refs.scatter_(2, ids, 1)
        flags.scatter_(2, ids, False)
        layers, h = ids.shape[:2]
        tops = torch.full((layers, h), depth - n, dtype=torch.long, device=self.spec.device)
        self._nfree = list(tops.unbind(0))
        self._nfree_host = [[depth - n] * h for _ in range(layers)]
        self._pending = dict(enumerate(ids.unbind(0)))
        return True

    def settle(self) -> None:
        """Disarm :meth:`alloc_ahead`; take back the slots it took that no :meth:`alloc` handed out."""
        self._armed = False
        pending, self._pending = self._pending, {}
        for layer, ids in pending.items():
            self.unalloc(layer, ids)
