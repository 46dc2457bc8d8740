"""Spare slots: pool slots a layer's cache holds, unused, for the appends it is about to make.

Two kinds, both written by the coming decode appends instead of fresh allocations:

* a one-sample cache on a growable pool may take its prompt and ``run_reserve`` more slots as one
  run (``ids (H_kv, m)``): its decode appends continue the run, so the request's entries stay one
  ascending run of slots, which the paged CPU read attends in place (``vlkv.plugins.paged_cpu``); a
  decode eviction's few dropped slots join them;
* a batch cache's decode-time evictions drop a few slots per sample and head and the next steps append
  as many: the dropped ones are held (``recycled (H_kv, B, m)``) and written next, one reference check
  in place of the pool's free-stack bookkeeping, twice.

Neither is part of a cache's ``kv_bytes``; both are counted by its ``spare_bytes`` and go back to the
pool on release. Reading any property here changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.kv.pool import KVPool


class SpareSlots:
    """The held, unused slots of one layer's cache (see the module docstring)."""

    def __init__(self) -> None:
        self._run: Tensor | None = None  # (H_kv, m); the spares are ``_run[:, _off:]``
        self._off = 0
        # the id the spares start at while they continue the prompt's run (a Python int, so an
        # append knows it extends the run without a tensor compare), None when unknown
        self.next_id: int | None = None
        self._recycled: Tensor | None = None  # (H_kv, B, m); held are ``[:, :, _recycled_off:]``
        self._recycled_off = 0

    @property
    def ids(self) -> Tensor | None:
        """``(H_kv, m)`` held, unused slots that continue a one-sample cache's run, or None."""
        return None if self._run is None else self._run[:, self._off :]

    @property
    def recycled(self) -> Tensor | None:
        """``(H_kv, B, m)`` held, unused slots a batch cache's next ``m`` decode appends write (one
        per sample and head each), recycled from decode-time evictions; None when none are held."""
        r = self._recycled
        return None if r is None or self._recycled_off >= r.shape[2] else r[:, :, self._recycled_off :]

    def count(self) -> int:
        """Held slots per KV head (run spares and recycled ones)."""
        spare, left = self.ids, self.recycled
        return (0 if spare is None else spare.shape[1]) + (0 if left is None else left[0].numel())

    def hold_run(self, ids: Tensor, next_id: int | None) -> None:
        """Hold ``ids (H_kv, m)`` as the run spares; ``next_id`` their first id while they continue
        the prompt's run (the same in every head), else None."""
        self._run, self._off, self.next_id = ids, 0, next_id

    def take(self) -> Tensor | int | None:
        """The next run spare: its id (an int, the same in every head) while the spares continue the
        prompt's run, else ``(H_kv,)`` ids; None when none is left."""
        if self._run is None or self._off >= self._run.shape[1]:
            return None
        self._off += 1
        if self.next_id is not None:
            self.next_id += 1
            return self.next_id - 1
        return self._run[:, self._off - 1]

    def peek_run_id(self) -> int | None:
        """The id :meth:`take` gives next while the spares continue the prompt's run (an int), else
        None (none left, or held ids that are not the run): a step reading ahead takes nothing."""
        if self.next_id is None or self._run is None or self._off >= self._run.shape[1]:
            return None
        return self.next_id

    def mark(self) -> tuple[int, int | None, int]:
        """Where the takes stand (for :meth:`rewind`)."""
        return self._off, self.next_id, self._recycled_off

    def rewind(self, mark: tuple[int, int | None, int]) -> None:
        """Hand back every spare taken since :meth:`mark` returned ``mark`` (an append whose write
        failed), nothing else changed since: they are the next ones taken again."""
        self._off, self.next_id, self._recycled_off = mark

    def take_recycled(self) -> Tensor | None:
        """``(H_kv, B)`` the next recycled slots of a batch cache, or None."""
        r = self.recycled
        if r is None:
            return None
        self._recycled_off += 1
        return r[:, :, 0]

    def keep(self, dropped: Tensor) -> None:
        """Hold ``dropped (B, H_kv, m)`` slots a decode-time eviction let go of: a one-sample cache's
        join its run spares (first, so the held slots stay at most the run's spares + one step's drop),
        a batch cache's become recycled columns."""
        b, h, m = dropped.shape
        if b == 1:
            held, per_head = self.ids, dropped[0]
            ids = per_head if held is None or held.shape[1] == 0 else torch.cat([per_head, held], 1)
            self.hold_run(ids, None)  # the spares no longer continue one run
            return
        new = dropped.permute(1, 0, 2)  # (H_kv, B, m)
        left = self.recycled
        self._recycled = new if left is None else torch.cat([new, left], 2)
        self._recycled_off = 0

    def remap(self, remap: Tensor) -> None:
        """Follow a pool compaction: ``remap (H_kv, S_old)`` maps old slot ids to new ones."""
        if self.ids is not None:
            ids = remap.gather(1, self.ids)
            self.hold_run(ids, _one_run(ids))  # a compaction may keep the run (appends stay on ints)
        left = self.recycled
        if left is not None:
            self._recycled = remap.gather(1, left.reshape(left.shape[0], -1)).view(left.shape)
            self._recycled_off = 0

    def release(self, pool: KVPool, layer: int) -> None:
        """Give every held slot back to ``pool`` (layer ``layer``)."""
        if self.ids is not None and self.ids.numel():
            pool.release(layer, self.ids)
        left = self.recycled
        if left is not None:
            pool.release(layer, left.reshape(left.shape[0], -1))
        self._run, self._off, self.next_id = None, 0, None
        self._recycled, self._recycled_off = None, 0


def _one_run(ids: Tensor) -> int | None:
    """``ids (H_kv, m)``'s first id when every head holds the same consecutive ids, else None (one
    host read; compactions are rare)."""
    if ids.shape[1] == 0:
        return None
    run = ids[0, :1] + torch.arange(ids.shape[1], device=ids.device)
    return int(ids[0, 0]) if bool((ids == run).all()) else None
