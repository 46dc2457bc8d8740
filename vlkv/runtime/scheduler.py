"""Continuous batching over one KV pool: requests join between decode steps and leave when done.

Each iteration of :meth:`Scheduler.step`:

1. resumes swapped-out requests while the pool has room (they go before new ones);
2. admits waiting requests by KV bytes: a request is *reserved* the entries its policy is expected
   to hold per layer (``budget × prompt`` + generated tokens for compress-once policies,
   ``budget × (prompt + max_new)`` for policies that evict while decoding), so a request
   compressed to 20 % admits about 5× more beside it; each admitted request is prefilled alone
   and its policy compresses it before the next one is admitted;
3. runs one decode step for every running request (a :class:`CacheBatch` view over their caches;
   requests whose read paths exclude each other — see :mod:`vlkv.runtime.step_groups` — in separate
   backend calls), then lets each request's own policy edit its own cache. A batched call that
   raises is undone and its requests retried one at a time: only a request that fails alone fails.

When a step would not fit (estimates are estimates: per-layer allocators, merges), the most
recently admitted request is *preempted*: its K/V are swapped to host memory and its slots freed;
it resumes, bit-identical, when the pool has room. Cancelling frees a request's slots at once. A
request that fails (a policy error, a prompt the model cannot take) is marked failed with its
message; the others keep running.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections import deque

import torch

from vlkv.runtime import edits as _edits  # called through the module: the eval harness probes it
from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs, StepStats
from vlkv.runtime.cache import KVCache, Modality
from vlkv.runtime.edits import DECODE_SPARE
from vlkv.runtime.kv.batch import CacheBatch
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.request import Request, Status
from vlkv.runtime.step_groups import Entry, group_entries, read_path


class RequestTooLarge(ValueError):
    """A request that could never fit in the scheduler's pool."""


