"""A decode step split into a host half and a device half that reads only fixed buffers (CUDA-graph ready).

A GPU decode step is host-bound (GPU run 6: ~30 ms a step at LLaVA-1.5-7B's shape, 8k x 4, against a
7.3 ms bandwidth bound; 224 Triton launches a step). The fix serving engines use (vLLM, nano-vllm) is a
CUDA graph of the decode forward: it needs a forward whose every kernel reads its per-step inputs from
buffers allocated once, at fixed addresses, with launch grids that do not change from step to step and
no host read in between. This module is that forward, for the device path (``models/device_layer.py``'s
fused layers and the Triton kernels, CUDA or ``VLKV_FORCE_TRITON=1``):

- the **host half** (:func:`prepare`) runs the decode append's bookkeeping for every layer
  (``kv/reservation.reserve_decode_entries``: tables grown, slots taken — a fixed pool's for every
  layer in one allocation, ``KVPool.alloc_ahead`` —, lengths advanced), then packs
  per (layer, request) its tables' addresses, new column and length after (``kv/step_tables.meta_row``)
  and the slots into one int64 host tensor, copied once into the step's :class:`StaticBuffers`; the new
  tokens, positions, modality and sequence indices are copied into theirs;
- the **device half** (:func:`forward`) reads only those buffers, the pool and the weights: embedding,
  rotary tables, every layer (``device_layer.forward`` with the append kernel writing the K/V rows,
  every request's table column and the read table ``(B, H_kv, C)`` at a fixed capacity ``C``, then the
  paged read, whose programs loop to each row's length read from the buffer), the norm and the head.

A **statistics step** (h2o, A-VL's update steps, an allocator or cadence around them: a policy that
folds each decode row's attention into its scores) takes the same forward with one more buffer: every
layer's paged read is the statistics kernel (``triton_paged_probs``, the eager step's kernel), which
writes its softmax rows into ``probs (L, B, H_kv, G, C)``, allocated once per batch size and capacity;
after the forward (or the graph's replay) the host half turns them into the step's
:class:`~vlkv.runtime.backend.StepStats` (:func:`step_stats`: rows, thresholds, extra row sets, as
the eager step's ``StepContext.put_one_row_stats``), which the scheduler's commit reads as before.

The grids depend on ``B`` and ``C`` only, so :mod:`vlkv.runtime.cuda_graph` captures :func:`forward`
once per batch size, capacity, statistics mode and reads (holes, a selection) and replays it;
:class:`StaticDecode` runs it without a graph too (the CPU check that it equals the eager step, under
Triton's interpreter).

A **hole step** (some request with per-head holes: kvzip, an adaptive head budget) takes the same
forward: the append kernel already writes ``-1`` at each head's holes into the read table (from the
hole table its meta row names) and the paged reads mask negative slots; its buffers add
``held (L, B, H_kv, 1, C)`` (``static_buffers``), per layer the columns each head attends, written in
the device half (the statistics kernel's visibility output, or 3 ops on the read table in a plain
step), from which the attended counts and the statistics' visible columns come.

A **selection step** (A-VL's core steps: ``StepInputs.attend``, per layer the past columns each KV head
reads) copies the lists into ``select (L, B, H_kv, C)`` in the host half (:func:`_fill_select`: the new
column appended, every column for a layer without a list); each layer's read gathers the read table
through its row (one op into a fixed buffer) and reads to the lists' lengths, and a statistics step's
probabilities, over the lists' positions, are scattered back to columns after the forward.

A **linked step** (some request holding linked entries: a stored record's keys kept pre-RoPE, rotated
on read) takes the same forward: each layer's append also writes ``rot (B, H_kv, C, P)`` beside the read
table, each pre-RoPE column's positions (from the pool's flags), and every paged read of the layer
rotates those keys as it loads them by rows of the model's rotary table (``kv.rope_table``: by position,
per M-RoPE section), where the eager step builds one ``cos/sin`` row per such entry after reading the
flags back.

A **factor step** (some request holding AttentionPack's pre-RoPE low-rank factors, path (a)) reads every
layer through the low-rank kernel over fixed factor stacks (``runtime/static_factors.py``): the host half
copies a request's factor rows and bases there when they changed, its ranks when the policy's factor
edit (the scheduler's commit, eager, outside both halves) set new ones; the device half derives ``frow``
from the read table's negative slots and writes the factored columns' positions into ``rot``.

Taken for a scheduler's batch view of one-sample caches in a decode step: one new row each, no link
step, row filter, swapped-out request, factors beside holes or a selection, or
selection beside per-head holes (:func:`refusal` names what stops it); any other step runs eagerly.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from vlkv.runtime.backend import StepOutput, StepStats
from vlkv.runtime.kv.rope_table import RopeTable
from vlkv.runtime.kv.step_tables import COLUMN, fits, meta_row, table_tensors
from vlkv.runtime.static_buffers import CAPACITY_STEP, StaticBuffers, capacity_for, reads_key, reads_parts
from vlkv.runtime.static_factors import attend_factors, factors_key, factors_refusal
from vlkv.runtime.static_stats import layers_stats, stats_mode, step_stats  # noqa: F401 (re-exported)


def refusal(backend, inputs, cache, stats, graphs: bool = False) -> str | None:
    """Why this step cannot take the static forward (None: it can). Host checks only, no tensor read."""
    from vlkv.plugins import paged_probs
    from vlkv.runtime.models import device_layer

    ad = backend.adapter
    if not ad.device_layer:
        return "the model has no device layers (CUDA or VLKV_FORCE_TRITON=1, VLKV_DEVICE_LAYER on)"
    if stats is not None and not paged_probs.TRITON_PROBS:
        return "statistics with the Triton statistics kernel off (VLKV_TRITON_PROBS=0)"
    if inputs.inputs_embeds is not None or inputs.all_logits or inputs.selective:
        return "not a plain decode step (embeddings, all logits or a link step)"
    if inputs.row_filter is not None:
        return "a row filter"
    b, q = inputs.input_ids.shape
    if q != 1 or inputs.new_len_host != (1,) * b or b > device_layer.MAX_ROWS:
        return "not one new row per request (or more rows than the device layer takes)"
    per = [getattr(la, "rows", None) for la in cache.layers]
    if not per or any(p is None or len(p) != b for p in per):
        return "not a scheduler's batch view"
    # factors are read from a LowRank's samples (anything else: refused as before factors were taken)
    if any(r.batch != 1 or r.offloaded is not None for p in per for r in p):
        return "a swapped-out request (or a layer of several samples)"
    why = factors_refusal(cache, inputs)
    if why is not None:
        return why
    if inputs.attend is not None and any(r.holes is not None for p in per for r in p):
        return "selected attention beside per-head holes (the eager step refuses it too)"
    pool = cache.layers[0].pool
    if pool.spec.dtype != backend.dtype:
        return "the pool's dtype is not the model's"
    if graphs and pool.grow:
        return "a growable pool (its tensors move: a graph needs a fixed pool)"
    for layer in ad.layers:
        fused = layer.__dict__.get(device_layer.ATTR)
        if fused is None or not fused.current(layer):
            return "a decoder layer is not fused (or its weights were replaced)"
    return None


def prepare(bufs: StaticBuffers | None, inputs, cache, make) -> tuple[StaticBuffers, list] | None:
    """The host half of a static step (see the module docstring): every layer's append reserved, the
    step's rows packed and copied into buffers (``bufs``, or ``make(longest)``'s where those are narrower
    than the longest request after the step). Returns the buffers and the reservations, or None where
    some request's tables do not fit the one-launch append (every reservation is then taken back).
    ``inputs``: the step's :class:`~vlkv.runtime.backend.StepInputs` (``(B, 1)`` tokens, ``(B, 1, P)``
    positions); ``cache``: the scheduler's batch view (``kv/batch.CacheBatch``)."""
    from vlkv.runtime.fused_append import _ahead, _step_columns
    from vlkv.runtime.kv.reservation import reserve_decode_entries
    from vlkv.runtime.step_context import StepContext

    ctx = StepContext(cache, inputs, None)
    new = _step_columns(ctx)
    done = []
    pool = cache.layers[0].pool
    # a fixed pool's fresh slots for every layer in one allocation, at the first layer's count (each
    # layer's reservation takes its own from it; a layer asking another count gets its own, and what no
    # layer took goes back at settle)
    pool.alloc_ahead()
    try:
        for i, la in enumerate(cache.layers):
            ahead = _ahead(ctx, new, i)
            done.append(reserve_decode_entries(la.rows, new["order_next"], new["order_rows"], ahead, False))
        rows, ids, moved = [], [], []
        for i, (la, res) in enumerate(zip(cache.layers, done)):
            for r, p in zip(la.rows, res.host):
                tables, scores = table_tensors(r), tuple(r.scores.values())
                if not fits(tables, p, scores):
                    raise _Refused
                rows.append(meta_row(tables, scores, p, None))
            if res.runs:  # every request continues its run: the same slot in every head
                ids.extend(res.spare * la.pool.spec.kv_heads)
            else:  # slots from the pool's free stacks (a device tensor): copied below
                ids.extend([0] * (la.pool.spec.kv_heads * len(res.host)))
                moved.append((i, res.ids))
        longest = max(p + 1 for res in done for p in res.host)
        if bufs is None or bufs.capacity < longest:
            bufs = make(longest)
        dev = bufs.ints.device
        host = torch.tensor([x for row in rows for x in row] + ids, dtype=torch.long)
        if dev.type == "cuda":  # pinned: the copy does not wait for the stream (no host sync)
            host = host.pin_memory()
        bufs.ints.copy_(host, non_blocking=True)
        if len(moved) == len(done):  # every layer took fresh slots (a fixed pool): one stack, one copy
            bufs.ids.copy_(torch.stack([t for _, t in moved]))
        else:
            for i, t in moved:
                bufs.ids[i].copy_(t)
        bufs.token_ids.copy_(inputs.input_ids)
        bufs.positions.copy_(inputs.positions)
        bufs.modality.copy_(new["modality"])
        bufs.order.copy_(new["order"])
        if bufs.select is not None:
            _fill_select(bufs, inputs.attend)
        if bufs.factors is not None:  # the stacks where the factors changed (static_factors)
            bufs.factors.fill(cache)
    except BaseException as err:
        for res in reversed(done):
            res.cancel()
        if isinstance(err, _Refused):
            return None
        raise
    finally:
        pool.settle()
    return bufs, done


