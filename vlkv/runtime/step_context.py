"""A PyTorch backend step's context: what each decoder layer's cache update and attention read.

The torch backend (``torch_backend.py``) hands one :class:`StepContext` per step to transformers in
place of the attention mask: the cache object whose ``update(k, v, layer_idx)`` appends a layer's new
K/V to vlkv's cache, and the state the registered attention function reads (``attend``): each layer's
past lengths, the paged read's tables, the statistics policies asked for, the rows a row filter keeps,
the entries each layer attended. A decode layer on an fp32 CPU pool may append and attend in one C++
call instead (``fused_append.fused_decode_row``, through ``reads_paged``, ``put_one_row_stats`` and
``new_columns``). The attention math itself lives in ``attention_rows.py``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from vlkv.runtime.attention_rows import (
    _one_row_out,
    _one_row_probs,
    _one_row_stats,
    _paged_one_row,
    _rank_space_one_row,
    _stats,
    _with_new_slot,
)
from vlkv.runtime.backend import StatsRequest, StepInputs, StepStats
from vlkv.runtime.cache import KVCache
from vlkv.runtime.kv.paged import attended_entries as _attended
from vlkv.runtime.kv.paged import paged_tables
from vlkv.runtime.kv.paged_factors import paged_lowrank_tables

# a decode step reads pre-RoPE low-rank factors in place with the Triton kernel where it runs
# (``reads_factors_paged``); VLKV_PAGED_FACTORS=0 rebuilds them densely (``LowRank.fill``) there too
PAGED_FACTORS = os.environ.get("VLKV_PAGED_FACTORS", "1") != "0"


class StepContext:
    """Per-step state handed to the attention function in place of HF's attention mask."""

    def __init__(self, cache: KVCache, inputs: StepInputs, stats: StatsRequest | None):
        self.cache, self.inputs = cache, inputs
        self.past: dict[int, Tensor] = {}
        n_layers = len(cache.layers)
        # "" is the main request; extra requests keep their names
        self.requests: dict[str, StatsRequest] = {}
        if stats is not None:
            self.requests = {"": stats, **stats.extra}
        self.stats = StepStats([None] * n_layers, {name: [None] * n_layers for name in self.requests if name})
        # every row's sequence index, fixed for the whole step (a row filter keeps them)
        q = inputs.input_ids.shape[1]
        order = inputs.order
        if order is None:
            order = cache.processed.to(inputs.new_len.device)[:, None] + torch.arange(
                q, device=inputs.new_len.device
            )
        self.order = order
        self.attended: list[Tensor | None] = [None] * n_layers  # (B,) per layer, on the compute device
        # layer → (table (B, H_kv, n), lengths (B, H_kv), attended (B,), pre-RoPE keywords, host
        # lengths) of the layers a decode step reads paged (see ``paged_tables``)
        self.paged: dict[int, tuple] = {}
        # the CPU paged read's plan of the last table read: the layers of a cache usually share one
        # table in a step, so the plan (runs, gathered rows, masks) is built once, not per layer
        self.cpu_plan = None
        # the values a fused decode append writes into every layer's new column, split once per step
        # (``fused_append.fused_decode_row``): (inputs, order, columns), or None
        self.new_columns: tuple | None = None
        # a prefill into an empty cache with no padded rows can take SDPA's is_causal path
        self.plain = (
            q > 1
            and bool((inputs.new_len == q).all())
            and all(not bool(lay.lengths.any()) for lay in cache.layers)
        )
        # a decode step: one new row per sample (decided once, not per layer)
        host = inputs.new_len_host
        self.one_row = q == 1 and (all(n == 1 for n in host) if host else bool((inputs.new_len == 1).all()))
        valid = self._valid(inputs)
        self.rows = {
            name: valid if req.rows is None else req.rows.to(valid.device) & valid
            for name, req in self.requests.items()
        }
        # a decode step's statistics: None where every sample's row is requested (decided once per
        # step, so no layer masks its probabilities by a row set that keeps them all)
        # (a request without rows asks for every valid row: all of them in a decode step, no read)
        self.one_rows = {
            name: None if self.one_row and (self.requests[name].rows is None or bool(rows.all())) else rows
            for name, rows in self.rows.items()
        }

    @staticmethod
    def _valid(inputs: StepInputs) -> Tensor:
        q = inputs.input_ids.shape[1]
        return torch.arange(q, device=inputs.new_len.device)[None, :] < inputs.new_len[:, None]

    def update(
        self, k: Tensor, v: Tensor, layer_idx: int, cache_kwargs=None, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """HF ``Cache.update`` contract: store the new K/V, return what attention reads."""
        layer = self.cache.layers[layer_idx]
        # a decode step's "one row each" is decided once (``one_row``), not read back per layer
        self.past[layer_idx] = layer.append(
            k,
            v,
            self.inputs.positions,
            self.inputs.modality,
            self.inputs.new_len,
            self.order,
            self.one_row or None,
        )
        if self.reads_paged(layer, layer_idx):
            # a plain decode step reads K/V where they lie, through the slot tables: no gathered copy
            self.paged[layer_idx] = paged_tables(layer)
            return layer.pool.keys[layer.layer], layer.pool.values[layer.layer]
        if self.reads_factors_paged(layer):
            # factors read in place (pre-RoPE rows rebuilt and rotated, post-RoPE in the rank space)
            self.paged[layer_idx] = self.factor_tables(layer)
            return layer.pool.keys[layer.layer], layer.pool.values[layer.layer]
        # elsewhere (CPU) post-RoPE factors: a decode step attends to them in the rank space, unrebuilt
        return layer.attention_kv(view=True, fill=not self._rank_space(layer))

    def put_one_row_stats(self, layer_idx: int, wanted: list[str], probs: Tensor, vis: Tensor | None) -> None:
        """Each wanted request's statistics of this layer from a decode step's one softmax row per head
        (``probs (B, H_kv, G, S)`` float32, ``vis`` its visibility mask or None)."""
        for name in wanted:
            st = _one_row_stats(probs, vis, self.one_rows[name], self.requests[name].threshold)
            if name:
                self.stats.extra[name][layer_idx] = st
            else:
                self.stats[layer_idx] = st

    def reads_paged(self, layer, layer_idx: int) -> bool:
        """This layer's decode attention reads the pool through the tables (``ops.paged_attention``, or
        ``paged_probs`` when statistics are wanted): one new row per sample, dense entries (shared
        pre-RoPE keys are rotated on read; no low-rank factors), no selected attention or link step."""
        if not getattr(self, "one_row", False) or self.inputs.attend is not None or self.inputs.selective:
            return False
        rows = getattr(layer, "rows", [layer])  # a batch view's requests, or the layer itself
        return all(r.lowrank is None and r.offloaded is None for r in rows)

    def factor_tables(self, layer) -> tuple:
        """The paged read's tables of a decode layer that reads its low-rank factors in place
        (``kv/paged_factors.paged_lowrank_tables``), after the layer's append (``update``'s, or the
        device append's, ``fused_append.device_decode_append``)."""
        return paged_lowrank_tables(layer)

    def reads_factors_paged(self, layer) -> bool:
        """This decode layer reads its low-rank factors (AttentionPack path (a) pre-RoPE, rebuilt and
        rotated, or path (b) post-RoPE, in the rank space; mixed per request) and its pool through the
        slot tables in one Triton kernel (``plugins.triton_paged_lowrank``: CUDA, or forced Triton;
        ``PAGED_FACTORS``): one new row per sample, no selected attention or link step, no swapped-out
        request. Elsewhere path (a)'s rows are rebuilt densely (``LowRank.fill``, the CPU path) and path
        (b) attends eagerly in the rank space (``_rank_space``)."""
        if not PAGED_FACTORS or not getattr(self, "one_row", False):
            return False
        if self.inputs.attend is not None or self.inputs.selective:
            return False
        rows = getattr(layer, "rows", [layer])
        if any(r.offloaded is not None for r in rows):
            return False
        held = [f for r in rows if r.lowrank is not None for f in r.lowrank.samples if f is not None]
        if not held:
            return False
        from vlkv.plugins.ops import use_triton

        return use_triton(layer.pool.keys[layer.layer])

    def _rank_space(self, layer) -> bool:
        """This step attends to ``layer``'s factored rows in the rank space (AttentionPack path (b))."""
        return (
            getattr(self, "one_row", False)
            and layer.lowrank is not None
            and layer.lowrank.post_rope
            and self.inputs.attend is None
            and not self.inputs.selective
        )

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``q (B, H, q, D)``, ``k/v (B, H_kv, S, D)`` → ``(B, q, H, D)``."""
        past = self.past[layer_idx]
        new_len = self.inputs.new_len.to(past)
        paged = getattr(self, "paged", {}).get(layer_idx)
        if paged is not None:  # k, v are the layer's pool tensors (H_kv, S, D)
            table, lengths, attended, rope, host, *factors = paged  # low-rank factors last, if any
            table, lengths = table.to(q.device), lengths.to(q.device)
            self.attended[layer_idx] = attended.to(q.device)
            wanted = [name for name, req in self.requests.items() if req.wants(layer_idx)]

            exact = any(self.requests[name].exact_output for name in wanted)
            out, probs, vis, self.cpu_plan = _paged_one_row(
                q,
                k,
                v,
                table,
                lengths,
                scale,
                rope,
                host,
                bool(wanted),
                exact,
                getattr(self, "cpu_plan", None),
                factors[0] if factors else None,
            )
            if wanted:
                self.put_one_row_stats(layer_idx, wanted, probs, vis)
            return out.transpose(1, 2).contiguous()
        index = self.inputs.attend[layer_idx] if self.inputs.attend is not None else None
        # per-head holes (heads with their own budgets): False where a head must not attend
        open_ = self.cache.layers[layer_idx].open_mask(k.shape[2])
        if open_ is not None:
            open_ = open_.to(q.device)
        if self.inputs.selective:
            out = self._attend_by_order(layer_idx, q, k, v, scale, past, new_len, open_)
            self._stats_by_order(layer_idx, q, k, scale, past, new_len, open_)
            return out.transpose(1, 2).contiguous()
        elif index is None:
            self.attended[layer_idx] = _attended(past + new_len, open_)
            wanted = [name for name, req in self.requests.items() if req.wants(layer_idx)]
            layer = self.cache.layers[layer_idx]
            if self._rank_space(layer):
                out, probs, vis = _rank_space_one_row(q, k, v, scale, past, open_, layer)
                self.put_one_row_stats(layer_idx, wanted, probs, vis)
                return out.transpose(1, 2).contiguous()
            if wanted and getattr(self, "one_row", False):
                # a decode step's statistics are one softmax row per head: a few tensor ops, not the
                # general chunked pass (whose per-sample loop cost more than the attention itself).
                # The output comes from those probabilities: the keys are read once, not by SDPA and
                # again for the statistics (that second read was most of what a per-step policy paid
                # over a compress-once one at a large cache)
                probs, vis = _one_row_probs(q, k, scale, past, open_)
                if any(self.requests[name].exact_output for name in wanted):
                    out = self._attend_full(q, k, v, scale, past, new_len, open_)
                else:
                    out = _one_row_out(probs, v, q)
                self.put_one_row_stats(layer_idx, wanted, probs, vis)
                return out.transpose(1, 2).contiguous()
            out = self._attend_full(q, k, v, scale, past, new_len, open_)
            selected = None
        elif open_ is not None:
            raise ValueError(
                "attend indices (A-VL's selected attention) cannot read a cache with per-head holes"
            )
        else:
            from vlkv.plugins import selected_attention

            selected = _with_new_slot(index, past)
            out = selected_attention(q, k, v, *selected, scale)
            self.attended[layer_idx] = selected[1].double().mean(1)
        for name, req in self.requests.items():
            if req.wants(layer_idx):
                st = _stats(q, k, scale, self.rows[name], req.threshold, past, new_len, selected, open_)
                if name:
                    self.stats.extra[name][layer_idx] = st
                else:
                    self.stats[layer_idx] = st
        return out.transpose(1, 2).contiguous()

    def _attend_full(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        past: Tensor,
        new_len: Tensor,
        open_: Tensor | None = None,
    ) -> Tensor:
        """Causal attention over the cache, by the cheapest SDPA call that gives the same result.

        ``q (B, H, q, D)``, ``k/v (B, H_kv, S, D)``, ``past``/``new_len (B,)`` → ``(B, H, q, D)``. Key ``j`` is
        visible to row ``i`` of sample ``b`` iff ``j <= past[b] + i`` and ``j < past[b] + new_len[b]``, and,
        with ``open_ (B, H_kv, S)``, KV head ``h`` reads it only where ``open_[b, h, j]``.
        """
        b, h, nq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        if getattr(self, "plain", False) and nq == s:  # contexts built without __init__ take the mask
            # a prefill into an empty cache without padded rows: SDPA's causal path skips the masked blocks
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != hkv)
        if nq == 1:
            # one row per sample: its G query heads per KV head become G rows of one (B, H_kv, G, D) call,
            # which reads each K/V head once (faster than enable_gqa) under a (B, 1, 1, S) mask
            one = getattr(self, "one_row", False)
            end = past + 1 if one else torch.minimum(past + 1, past + new_len)
            if open_ is None and (int(past.min()) + 1 == s if one else bool((end == s).all())):
                # every sample reads every column (batch 1, or equal lengths): no mask, SDPA's fast path
                out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k, v, scale=scale)
                # reshape, not view: CUDA's fused SDPA kernels return (B, H_kv, G, D) as a strided view
                return out.reshape(b, h, 1, d)
            mask = (torch.arange(s, device=q.device)[None, :] < end[:, None])[:, None, None, :]
            if open_ is not None:
                mask = mask & open_[:, :, None, :]  # (B, H_kv, 1, S): per KV head, shared by its G rows
            out = F.scaled_dot_product_attention(
                q.reshape(b, hkv, h // hkv, d), k, v, attn_mask=mask, scale=scale
            )
            return out.reshape(b, h, 1, d)
        i, j = torch.arange(nq, device=q.device), torch.arange(s, device=q.device)
        mask = (j[None, None, :] <= (past[:, None, None] + i[None, :, None])) & (
            j[None, None, :] < (past + new_len)[:, None, None]
        )
        mask = mask[:, None]
        if open_ is not None:
            mask = mask & open_.repeat_interleave(h // hkv, dim=1)[:, :, None, :]  # (B, H, q, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hkv)

    def _attend_by_order(self, layer_idx, q, k, v, scale, past, new_len, open_=None) -> Tensor:
        """A link step: row ``i`` sees every valid entry whose sequence order is ``<= order[i]``.

        ``q (B, H, q, D)``, ``k/v (B, H_kv, S, D)``; the mask is per KV head (entries may differ per head).
        """
        layer = self.cache.layers[layer_idx]
        s = k.shape[2]
        key_order = layer.order[:, :, :s].to(q.device)  # (B, H_kv, S)
        valid = torch.arange(s, device=q.device)[None, :] < (past + new_len)[:, None]  # (B, S)
        row_order = self.order.to(q.device)  # (B, q)
        mask = (key_order[:, :, None, :] <= row_order[:, None, :, None]) & valid[:, None, None, :]
        if open_ is not None:
            mask = mask & open_[:, :, None, :]
        mask = mask.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, q, S)
        self.attended[layer_idx] = _attended(past + new_len, open_)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def _stats_by_order(self, layer_idx, q, k, scale, past, new_len, open_=None) -> None:
        """A link step's statistics: the requested rows' softmax masked by sequence order, per KV head."""
        from vlkv.plugins import attn_stats

        layer = self.cache.layers[layer_idx]
        key_order = layer.order[:, :, : k.shape[2]]
        if open_ is not None:  # a hole is never visible: an order no row reaches
            key_order = key_order.masked_fill(~open_.to(key_order.device), torch.iinfo(torch.long).max)
        for name, req in self.requests.items():
            if not req.wants(layer_idx):
                continue
            st = attn_stats(
                q,
                k,
                scale,
                query_rows=self.rows[name],
                causal=False,
                threshold=req.threshold,
                key_lengths=past + new_len,
                key_order=key_order,
                query_order=self.order,
            )
            if name:
                self.stats.extra[name][layer_idx] = st
            else:
                self.stats[layer_idx] = st

    def filter_rows(self, keep: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Keep only ``keep (B, q)`` rows (plus each sample's last valid row) for the next layers.

        Returns the compacted ``hidden (B, q', hidden)`` and positions ``(B, q', P)``; the step's
        inputs and stats rows are compacted alike, so later layers append only kept rows.
        """
        inp = self.inputs
        b = inp.new_len.shape[0]
        valid = self._valid(inp)
        keep = keep.to(device=valid.device, dtype=torch.bool) & valid
        last = (inp.new_len - 1).clamp(min=0)
        keep[torch.arange(b, device=keep.device), last] |= inp.new_len > 0
        new_len = keep.sum(1)
        width = max(int(new_len.max()), 1)
        self.plain = self.plain and width > 1 and bool((new_len == width).all())
        # kept rows first, in their original order (stable sort of the "dropped" flag)
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]

        def gather(t: Tensor) -> Tensor:  # rows of a (B, q, ...) tensor in ``order``
            shape = (b, width, *t.shape[2:])
            return t.gather(1, order.to(t.device).view(b, width, *([1] * (t.dim() - 2))).expand(shape))

        self.order = gather(self.order)
        self.inputs = StepInputs(gather(inp.input_ids), gather(inp.positions), gather(inp.modality), new_len)
        valid = self._valid(self.inputs)
        self.rows = {name: gather(rows) & valid for name, rows in self.rows.items()}
        hidden = gather(hidden)
        return hidden, self.inputs.positions

    # transformers may ask a cache for these; answer with this step's view
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.layers[layer_idx].max_length