class Scheduler:
    """Runs many :class:`Request` s over one engine and one KV pool.

    Args:
        engine: a :class:`~vlkv.runtime.engine.Engine` (its backend runs every step).
        pool_bytes: K/V bytes of a fixed pool (admission, preemption); None = a growable pool.
        max_running: most requests decoded together.
        swap_device: where preempted requests' K/V wait.
        cache_hit_rate: compute VL-Cache's CacheHitRate per request after its prefill.
        store: optional :class:`~vlkv.runtime.store.ContextStore` linking requests read records from
            and write new ones to (tenant-scoped).
        link_threshold: refuse linking (and recompute) for a method whose saved ``vlkv link-check``
            agreement on this model is below it, or that has no saved check (default-deny); 0 links
            without a check too (as ``VLKV_LINK_UNCHECKED=1`` does); None = the gate's default.
        overcommit: reservations may add up to ``overcommit ×`` the pool (> 1 admits more and relies
            on preemption when requests really grow that large; 1 = never over-admit).
    """

    def __init__(
        self,
        engine,
        pool_bytes: int | None = None,
        max_running: int = 256,
        swap_device: str = "cpu",
        cache_hit_rate: bool = False,
        hit_rate_k: int | float | None = None,
        overcommit: float = 1.0,
        store=None,
        link_threshold: float | None = None,
    ):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if not overcommit >= 1.0:
            raise ValueError(f"overcommit must be >= 1, got {overcommit}")
        self.overcommit = overcommit
        spec = PoolSpec.for_backend(engine.backend)
        self.engine = engine
        self.pool = KVPool(spec, 0, grow=True) if pool_bytes is None else KVPool.with_bytes(spec, pool_bytes)
        self.pool.rope = engine.rope
        self.max_running, self.swap_device = max_running, swap_device
        self.cache_hit_rate, self.hit_rate_k = cache_hit_rate, hit_rate_k
        self.segments = SegmentStore(self.pool)  # linkable records (images, prefixes) in this pool
        self.store = store
        self._sources: dict = {}  # tenant -> RecordSource
        from vlkv.runtime.link.gate import DEFAULT_THRESHOLD

        self.link_threshold = DEFAULT_THRESHOLD if link_threshold is None else link_threshold
        self._checks: dict = {}  # LinkSpec -> saved LinkCheck or None
        from vlkv.runtime.link.spec import LinkStats

        self.link_totals = LinkStats()  # over every linked request (a server's store gauges read it)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.prefill_s = self.decode_s = 0.0
        self.decode_steps = 0
        self.retried_steps = 0  # batched decode steps that raised and were rerun one request at a time
        self.peak_used_bytes = 0
        self.max_concurrent = 0

    # ------------------------------------------------------------------ API
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def submit(self, request: Request) -> Request:
        """Queue a request; raises :class:`RequestTooLarge` (one line, sizes named) if it can never fit
        in the pool, and :class:`~vlkv.runtime.limits.LimitError` if the model cannot take it.

        A request whose ``batch`` is already set (``request.batch = engine.encode([prompt])``) is taken
        as encoded: a server tokenizes and preprocesses images in its handler threads, so the thread
        that steps the scheduler never stalls running streams on one large prompt.
        """
        from vlkv.runtime.limits import check_fits, position_limit

        if request.batch is None:
            request.batch = self.engine.encode([request.prompt])
        elif len(request.batch.prompts) != 1:
            raise ValueError(
                f"request {request.id} carries {len(request.batch.prompts)} encoded prompts; one"
            )
        n = request.prompt_tokens
        loaded = self.engine.loaded
        check_fits([n], request.max_new_tokens, position_limit(loaded), getattr(loaded, "name", "the model"))
        request.reserve = _reserve(request, n)
        replay = getattr(request.policy, "replay_request", None)
        if replay is not None and not getattr(self.engine.backend, "supports_replay", False):
            from vlkv.runtime.replay import replay_refusal

            raise ValueError(
                replay_refusal(self.engine.backend.name, getattr(request.policy, "gradient", False))
            )
        if request.link is not None and request.link.method != "none":
            from vlkv.runtime.store.identity import validate_tenant

            validate_tenant(request.tenant)
            if not getattr(self.engine.backend, "supports_link", False):
                raise ValueError(
                    f"linking needs the PyTorch backend; {self.engine.backend.name} runs no link step: "
                    "use --backend torch or --link none"
                )
            if getattr(request.policy, "prefill_keep", 1.0) < 1.0:
                raise ValueError(
                    f"policy {request.policy.name!r} drops prompt rows inside the prefill (its prefill filter), "
                    "which a link step cannot do: use --link none, or set its prefill_keep to 1"
                )
            why = self._gate(request.link)
            if why is not None:
                request.extras["link_refused"] = why
                request.link = None
        if not self.pool.grow:
            slots = self.pool.capacity(0)
            need = max(n, request.reserve)
            if need > slots:
                per = self.pool.spec.entry_bytes * self.pool.spec.num_layers
                raise RequestTooLarge(
                    f"request {request.id} needs {need} KV entries per layer ({need * per} bytes: "
                    f"{n} prompt tokens, {request.max_new_tokens} new, policy {request.policy.name} at "
                    f"budget {float(request.policy.budget):g}); the pool holds {slots} ({slots * per} bytes)"
                )
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request now and free its KV slots."""
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, Status.CANCELLED)

    def step(self) -> None:
        """One scheduling iteration: resume, admit (prefill), one batched decode step."""
        self._resume()
        self._admit()
        self._decode()

    def run(self) -> None:
        while self.has_work:
            self.step()

    def flush(self) -> None:
        """Wait until every record write-back in flight has reached the store."""
        for src in self._sources.values():
            src.flush()

    def _writer(self):
        """One background thread for store writes: new records go back without delaying answers."""
        return self._threads("_write_pool", 1, "vlkv-store")

    def _loader(self):
        """Threads for store reads: a request's hits load while its misses compute."""
        return self._threads("_read_pool", 2, "vlkv-load")

    def _threads(self, attr: str, workers: int, prefix: str):
        """The executor kept under ``attr``, made on first use (None without a store)."""
        if self.store is None:
            return None
        if getattr(self, attr, None) is None:
            import concurrent.futures

            setattr(self, attr, concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=prefix))
        return getattr(self, attr)

    # ------------------------------------------------------------------ admission
    def _reserved(self) -> int:
        return sum(r.reserve for r in (*self.running, *self.swapped))

    def _admit(self) -> None:
        while self.waiting and not self.swapped and len(self.running) < self.max_running:
            req = self.waiting[0]
            reads = self._store_reads(req)
            if self.running and not all(r.done() for r in reads):
                return  # its store reads run on the loader threads while the running requests decode
            if reads:  # nothing else runs: wait for the look-ups only; the reads overlap its vision tower
                concurrent.futures.wait([r.present for r in reads])
                self._store_reads(req)
            if not self.pool.grow:
                room = self.overcommit * self.pool.capacity(0) - self._reserved()
                # the prompt is written whole before its policy compresses it (a linking prefill
                # also makes the records its missing images lack), and every running request still
                # needs a slot for this iteration's decode step
                short = (
                    req.reserve > room or self._prefill_need(req) + len(self.running) > self.pool.min_free()
                )
                if short and (self.segments.images or self.segments.prefixes):
                    self.segments.release()
                    short = (
                        req.reserve > room
                        or self._prefill_need(req) + len(self.running) > self.pool.min_free()
                    )
                if short and self.running:
                    return
            self.waiting.popleft()
            self._prefill(req)

    def _prefill(self, req: Request) -> None:
        eng = self.engine
        try:
            cache = eng.new_cache(req.batch, pool=self.pool)
            if self.pool.grow:
                # the prompt and its decode appends as one run of slots: a batch reads a pool view
                for layer in cache.layers:
                    layer.run_reserve = req.max_new_tokens
            req.cache, req.status = cache, Status.RUNNING
            t0 = time.perf_counter()
            if req.link is not None and req.link.method != "none":
                out = self._link_or_prefill(req)
            else:
                out = eng.prefill(req.batch, req.policy, cache)
            cache = req.cache
            req.prefill_s = time.perf_counter() - t0
            self.prefill_s += req.prefill_s
            req.peak_kv_bytes = out.peak_kv_bytes or cache.kv_bytes()
            self._track()
            if self.cache_hit_rate:
                from vlkv.runtime.diagnostics import hit_rate_report

                req.extras["cache_hit_rate"] = hit_rate_report(eng, req.batch, cache, k=self.hit_rate_k)
            self.running.append(req)
            self.max_concurrent = max(self.max_concurrent, len(self.running))
            self._headroom()
            self._emit(req, int(req.sampler(out.logits)[0]))
        except Exception as err:  # one request's failure never stops the others
            self._fail(req, err)

    def _gate(self, spec) -> str | None:
        """Why linking with ``spec`` is refused on this model (a saved failing link-check), or None."""
        from vlkv.runtime.link.gate import load_check, refusal
        from vlkv.runtime.store.identity import model_fingerprint

        if spec not in self._checks:
            self._checks[spec] = load_check(model_fingerprint(self.engine.loaded), spec)
        model = getattr(self.engine.loaded, "name", "this model")
        return refusal(self._checks[spec], self.link_threshold, spec, model)

    def _source(self, tenant: str):
        """The tenant's :class:`~vlkv.runtime.link.records.RecordSource` (made on first use)."""
        from vlkv.runtime.link.records import RecordSource

        if tenant not in self._sources:
            src = RecordSource.for_engine(self.engine, self.segments, self.store, tenant)
            src.writer = self._writer()
            src.loader = self._loader()
            self._sources[tenant] = src
        return self._sources[tenant]

    def _idents(self, req: Request) -> list | None:
        """The store identities of a linking request's images (hashed once, kept on the request)."""
        if "link_idents" not in req.extras:
            images, spans = req.prompt.images, req.batch.spans[0].image_spans
            variant = req.link.record_variant()
            src = self._source(req.tenant)
            ok = len(images) == len(spans)
            req.extras["link_idents"] = [src.identity(img, variant) for img in images] if ok else None
        return req.extras["link_idents"]

    def _store_reads(self, req: Request) -> list:
        """The store look-ups of a waiting linking request's images (:class:`StoreRead`: ``contains``,
        then ``find`` for the records present), run on the loader threads from the first time it is
        looked at: a slow or remote store never stalls the engine thread (the linker takes the
        answers, :attr:`RecordSource.ready`). Empty when there is nothing to look up."""
        spec = req.link
        if self.store is None or spec is None or spec.method not in ("mpic", "full-reuse", "cacheblend"):
            return []
        src = self._source(req.tenant)
        if "store_reads" not in req.extras:
            from vlkv.runtime.link.records import StoreRead

            reads = {}
            for ident in self._idents(req) or []:
                key = src.key(ident)
                if key not in self.segments.images and key not in reads:
                    reads[key] = StoreRead(ident, src.loader.submit(self.store.contains, ident, req.tenant))
            req.extras["store_reads"] = reads
        reads = list(req.extras["store_reads"].values())
        for r in reads:
            r.start_find(src.loader, self.store, req.tenant)
        return reads

    def _prefill_need(self, req: Request) -> int:
        """Slots per layer a request's prefill takes at its peak: the prompt, and for a linking
        request the records it makes — a prefix copy of the prompt, or each image missing from the
        pool (loaded or computed), plus one image's scratch cache while a record is computed."""
        n, spec = req.prompt_tokens, req.link
        if spec is None or spec.method == "none":
            return n
        if spec.method == "prefix":
            return 2 * n
        idents = self._idents(req)
        if idents is None:
            return n
        src = self._source(req.tenant)
        missing: dict[str, int] = {}
        for ident, (a, b) in zip(idents, req.batch.spans[0].image_spans):
            key = src.key(ident)
            if key not in self.segments.images:
                missing[key] = b - a
        return n + sum(missing.values()) + max(missing.values(), default=0)

    def _link_or_prefill(self, req: Request):
        """:meth:`_link`; when the pool cannot hold what linking needs (:class:`PoolFull` anywhere in
        it), the partial cache and the in-pool records go back and the request is prefilled plainly
        (linking is an optimisation: it never fails a request that fits without it)."""
        from vlkv.runtime.kv.pool import PoolFull

        try:
            return self._link(req, req.cache)
        except PoolFull as err:
            req.cache.release()
            self.segments.release()  # records are a cache: requests that link them keep their refs
            req.link_stats = None
            req.extras["link_fallback"] = f"linking needed more KV slots than the pool had ({err}); prefilled"
            req.cache = self.engine.new_cache(req.batch, pool=self.pool)
            return self.engine.prefill(req.batch, req.policy, req.cache)

    def _link(self, req: Request, cache: KVCache):
        """Prefill by linking stored records (the linker), then the request's policy edits."""
        eng = self.engine
        src = self._source(req.tenant)
        src.ready = req.extras.pop("store_reads", {})
        ctx = eng.context(req.batch)
        request = req.policy.prefill_request(ctx, req.prompt_tokens)
        try:
            out, req.link_stats = link_prefill(
                eng, req.batch, req.prompt.images, cache, req.link, src, request, self._idents(req)
            )
        finally:
            src.ready = {}
        out.peak_kv_bytes = cache.kv_bytes()
        out.stats.replay = eng.replay(req.policy, ctx, req.batch, cache)
        self.link_totals.add(req.link_stats)
        _edits.apply_edits(cache, req.policy.after_prefill(cache, out.stats, ctx))
        return out

    # ------------------------------------------------------------------ preemption
    def _resume(self) -> None:
        while self.swapped and len(self.running) < self.max_running:
            req = self.swapped[0]
            need = max(int(layer.lengths.max()) for layer in req.cache.layers)
            if need + len(self.running) + 1 > self.pool.min_free():
                return
            self.swapped.popleft()
            req.cache.reload()
            req.status = Status.RUNNING
            self.running.append(req)

    def _make_room(self) -> None:
        """Swap out the latest-admitted requests until one decode step fits every layer."""
        if self.pool.grow:
            return
        if self.pool.min_free() < len(self.running) and (self.segments.images or self.segments.prefixes):
            self.segments.release()  # stored records go first: requests that link them keep their refs
        while self.running and self.pool.min_free() < len(self.running):
            if len(self.running) == 1:
                req = self.running[0]
                self._fail(
                    req,
                    RuntimeError(
                        f"request {req.id} outgrew the KV pool alone ({self.pool.capacity(0)} entries per layer)"
                    ),
                )
                return
            req = self.running.pop()
            req.cache.offload(self.swap_device)
            req.status, req.preemptions = Status.SWAPPED, req.preemptions + 1
            self.swapped.appendleft(req)

    # ------------------------------------------------------------------ decode
    def _decode(self) -> None:
        self._make_room()
        if not self.running:
            return
        t0 = time.perf_counter()
        for group in group_entries(self._entries()):
            self._decode_group(group)
        self.decode_s += time.perf_counter() - t0
        self.decode_steps += 1

    def _entries(self) -> list[Entry]:
        """Each running request's part of this step (its policy asked once); a policy that raises
        here fails its own request only."""
        out = []
        for r in list(self.running):
            try:
                ctx = self.engine.context(r.batch, r.decode_steps + 1)
                stats = r.policy.decode_request(r.cache, ctx)
                attend = r.policy.decode_attend(r.cache, ctx)
                out.append(Entry(r, ctx, stats, attend, read_path(r.cache, attend)))
            except Exception as err:
                self._fail(r, err)
        return out

    def _decode_group(self, group: list[Entry]) -> None:
        """One backend step over ``group``; if it raises, each request is retried alone (its appends
        undone first), so a request that cannot step fails without failing the others."""
        eng = self.engine
        reqs = [e.request for e in group]
        dev = reqs[0].cache.device
        b = len(reqs)
        tokens = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.long, device=dev)
        inputs = StepInputs(
            tokens[:, None],
            torch.cat([eng.decode_positions(r.policy, r.cache) for r in reqs]),
            torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8, device=dev),
            torch.ones(b, dtype=torch.long, device=dev),
            attend=_merge_attend([e.attend for e in group], reqs),
        )
        before = [_step_mark(r.cache) for r in reqs]
        try:
            out = eng.backend.step(
                inputs, CacheBatch([r.cache for r in reqs]), _merge_stats([e.stats for e in group], b, dev)
            )
        except Exception as err:
            for r, mark in zip(reqs, before):
                try:
                    _undo_step(r.cache, mark)
                except Exception as undo_err:  # a cache the failed step left unreadable fails alone
                    self._fail(r, undo_err)
            if b == 1:
                self._fail(reqs[0], err)
                return
            self.retried_steps += 1
            for e in group:
                if not e.request.done:
                    self._decode_group([e])
            return
        self._track()
        for i, e in enumerate(group):
            r = e.request
            try:
                cache = r.cache
                _count_usage(r, cache, None if out.attended is None else out.attended[:, i])
                r.peak_kv_bytes = max(r.peak_kv_bytes, cache.kv_bytes())
                cache.next_position += 1
                stats = _slice_stats(out.stats, i, cache)
                _edits.apply_edits(cache, r.policy.after_decode(cache, stats, e.ctx), spare=DECODE_SPARE)
                r.decode_steps += 1
                self._emit(r, int(r.sampler(out.logits[i : i + 1])[0]))
            except Exception as err:
                self._fail(r, err)

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, req: Request, token: int) -> None:
        req.tokens.append(token)
        if req.first_token_s is None:
            req.first_token_s = time.perf_counter()
        if req.on_token is not None:
            req.on_token(req, token)
        eos = self.engine.eos_ids if req.stop_at_eos else ()
        if token in eos or len(req.tokens) >= req.max_new_tokens:
            self._finish(req, Status.FINISHED)

    def _track(self) -> None:
        self.peak_used_bytes = max(self.peak_used_bytes, self.pool.used_bytes())

    def _fail(self, req: Request, err: Exception) -> None:
        req.error = f"{type(err).__name__}: {err}"
        req.exception = err
        self._finish(req, Status.FAILED)

    def _finish(self, req: Request, status: Status) -> None:
        cache = req.cache
        if cache is not None and not req.final:
            req.final = {
                "kept_per_layer": cache.kept_entries()[:, 0].tolist(),
                "kv_bytes": cache.kv_bytes(),
                "full_kv_bytes": cache.full_kv_bytes(),
            }
            cache.offloaded = None
            for layer in cache.layers:
                layer.offloaded = None
            if req.status != Status.SWAPPED:
                cache.release()
        req.status, req.finish_s = status, time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if req in self.swapped:
            self.swapped.remove(req)
        self._headroom()

    def _headroom(self) -> None:
        """A growable pool keeps room for the running requests' remaining decode steps (one slot per
        request and step; decode evictions only free), so decode never stops to grow or re-compact."""
        if self.pool.grow:
            spare = [r.cache.layers[0].spare_ids for r in self.running]
            self.pool.ensure_headroom(
                sum(
                    max(0, r.max_new_tokens - len(r.tokens) - (0 if s is None else s.shape[1]))
                    for r, s in zip(self.running, spare)
                )
            )