def reads_of(inputs, cache) -> str | None:
    """What a step's reads take (``static_buffers``' ``reads``): ``"select"`` (selected attention),
    ``"holes"`` (some request with per-head holes), ``"rope"`` (some request with linked, pre-RoPE
    entries), ``"holes+rope"`` / ``"select+rope"`` (both) or None. Host attributes only."""
    rows = [r for la in cache.layers for r in la.rows]
    base = (
        "select" if inputs.attend is not None else "holes" if any(r.holes is not None for r in rows) else None
    )
    # pre-RoPE factors rotate on read like linked entries (post-RoPE ones are read in the rank space)
    return reads_key(base, any(r.linked or r.lowrank is not None for r in rows))


def _fill_select(bufs: StaticBuffers, attend: list) -> None:
    """A selection step's lists into ``bufs.select`` / ``select_len`` (host half, device copies, no read
    back): per layer each head's listed columns (``AttendIndex``: ascending, ``(B, H_kv, K)``), or every
    column where the layer has no list (``attend[i]`` None: its length before the step), then the new
    column after them (the eager step's ``_with_new_slot``)."""
    for i, index in enumerate(attend):
        if index is None:
            bufs.select[i].copy_(bufs.columns.expand_as(bufs.select[i]))
            bufs.select_len[i].copy_(bufs.meta[i, :, COLUMN, None].expand_as(bufs.select_len[i]))
        else:
            bufs.select[i, :, :, : index.indices.shape[2]].copy_(index.indices)
            bufs.select_len[i].copy_(index.lengths)
    new = bufs.meta[:, :, COLUMN, None, None].expand(*bufs.select_len.shape, 1)
    bufs.select.scatter_(3, bufs.select_len[..., None], new)
    bufs.select_len += 1


