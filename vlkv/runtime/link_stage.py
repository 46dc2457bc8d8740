"""The link stage: a linking request's store look-ups, its records in the pool, and its link prefill.

The scheduler decides *when* a request is admitted; this component does everything linking needs
around that decision: it hashes a request's images once (:meth:`LinkStage.idents`), starts their
store look-ups on loader threads while other requests decode (:meth:`LinkStage.store_reads`),
prices the prefill's peak in slots (:meth:`LinkStage.prefill_need`), refuses methods whose saved
link-check fails (:meth:`LinkStage.refusal`), and runs the link prefill itself, falling back to a
plain prefill when the pool cannot hold what linking needs (:meth:`LinkStage.prefill`). New records
go back to the store on one writer thread; :meth:`LinkStage.flush` waits for them.

It imports neither the scheduler nor the engine module (it is handed the engine object), so
scheduler → link stage → linker is one way.
"""

from __future__ import annotations

import concurrent.futures

from vlkv.runtime import edits as _edits  # called through the module: the eval harness probes it
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkStats

# link methods that read image records from a store (prefix records stay in the pool)
STORE_METHODS = ("mpic", "full-reuse", "cacheblend")


class LinkStage:
    """Store look-ups, in-pool records and link prefills for the requests of one scheduler.

    Args:
        engine: the :class:`~vlkv.runtime.engine.Engine` whose steps link.
        pool: the scheduler's :class:`~vlkv.runtime.kv.pool.KVPool` (records live in it).
        store: optional :class:`~vlkv.runtime.store.ContextStore` (tenant-scoped records).
        link_threshold: see :class:`~vlkv.runtime.scheduler.Scheduler`; None = the gate's default.
    """

    def __init__(self, engine, pool, store=None, link_threshold: float | None = None):
        from vlkv.runtime.link.gate import DEFAULT_THRESHOLD

        self.engine, self.pool, self.store = engine, pool, store
        self.segments = SegmentStore(pool)  # linkable records (images, prefixes) in this pool
        self.link_threshold = DEFAULT_THRESHOLD if link_threshold is None else link_threshold
        self.totals = LinkStats()  # over every linked request (a server's store gauges read it)
        self._sources: dict = {}  # tenant -> RecordSource
        self._checks: dict = {}  # LinkSpec -> saved LinkCheck or None
        self._write_pool = self._read_pool = None

    # ------------------------------------------------------------------ threads
    def writer(self):
        """One background thread for store writes: new records go back without delaying answers."""
        return self._threads("_write_pool", 1, "vlkv-store")

    def loader(self):
        """Threads for store reads: a request's hits load while its misses compute."""
        return self._threads("_read_pool", 2, "vlkv-load")

    def _threads(self, attr: str, workers: int, prefix: str):
        """The executor kept under ``attr``, made on first use (None without a store)."""
        if self.store is None:
            return None
        if getattr(self, attr) is None:
            setattr(self, attr, concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=prefix))
        return getattr(self, attr)

    def flush(self) -> None:
        """Wait until every record write-back in flight has reached the store."""
        for src in self._sources.values():
            src.flush()

    # ------------------------------------------------------------------ records
    def vet(self, req) -> None:
        """Check a submitted linking request: raises ``ValueError`` (one line) for a bad tenant, a
        backend that runs no link step, or a policy that drops prompt rows in its prefill; drops
        its link (``extras["link_refused"]`` says why) when the method's saved link-check fails."""
        if req.link is None or req.link.method == "none":
            return
        from vlkv.runtime.store.identity import validate_tenant

        validate_tenant(req.tenant)
        backend = self.engine.backend
        if not getattr(backend, "supports_link", False):
            raise ValueError(
                f"linking needs the PyTorch backend; {backend.name} runs no link step: "
                "use --backend torch or --link none"
            )
        if getattr(req.policy, "prefill_keep", 1.0) < 1.0:
            raise ValueError(
                f"policy {req.policy.name!r} drops prompt rows inside the prefill (its prefill filter), "
                "which a link step cannot do: use --link none, or set its prefill_keep to 1"
            )
        why = self.refusal(req.link)
        if why is not None:
            req.extras["link_refused"] = why
            req.link = None

    def release_records(self) -> bool:
        """Give the pool's stored records back (requests that link them keep their refs); False when
        there were none, so the caller knows nothing was freed."""
        if not (self.segments.images or self.segments.prefixes):
            return False
        self.segments.release()
        return True

    def refusal(self, spec) -> str | None:
        """Why linking with ``spec`` is refused on this model (a saved failing link-check), or None."""
        from vlkv.runtime.link.gate import load_check, refusal
        from vlkv.runtime.store.identity import model_fingerprint

        if spec not in self._checks:
            self._checks[spec] = load_check(model_fingerprint(self.engine.loaded), spec)
        model = getattr(self.engine.loaded, "name", "this model")
        return refusal(self._checks[spec], self.link_threshold, spec, model)

    def source(self, tenant: str):
        """The tenant's :class:`~vlkv.runtime.link.records.RecordSource` (made on first use)."""
        from vlkv.runtime.link.records import RecordSource

        if tenant not in self._sources:
            src = RecordSource.for_engine(self.engine, self.segments, self.store, tenant)
            src.writer = self.writer()
            src.loader = self.loader()
            self._sources[tenant] = src
        return self._sources[tenant]

    def idents(self, req) -> list | None:
        """The store identities of a linking request's images (hashed once, kept on the request)."""
        if "link_idents" not in req.extras:
            images, spans = req.prompt.images, req.batch.spans[0].image_spans
            variant = req.link.record_variant()
            src = self.source(req.tenant)
            ok = len(images) == len(spans)
            req.extras["link_idents"] = [src.identity(img, variant) for img in images] if ok else None
        return req.extras["link_idents"]

    def store_reads(self, req) -> list:
        """The store look-ups of a waiting linking request's images (:class:`StoreRead`: ``contains``,
        then ``find`` for the records present), run on the loader threads from the first time it is
        looked at: a slow or remote store never stalls the engine thread (the linker takes the
        answers, :attr:`RecordSource.ready`). Empty when there is nothing to look up."""
        spec = req.link
        if self.store is None or spec is None or spec.method not in STORE_METHODS:
            return []
        src = self.source(req.tenant)
        if "store_reads" not in req.extras:
            from vlkv.runtime.link.records import StoreRead

            reads = {}
            for ident in self.idents(req) or []:
                key = src.key(ident)
                if key not in self.segments.images and key not in reads:
                    reads[key] = StoreRead(ident, src.loader.submit(self.store.contains, ident, req.tenant))
            req.extras["store_reads"] = reads
        reads = list(req.extras["store_reads"].values())
        for r in reads:
            r.start_find(src.loader, self.store, req.tenant)
        return reads

    def reads_ready(self, req, wait: bool) -> bool:
        """Whether ``req``'s store look-ups have answered; ``wait`` blocks for the look-ups (not the
        loads, which overlap its vision tower) when nothing else could run meanwhile."""
        reads = self.store_reads(req)
        if all(r.done() for r in reads):
            return True
        if not wait:
            return False
        concurrent.futures.wait([r.present for r in reads])
        self.store_reads(req)
        return True

    def prefill_need(self, req) -> int:
        """Slots per layer a request's prefill takes at its peak: the prompt, and for a linking
        request the records it makes — a prefix copy of the prompt, or each image missing from the
        pool (loaded or computed), plus one image's scratch cache while a record is computed."""
        n, spec = req.prompt_tokens, req.link
        if spec is None or spec.method == "none":
            return n
        if spec.method == "prefix":
            return 2 * n
        idents = self.idents(req)
        if idents is None:
            return n
        src = self.source(req.tenant)
        missing: dict[str, int] = {}
        for ident, (a, b) in zip(idents, req.batch.spans[0].image_spans):
            key = src.key(ident)
            if key not in self.segments.images:
                missing[key] = b - a
        return n + sum(missing.values()) + max(missing.values(), default=0)

    # ------------------------------------------------------------------ prefill
    def prefill(self, req):
        """Prefill ``req`` (its ``cache`` made, empty) by linking; when the pool cannot hold what
        linking needs (:class:`PoolFull` anywhere in it), the partial cache and the in-pool records go
        back and the request is prefilled plainly (linking is an optimisation: it never fails a
        request that fits without it). Returns the step's output; ``req.cache`` may be a new cache."""
        from vlkv.runtime.kv.pool import PoolFull

        try:
            return self._link(req)
        except PoolFull as err:
            req.cache.release()
            self.segments.release()  # records are a cache: requests that link them keep their refs
            req.link_stats = None
            req.extras["link_fallback"] = f"linking needed more KV slots than the pool had ({err}); prefilled"
            req.cache = self.engine.new_cache(req.batch, pool=self.pool)
            return self.engine.prefill(req.batch, req.policy, req.cache)

    def _link(self, req):
        """Prefill by linking stored records (the linker), then the request's policy edits."""
        eng, cache = self.engine, req.cache
        src = self.source(req.tenant)
        src.ready = req.extras.pop("store_reads", {})
        ctx = eng.context(req.batch)
        request = req.policy.prefill_request(ctx, req.prompt_tokens)
        try:
            out, req.link_stats = link_prefill(
                eng, req.batch, req.prompt.images, cache, req.link, src, request, self.idents(req)
            )
        finally:
            src.ready = {}
        out.peak_kv_bytes = cache.kv_bytes()
        out.stats.replay = eng.replay(req.policy, ctx, req.batch, cache)
        self.totals.add(req.link_stats)
        _edits.apply_edits(cache, req.policy.after_prefill(cache, out.stats, ctx))
        return out