# ---------------------------------------------------------------------- helpers
def _reserve(req: Request, n: int) -> int:
    """Entries per layer the request is expected to hold at most (its admission price)."""
    budget, m = float(req.policy.budget), req.max_new_tokens
    if budget >= 1:
        return n + m
    if req.policy.evicts_during_decode:  # a cadence wrapper lets the cache run ``every - 1`` over
        return min(n + m, math.ceil(budget * (n + m)) + 8 + getattr(req.policy, "every", 1))
    return min(n + m, math.ceil(budget * n) + m)


def _step_mark(cache: KVCache) -> tuple[list[int], list, object]:
    """What a decode step changes in ``cache`` before it returns: per layer its length and next
    sequence index, and the processed count (see :func:`_undo_step`)."""
    return (
        [int(layer.lengths[0]) for layer in cache.layers],
        [layer.next_order.clone() for layer in cache.layers],
        cache.processed.clone(),
    )


def _undo_step(cache: KVCache, mark) -> None:
    """Take back what a decode step that raised had written: the entry it appended to each layer
    it reached (its slot goes back to the pool) and the sequence index that entry took."""
    lengths, orders, processed = mark
    for layer, n, order in zip(cache.layers, lengths, orders):
        grew = int(layer.lengths[0]) - n
        if grew > 0:
            dev = layer.lengths.device
            layer.cut(torch.tensor([n], device=dev), torch.tensor([grew], device=dev))
            layer.next_order = order
    cache.processed = processed