class _Refused(Exception):
    """A request's tables do not fit the one-launch append (``step_tables.fits``)."""


def _attend(bufs: StaticBuffers, pools: list, i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Layer ``i``'s append and paged read from the buffers: ``q (B, H, 1, D)`` post-RoPE, ``k, v (B, H_kv,
    1, D)`` the new entries → ``(B, 1, H, D)``."""
    from vlkv.plugins.ops import paged_attention
    from vlkv.plugins.paged_append_triton import decode_append_
    from vlkv.plugins.triton_paged_probs import paged_probs_triton

    keys, values, flags = pools[i]
    new_positions = bufs.positions[:, 0]
    decode_append_(
        keys, values, flags, k, v, bufs.meta, i, new_positions, bufs.modality, bufs.order,
        ids=bufs.ids[i], out=bufs.table, rot_out=bufs.rot,
    )  # fmt: skip
    table, lengths = bufs.table, bufs.lengths[i]
    rot = bufs.rot
    if bufs.select is not None:  # selected attention: the read table gathered through the layer's list
        table, lengths = torch.gather(bufs.table, 2, bufs.select[i], out=bufs.read), bufs.select_len[i]
        if rot is not None:  # and the pre-RoPE positions' twin with it
            rot = torch.gather(rot, 2, bufs.select[i][..., None].expand_as(rot), out=bufs.rot_read)
    rope = _rope_args(bufs, rot)
    if bufs.factors is not None:  # low-rank factors: the low-rank kernel over the stacks
        return attend_factors(bufs, i, q, keys, values, rot, rope, attn.scaling).transpose(1, 2).contiguous()
    held = None if bufs.held is None else bufs.held[i]  # a hole step's: the columns each head attends
    if rope:  # linked entries: the read rotating them by the table (not ops' router, which has no sec)
        from vlkv.plugins.triton_paged_attention import paged_attention_triton

        paged_attention = partial(paged_attention_triton, **rope)
    if bufs.probs is None:
        out = paged_attention(q, keys, values, table, lengths, attn.scaling)
        if held is not None:  # the read table's slots >= 0 below the length (3 ops; no host read)
            torch.logical_and(table >= 0, bufs.columns < lengths[..., None], out=held[:, :, 0])
    else:  # a statistics step: the eager step's one-read kernel, its softmax rows into the buffer
        out, _, _ = paged_probs_triton(
            q, keys, values, table, lengths, attn.scaling,
            with_vis=held is not None, probs_out=bufs.probs[i], vis_out=held, **rope,
        )  # fmt: skip
        if bufs.exact:  # the plain read's output, bit for bit (as the eager step's exact_output)
            out = paged_attention(q, keys, values, table, lengths, attn.scaling)
    return out.transpose(1, 2).contiguous()


def _rope_args(bufs: StaticBuffers, rot: Tensor | None) -> dict:
    """The paged reads' pre-RoPE keywords of a linked step (``rot (B, H_kv, C, P)`` the layer's positions
    twin as read, ``cos``, ``sin`` the table; M-RoPE: ``sec``, the section map, with every component; 1-D
    RoPE: component 0 names the table's row), or ``{}``."""
    t = bufs.rope
    if t is None:
        return {}
    if t.sec is None:
        return dict(rot=rot[..., 0], cos=t.cos, sin=t.sin)
    return dict(rot=rot, cos=t.cos, sin=t.sin, sec=t.sec)


