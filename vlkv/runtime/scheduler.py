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

Each prefill and each decode step is ``plan() → Runner.run(plan) → commit(plan, outputs)``
(nano-vllm's ``LLMEngine.step``): :meth:`Scheduler.plan` decides and builds a
:class:`~vlkv.runtime.step_plan.StepPlan` once, the :class:`~vlkv.runtime.runner.Runner` executes
it, and :meth:`Scheduler.commit` applies the policies' edits and emits tokens. Store look-ups,
in-pool records and link prefills live in :class:`~vlkv.runtime.link_stage.LinkStage`.

When a step would not fit (estimates are estimates: per-layer allocators, merges), the most
recently admitted request is *preempted*: its K/V are swapped to host memory and its slots freed;
it resumes, bit-identical, when the pool has room. Cancelling frees a request's slots at once. A
request that fails (a policy error, a prompt the model cannot take) is marked failed with its
message; the others keep running.
"""

from __future__ import annotations

import time
from collections import deque

from vlkv.runtime.admission import RequestTooLarge, check_pool, reserve
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.link_stage import LinkStage
from vlkv.runtime.policies.cohort import cohort_attends, decode_edits
from vlkv.runtime.request import Request, Status
from vlkv.runtime.runner import GroupRun, Runner, StepOutputs
from vlkv.runtime.step_edits import apply_step_edits
from vlkv.runtime.step_groups import Entry, group_entries, read_path
from vlkv.runtime.step_plan import StepPlan, decode_group
from vlkv.runtime.step_reads import GroupReads

__all__ = ["RequestTooLarge", "Scheduler"]

# RequestTooLarge lives in admission.py


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
        self.link = LinkStage(engine, self.pool, store, link_threshold)
        self.runner = Runner(engine, self.pool, self.link)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.prefill_s = self.decode_s = 0.0
        self.decode_steps = 0
        self.retried_steps = 0  # batched decode steps that raised and were rerun one request at a time
        self.peak_used_bytes = 0
        self.max_concurrent = 0

    # the link stage's state, read by the server's gauges and by tests
    store = property(lambda self: self.link.store)
    segments = property(lambda self: self.link.segments)
    link_totals = property(lambda self: self.link.totals)
    link_threshold = property(lambda self: self.link.link_threshold)

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
        request.reserve = reserve(request, n)
        replay = getattr(request.policy, "replay_request", None)
        if replay is not None and not getattr(self.engine.backend, "supports_replay", False):
            from vlkv.runtime.replay import replay_refusal

            raise ValueError(
                replay_refusal(self.engine.backend.name, getattr(request.policy, "gradient", False))
            )
        self.link.vet(request)
        check_pool(request, self.pool)
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
        """One scheduling iteration: ``plan → run → commit`` for each admitted request's prefill, then
        for one batched decode step of every running request (nano-vllm's ``LLMEngine.step``)."""
        while True:
            plan = self.plan()
            self.commit(plan, self.runner.run(plan))
            if plan.is_decode:
                return

    def run(self) -> None:
        while self.has_work:
            self.step()

    def flush(self) -> None:
        """Wait until every record write-back in flight has reached the store."""
        self.link.flush()

    def plan(self) -> StepPlan:
        """The next step: swapped requests resume when the pool has room; then the prefill of the
        next request admission lets in (one per plan: its policy's compression decides what the next
        admission finds), else the decode step of every running request (preempting first when it
        would not fit)."""
        self._resume()
        return self._plan_prefill() or self._plan_decode()

    def commit(self, plan: StepPlan, outputs: StepOutputs) -> None:
        """Apply what running ``plan`` produced: fail the requests that failed alone, then per
        request its policy's edits, its usage counts and its next token."""
        t0 = time.perf_counter()
        for req, err in outputs.failed:
            self._fail(req, err)
        self.retried_steps += outputs.retried
        if plan.prefill:
            if outputs.prefill is not None:
                self._commit_prefill(plan.prefill[0], outputs)
            return
        if not plan.groups:
            return
        self._track()  # every group appended before any policy edits: this step's peak
        for run in outputs.runs:
            self._commit_group(run)
        self.decode_s += plan.built_s + outputs.run_s + time.perf_counter() - t0
        self.decode_steps += 1

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Every prefill admission lets in now (a benchmark times admission and decode apart)."""
        while (plan := self._plan_prefill()) is not None:
            self.commit(plan, self.runner.run(plan))

    def _plan_prefill(self) -> StepPlan | None:
        req = self._next_admitted()
        if req is None:
            return None
        req.status = Status.RUNNING
        return StepPlan(prefill=[req])

    def _reserved(self) -> int:
        return sum(r.reserve for r in (*self.running, *self.swapped))

    def _next_admitted(self) -> Request | None:
        """Pop the waiting request admission lets in now (its store reads answered, its reservation
        and its prefill's peak in the pool), or None."""
        if not (self.waiting and not self.swapped and len(self.running) < self.max_running):
            return None
        req = self.waiting[0]
        # its store reads run on the loader threads while the running requests decode; with nothing
        # else running, wait for the look-ups only (the reads overlap its vision tower)
        if not self.link.reads_ready(req, wait=not self.running):
            return None
        if not self.pool.grow:
            # the prompt is written whole before its policy compresses it (a linking prefill also
            # makes the records its missing images lack), and every running request still needs a
            # slot for this iteration's decode step
            short = self._short(req)
            if short and self.link.release_records():
                short = self._short(req)
            if short and self.running:
                return None
        return self.waiting.popleft()

    def _short(self, req: Request) -> bool:
        room = self.overcommit * self.pool.capacity(0) - self._reserved()
        need = self.link.prefill_need(req) + len(self.running)
        return req.reserve > room or need > self.pool.min_free()

    def _commit_prefill(self, req: Request, outputs: StepOutputs) -> None:
        out = outputs.prefill
        try:
            req.prefill_s = outputs.prefill_s
            self.prefill_s += req.prefill_s
            req.peak_kv_bytes = out.peak_kv_bytes or req.cache.kv_bytes()
            self._track()
            if self.cache_hit_rate:
                from vlkv.runtime.diagnostics import hit_rate_report

                req.extras["cache_hit_rate"] = hit_rate_report(
                    self.engine, req.batch, req.cache, k=self.hit_rate_k
                )
            self.running.append(req)
            self.max_concurrent = max(self.max_concurrent, len(self.running))
            self._headroom()
            self._emit(req, int(req.sampler(out.logits)[0]))
        except Exception as err:  # one request's failure never stops the others
            self._fail(req, err)

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
        if self.pool.min_free() < len(self.running):
            self.link.release_records()  # stored records go first: requests that link them keep their refs
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
        """One decode step of every running request (a benchmark times admission and decode apart)."""
        plan = self._plan_decode()
        self.commit(plan, self.runner.run(plan))

    def _plan_decode(self) -> StepPlan:
        """The decode step of every running request, in groups whose read paths share a call; a
        policy or a cache that raises while its part is planned fails its own request only."""
        self._make_room()
        t0 = time.perf_counter()
        groups = []
        for entries in group_entries(self._entries()):
            try:
                groups.append(decode_group(self.engine, entries))
            except Exception:  # plan each alone: only the request that cannot be planned fails
                for e in entries:
                    try:
                        groups.append(decode_group(self.engine, [e]))
                    except Exception as err:
                        self._fail(e.request, err)
        return StepPlan(groups=groups, built_s=time.perf_counter() - t0)

    def _entries(self) -> list[Entry]:
        """Each running request's part of this step (its policy asked once); a policy that raises
        here fails its own request only. The attend lists of a cohort of equal policies
        (:mod:`vlkv.runtime.policies.cohort`) declaring ``cohort_attend`` come from one call over
        their stacked caches (one read back, not one per request)."""
        out = []
        for r in list(self.running):
            try:
                ctx = self.engine.context(r.batch, r.decode_steps + 1)
                out.append(Entry(r, ctx, r.policy.decode_request(r.cache, ctx), None))
            except Exception as err:
                self._fail(r, err)
        failed = set()
        batched = cohort_attends(out)  # entry -> its attend lists, where a cohort listed them
        for i, e in enumerate(out):
            try:
                r = e.request
                attend = batched[i] if i in batched else r.policy.decode_attend(r.cache, e.ctx)
                e.attend, e.path = attend, read_path(r.cache, attend)
            except Exception as err:
                self._fail(e.request, err)
                failed.add(i)
        return [e for i, e in enumerate(out) if i not in failed]

    def _commit_group(self, run: GroupRun) -> None:
        """Per request of a group that stepped: usage counts, peak bytes, its policy's edits, its
        token. Values the host needs (lengths, widths, greedy tokens) are read once per group; the
        policies' decode bookkeeping runs once per cohort of equal policies on dense caches, any lengths
        (:mod:`vlkv.runtime.policies.cohort`), each request's edits applied to its own cache."""
        group, out = run.group, run.out
        entries = group.entries
        try:
            reads = GroupReads(group, out)
        except Exception as err:
            for e in entries:
                self._fail(e.request, err)
            return
        live = []
        for i, e in enumerate(entries):
            r = e.request
            try:
                stored, used, full = reads.usage[i]
                r.usage["stored"] += stored
                r.usage["used"] += used
                r.usage["full"] += full
                r.peak_kv_bytes = max(r.peak_kv_bytes, reads.kv_bytes(i))
                r.cache.next_position += 1
                live.append(i)
            except Exception as err:
                self._fail(r, err)
        edits, groups = decode_edits(entries, live, out.stats, reads.widths)
        applied = apply_step_edits(entries, edits, groups, self._fail)
        for i in live:
            if i not in applied:
                continue
            r = entries[i].request
            try:
                r.decode_steps += 1
                token = reads.tokens[i]
                self._emit(r, token if token is not None else int(r.sampler(out.logits[i : i + 1])[0]))
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