def _merge_stats(requests: list[StatsRequest | None], b: int, device) -> StatsRequest | None:
    wanted = [s for s in requests if s is not None]
    if not wanted:
        return None

    def rows(sel) -> torch.Tensor:  # (B, 1) bool: the row of every request that asked
        return torch.tensor(
            [[s is not None and (s.rows is None or bool(s.rows.any()))] for s in sel], device=device
        )

    layers = None
    if all(s.layers is not None for s in wanted):
        layers = frozenset().union(*(s.layers for s in wanted))
    extra = {}
    for name in {n for s in wanted for n in s.extra}:
        subs = [None if s is None else s.extra.get(name) for s in requests]
        first = next(x for x in subs if x is not None)
        extra[name] = StatsRequest(rows(subs), first.threshold)
    return StatsRequest(rows(requests), wanted[0].threshold, layers, extra)


def _merge_attend(attends: list, reqs: list[Request]) -> list[AttendIndex | None] | None:
    """Per layer, one :class:`AttendIndex` over the batch; requests without one attend to everything."""
    if all(a is None for a in attends):
        return None
    num_layers = len(reqs[0].cache.layers)
    merged: list[AttendIndex | None] = []
    for li in range(num_layers):
        per = [None if a is None else a[li] for a in attends]
        if all(p is None for p in per):
            merged.append(None)
            continue
        parts = []
        for p, r in zip(per, reqs):
            if p is None:
                layer = r.cache.layers[li]
                n = layer.max_length
                idx = torch.arange(n, device=layer.device)[None, None].expand(1, layer.kv_heads, n)
                p = AttendIndex(idx, layer.lengths[:, None].expand(1, layer.kv_heads).clone())
            parts.append(p)
        width = max(p.indices.shape[2] for p in parts)
        idx = torch.cat([torch.nn.functional.pad(p.indices, (0, width - p.indices.shape[2])) for p in parts])
        merged.append(AttendIndex(idx, torch.cat([p.lengths for p in parts])))
    return merged


def _slice_stats(stats: list, i: int, cache: KVCache) -> StepStats:
    """Request ``i``'s statistics, trimmed to its own layer lengths."""
    from vlkv.plugins import AttnStats

    def cut(st, layer):
        if st is None:
            return None
        w = layer.max_length
        below = None if st.below is None else st.below[i : i + 1]
        return AttnStats(st.colsum[i : i + 1, :, :w], below, st.visible[i : i + 1])

    layers = [cut(st, layer) for st, layer in zip(stats, cache.layers)]
    extra = {
        n: [cut(st, layer) for st, layer in zip(v, cache.layers)]
        for n, v in getattr(stats, "extra", {}).items()
    }
    return StepStats(layers, extra)


def _count_usage(req: Request, cache: KVCache, attended) -> None:
    """A-VL's stored / used fractions, per request (see ``KVUsage``)."""
    stored = float(cache.lengths().sum())
    req.usage["stored"] += stored
    req.usage["used"] += float(attended.sum()) if attended is not None else stored
    req.usage["full"] += float(cache.processed.sum()) * len(cache.layers)