@torch.no_grad()
def forward(backend, bufs: StaticBuffers, pools: list) -> tuple[Tensor, Tensor]:
    """The device half (see the module docstring): reads ``bufs``, ``pools`` (per layer the pool's
    ``(keys, values, pre-RoPE flags)``) and the weights only; no host read, no shape from a value.
    Returns ``logits (B, V)`` float32 and ``attended (L, B)`` float64 (per layer the entries each row
    attended: its length after, less its holes' mean over KV heads)."""
    from vlkv.runtime.models import device_layer

    ad = backend.adapter
    hidden = ad.embed_tokens(bufs.token_ids)
    cos_sin = ad.rotary(hidden, bufs.positions)
    for i, layer in enumerate(ad.layers):
        fused = layer.__dict__[device_layer.ATTR]
        hidden = device_layer.forward(fused, layer, hidden, None, cos_sin, partial(_attend, bufs, pools, i))
    hidden = ad.norm(hidden)
    logits = ad.head(hidden[:, 0], fast=True).float()
    return logits, bufs.attended()


def layer_pools(cache) -> list:
    """Per layer the pool's ``(keys, values, pre-RoPE flags)`` the layer reads and writes."""
    pool = cache.layers[0].pool
    return [(pool.keys[la.layer], pool.values[la.layer], pool.prerope_flags(la.layer)) for la in cache.layers]


