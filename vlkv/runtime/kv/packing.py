"""Packing: after an edit drops many entries, each row's kept K/V move into one run of slots.

A prompt-time selection (snapkv, pyramidkv, vlcache, h2o's first eviction, ...) keeps a different
subset of the prompt in every KV head. Left where they lie, a head's kept entries are scattered over
the prompt's run of slots, and the fused paged read (``vlkv.plugins.paged_cpu_kernel``) reads such a
row at ~0.6x the speed of a run (the microbenchmark in docs/benchmarks/2026-11-26-compact-cpu-x86_64/:
the cost is the scattered memory access, not the row's slot list — a run with 8 gaps reads at
1.2–1.3x the run's time). Packing moves the kept entries once, when the edit is applied, into the lowest of
the slots the cache held before it: sample after sample, each row's entries in table order. Where
the cache's slots were the same ascending run in every head (a prompt's), every (sample, head) row
becomes one run and every head the same run — which the read views in place like a full cache's.

A decode-time eviction of a few entries per row (H2O's step) is not packed: moving the K/V after
(or before) its victim would copy about half of each row per step (H2O's victim sits just before its
recent window), more than the few gaps it leaves cost the read.

``PACK`` (``VLKV_PACK=0`` turns it off) switches it, for tests and before/after runs.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

PACK = os.environ.get("VLKV_PACK", "1") != "0"


def held_slots(slots: Tensor, lengths: list[int]) -> Tensor:
    """``(H_kv, N)`` the slots of every valid column of ``slots (B, H_kv, C)``, ``lengths[b]`` per
    sample (every head holding its columns: no holes, no factor rows), sample after sample."""
    parts = [slots[b, :, :n] for b, n in enumerate(lengths) if n]
    if not parts:
        return slots.new_zeros(slots.shape[1], 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def packable(layer, held: Tensor) -> bool:
    """Whether ``layer``'s K/V may move among ``held (H_kv, N)`` (the slots it holds): a pool layer it
    alone references (no shared, linked or stored record reads them; one host read), dense entries,
    no holes."""
    if not PACK or layer.linked or layer.lowrank is not None or layer.holes is not None:
        return False
    if held.numel() == 0 or layer.pool.capacity(layer.layer) == 0:
        return False
    # the pool's per-slot pre-RoPE flags do not move with the K/V: only linked layers hold such
    # slots today, and a layer that holds one is left as it is should that change
    pre = layer.pool.is_prerope(layer.layer, held[None]).any()
    return bool(layer.pool.owned_once(layer.layer, held) & ~pre)


def pack_kept(layer, held: Tensor, kept: list[int]) -> Tensor:
    """Move ``layer``'s kept entries into the lowest slots of ``held (H_kv, N)``.

    ``layer``'s tables already hold the edit's result (``kept[b]`` entries of sample ``b`` in columns
    ``[0, kept[b])``, their slots among ``held``); ``held`` is every slot the layer referenced before
    the edit (:func:`held_slots`), checked by :func:`packable`. Entry ``j`` of sample ``b`` goes to the
    ``(P_b + j)``-th lowest held slot of its head, ``P_b = kept[0] + … + kept[b - 1]``: one gather
    and one copy per K and V for the whole layer (the sources are read before any is written, so
    any overlap is safe). Rewrites ``layer.slots`` in place and returns ``(H_kv, N - K)`` the held
    slots the layer no longer uses, for the caller to release (after the tables: a compaction the
    release starts remaps them).
    """
    pool, at = layer.pool, layer.layer
    h, total = held.shape[0], sum(kept)
    low = held.sort(1).values
    dst = low[:, :total]  # (H_kv, K)
    src = held_slots(layer.slots, kept)
    if total:
        moves = src != dst
        keys, values = pool.keys[at], pool.values[at]
        cap, dim = keys.shape[1], keys.shape[2]
        off = torch.arange(h, device=held.device)[:, None] * cap
        fs, fd = (src + off)[moves], (dst + off)[moves]
        if fs.numel():
            for store in (keys, values):
                flat = store.view(-1, dim)
                flat.index_copy_(0, fd, flat.index_select(0, fs))
            pool.bytes_moved += fs.numel() * pool.spec.entry_bytes // h
        b = layer.batch
        if len(set(kept)) == 1:  # samples alike (a batch in step, or one request): one write
            k = kept[0]
            layer.slots[:, :, :k] = dst.view(h, b, k).transpose(0, 1)
        else:
            start = 0
            for s, k in enumerate(kept):
                layer.slots[s, :, :k] = dst[:, start : start + k]
                start += k
    return low[:, total:]


def continue_run(layer, rest: Tensor) -> Tensor:
    """After :func:`pack_kept` of a one-sample cache whose spares continue its prompt's run
    (``spares.next_id``: a request on a growable pool, see ``SpareSlots``): where the packed run, the
    slots it freed (``rest (H_kv, m)``, ascending) and the spares are one run in every head, the spares
    move to the slots right after the packed run — the decode appends continue it, so the row stays
    one run — and what follows them is returned to release; otherwise ``rest`` unchanged."""
    spares, k = layer.spares, layer.host_lengths()[0]
    held = spares.ids
    if layer.batch != 1 or spares.next_id is None or held is None or not k or not rest.shape[1]:
        return rest
    end = int(layer.slots[0, 0, k - 1]) + 1
    both = torch.cat([rest, held], 1)  # (H_kv, m + r)
    run = torch.arange(end, end + both.shape[1], device=both.device)
    if not bool(((both == run).all()) & (layer.slots[0, :, k - 1] == end - 1).all()):
        return rest
    r = held.shape[1]
    spares.hold_run(both[:, :r], end)
    return both[:, r:]


def row_runs(layer) -> Tensor:
    """``(B, H_kv)`` int64: the ascending runs of slots each row of ``layer``'s table holds (1: one
    run; 0: an empty row) over its valid columns (holes and factor rows break runs)."""
    slots, n = layer.slots, layer.max_length
    held = layer.held_mask(n)
    t = slots[:, :, :n]
    cont = (t[:, :, 1:] == t[:, :, :-1] + 1) & held[:, :, 1:] & held[:, :, :-1]
    return held.sum(2) - cont.sum(2)
