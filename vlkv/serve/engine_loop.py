"""The engine thread: the only thread that touches the :class:`~vlkv.runtime.scheduler.Scheduler`.

The scheduler is not thread-safe, so HTTP handlers never call it: they put ``submit`` / ``cancel``
commands on a thread-safe queue, which this thread drains between scheduler steps. Tokens travel the
other way through each request's :class:`Ticket`, whose asyncio queue is fed with
``loop.call_soon_threadsafe``. After every iteration the thread publishes a :class:`Snapshot` of the
scheduler's counters, which is all ``/metrics`` and ``/health`` read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from vlkv.runtime.request import Request, Status

log = logging.getLogger("vlkv.serve")
DONE = object()  # end of a ticket's token stream


class ShuttingDown(RuntimeError):
    """A request that reached the engine thread after it stopped."""


@dataclass
class Ticket:
    """One HTTP request's handle on a scheduler :class:`Request`.

    ``events`` receives token ids (int) then :data:`DONE`; ``accepted`` resolves once the engine thread
    has submitted the request (or raises what ``Scheduler.submit`` raised).
    """

    request: Request
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the engine thread cancels the request
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    timed_out: bool = False
    started: bool = False  # got its first token, or ended: no longer counted as queued

    def __post_init__(self) -> None:
        self.accepted = self.loop.create_future()

    # called from the engine thread -------------------------------------------------
    def _post(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self.loop.call_soon_threadsafe(fn, *args)

    def resolve(self, error: BaseException | None) -> None:
        def settle():
            if not self.accepted.done():
                (self.accepted.set_result(None) if error is None else self.accepted.set_exception(error))

        self._post(settle)

    def push(self, item) -> None:
        self._post(self.events.put_nowait, item)


@dataclass
class Snapshot:
    """Scheduler counters as of the engine thread's last iteration (read by other threads)."""

    waiting: int = 0
    running: int = 0
    swapped: int = 0
    pending: int = 0  # submit commands not yet drained
    pool_used_bytes: int = 0
    pool_total_bytes: int = 0
    max_running: int = 0
    decode_steps: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_corrupt: int = 0


class EngineLoop:
    """Owns a scheduler and steps it on one thread; see the module docstring.

    Args:
        scheduler: the :class:`Scheduler` (used by this thread only once :meth:`start` ran).
        metrics: a :class:`~vlkv.serve.metrics.ServeMetrics` (or None).
        idle_wait_s: how long an idle thread blocks on the command queue before re-checking for stop.
    """

    def __init__(self, scheduler, metrics=None, idle_wait_s: float = 0.05):
        self.sched = scheduler
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.snapshot = Snapshot()
        self.fatal: str | None = None  # set if the thread itself died (never by one request)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Ticket] = {}
        self._queued = 0  # accepted by HTTP, not yet started (first token) or ended
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="vlkv-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping; requests still live are cancelled (the HTTP layer drained what it could)."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def queued(self) -> int:
        return self._queued

    def submit(self, ticket: Ticket, max_queued: int | None = None) -> bool:
        """Queue ``ticket`` for the engine thread; False (nothing queued) when ``max_queued`` requests
        already wait for their first token."""
        with self._lock:
            if max_queued is not None and self._queued >= max_queued:
                return False
            self._queued += 1
        self._commands.put(("submit", ticket))
        return True

    def cancel(self, ticket: Ticket) -> None:
        self._commands.put(("cancel", ticket))

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.sched.has_work)
                self._expire()
                if self.sched.has_work:
                    running = len(self.sched.running)
                    try:
                        self.sched.step()
                    except Exception as err:  # a scheduler bug: fail what ran, keep serving
                        log.exception("scheduler step failed")
                        self._fail_running(err)
                    if self.metrics is not None and running:
                        self.metrics.batch_size.observe(running)
                self._settle()
                self._publish()
        except BaseException as err:
            self.fatal = f"{type(err).__name__}: {err}"
            log.exception("engine thread died")
        finally:
            for ticket in list(self._live.values()):
                if not ticket.request.done:
                    ticket.request.status = Status.CANCELLED
                self._end(ticket)
            self._drain_rejecting()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, ticket = cmd
            if kind == "submit":
                self._submit(ticket)
            elif ticket.request.id in self._live and not ticket.request.done:
                self.sched.cancel(ticket.request)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit(self, ticket: Ticket) -> None:
        req = ticket.request
        if time.monotonic() > ticket.deadline:
            ticket.timed_out = True
            self._unqueue(ticket)
            ticket.resolve(TimeoutError())
            return
        req.on_token = lambda r, tok, t=ticket: self._on_token(t, tok)
        try:
            self.sched.submit(req)
        except Exception as err:  # refused: too large, past the position limit, a bad prompt
            self._unqueue(ticket)
            ticket.resolve(err)
            return
        self._live[req.id] = ticket
        ticket.resolve(None)

    def _on_token(self, ticket: Ticket, token: int) -> None:
        if not ticket.started:
            self._unqueue(ticket)
            if self.metrics is not None and ticket.request.ttft_s is not None:
                self.metrics.ttft.observe(ticket.request.ttft_s)
        ticket.push(token)

    def _unqueue(self, ticket: Ticket) -> None:
        if not ticket.started:
            ticket.started = True
            with self._lock:
                self._queued -= 1

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket in list(self._live.values()):
            if now > ticket.deadline and not ticket.request.done:
                ticket.timed_out = True
                self.sched.cancel(ticket.request)

    def _fail_running(self, err: Exception) -> None:
        for req in [*self.sched.running, *self.sched.swapped]:
            req.error = f"{type(err).__name__}: {err}"
            self.sched.cancel(req)
            req.status = Status.FAILED

    def _settle(self) -> None:
        for ticket in [t for t in self._live.values() if t.request.done]:
            self._end(ticket)

    def _end(self, ticket: Ticket) -> None:
        req = ticket.request
        self._live.pop(req.id, None)
        self._unqueue(ticket)
        if self.metrics is not None:
            self.metrics.finished(req, ticket.timed_out)
        ticket.push(DONE)

    def _drain_rejecting(self) -> None:
        while True:
            try:
                kind, ticket = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._unqueue(ticket)
                ticket.resolve(ShuttingDown("the server is shutting down"))

    def _publish(self) -> None:
        s, pool = self.sched, self.sched.pool
        snap = Snapshot(
            waiting=len(s.waiting),
            running=len(s.running),
            swapped=len(s.swapped),
            pending=self._commands.qsize(),
            pool_used_bytes=pool.used_bytes(),
            pool_total_bytes=pool.held_bytes(),
            max_running=s.max_concurrent,
            decode_steps=s.decode_steps,
            store_hits=s.link_totals.hits,
            store_misses=s.link_totals.misses,
            store_corrupt=0 if s.store is None else s.store.stats.corrupt,
        )
        self.snapshot = snap
        if self.metrics is not None:
            self.metrics.publish(snap, self._queued)