class StaticDecode:
    """Runs a backend's qualifying decode steps through :func:`prepare` + :func:`forward`, replayed as a
    CUDA graph where ``graphs`` (a :class:`~vlkv.runtime.cuda_graph.DecodeGraphs`) is given; others
    return None (the backend's eager step runs). ``capacity_step``: the read table's width step.

    Attributes:
        taken, refused: steps run here, and steps refused by reason (what a test or report reads).
    """

    def __init__(self, backend, graphs=None, capacity_step: int = CAPACITY_STEP):
        if capacity_step < 1:
            raise ValueError(f"capacity_step must be >= 1, got {capacity_step}")
        self.backend, self.graphs, self.capacity_step = backend, graphs, capacity_step
        # (batch size, statistics mode, reads[, factor stacks' shape]) → its buffers (mode: None, "probs"
        # or "exact", see stats_mode; reads: holes, a selection, linked entries, see reads_of and
        # static_buffers; the stacks': static_factors.factors_key, where some request holds factors)
        self._bufs: dict[tuple, StaticBuffers] = {}
        self.taken = 0
        self.refused: dict[str, int] = {}

    def rope_table(self, pool) -> RopeTable:
        """The rotary table linked and factor steps rotate by (``kv.rope_table``): the pool's
        :meth:`~vlkv.runtime.kv.rope.Rope.table`, the one the eager step's factor reads use too (one copy
        a model, dtype and device; a larger one for a pool grown past it). The step's buffers keep the
        table they were made with alive (a graph replays against its address)."""
        if pool.rope is None:  # set by the engine / scheduler before a step that links or factors
            raise RuntimeError("a static step that rotates on read needs pool.rope (the model's rotary)")
        return pool.rope.table(pool.keys[0], self.backend.pos_dims, pool.capacity(0))

    def release(self) -> None:
        """Drop every step's buffers and captured graph: they hold a scheduler's pool tensors, which a
        scheduler that is done with its pool would otherwise keep alive. The next step allocates and
        captures again."""
        self._bufs.clear()
        if self.graphs is not None:
            self.graphs.clear()

    def step(self, inputs, cache, stats) -> StepOutput | None:
        """The step's :class:`StepOutput`, or None where it is not taken (nothing changed then)."""
        why = refusal(self.backend, inputs, cache, stats, graphs=self.graphs is not None)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return None
        b = inputs.input_ids.shape[0]
        be = self.backend
        device = cache.layers[0].pool.spec.device
        mode = stats_mode(stats)
        group = be.num_heads // be.num_kv_heads if mode is not None else 0
        reads = reads_of(inputs, cache)
        fkey = factors_key(cache)  # the factor stacks' shape (static_factors), or None
        key = (b, mode, reads) if fkey is None else (b, mode, reads, fkey)

        rope = self.rope_table(cache.layers[0].pool) if reads_parts(reads)[2] else None

        def make(longest: int) -> StaticBuffers:
            cap = capacity_for(longest, self.capacity_step)
            return StaticBuffers.make(
                b, cap, be.num_layers, be.num_kv_heads, be.pos_dims, device,
                group=group, exact=mode == "exact", reads=reads, rope=rope, factors=fkey, dtype=be.dtype,
            )  # fmt: skip

        bufs = self._bufs.get(key)
        if bufs is not None and bufs.rope is not rope:  # a larger table since (a grown pool): new buffers
            bufs = None
        got = prepare(bufs, inputs, cache, make)
        if got is None:
            why = "tables the one-launch append cannot address"
            self.refused[why] = self.refused.get(why, 0) + 1
            return None
        bufs, reservations = got
        self._bufs[key] = bufs
        pools = layer_pools(cache)
        try:
            if self.graphs is None:
                logits, attended = forward(be, bufs, pools)
            else:
                flat = tuple(t for trio in pools for t in trio)
                fn = partial(forward, be, bufs, pools)
                logits, attended = self.graphs.run(bufs, fn, flat, key=key)
        except BaseException:
            for res in reversed(reservations):
                res.cancel()
            raise
        # the statistics from the probabilities the forward left in the buffers (host half, after it)
        got_stats = (
            StepStats([None] * be.num_layers, {}) if mode is None else step_stats(bufs, inputs, cache, stats)
        )
        cache.processed += inputs.new_len.to(cache.processed)
        self.taken += 1
        return StepOutput(logits=logits, stats=got_stats, attended=attended)
