"""Prometheus metrics of one server, in a private registry (two servers in one process never clash).

Gauges are set from the engine thread's :class:`~vlkv.serve.engine_loop.Snapshot`, never read from
the scheduler across threads. The context-store gauges count image hits and misses of linked requests
and corrupt records the store refused (0 without ``--store``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlkv.runtime.request import Status

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self, model: str):
        r = self.registry = CollectorRegistry()
        self.model = model
        self.queue_depth = Gauge("vlkv_queue_depth", "Requests accepted and not yet prefilled", registry=r)
        self.running = Gauge("vlkv_running_requests", "Requests in the decode batch", registry=r)
        self.swapped = Gauge("vlkv_swapped_requests", "Requests preempted to host memory", registry=r)
        self.max_running = Gauge(
            "vlkv_max_running_requests", "Most requests decoded together since start", registry=r
        )
        self.pool_used = Gauge("vlkv_pool_used_bytes", "KV pool bytes of allocated slots", registry=r)
        self.pool_total = Gauge("vlkv_pool_total_bytes", "KV pool bytes held (the pool's size)", registry=r)
        self.decode_steps = Gauge("vlkv_decode_steps", "Batched decode steps since start", registry=r)
        self.store = {
            k: Gauge(f"vlkv_store_{k}", f"Context-store image {k} of linked requests", registry=r)
            for k in ("hits", "misses", "corrupt")
        }
        self.requests = Counter(
            "vlkv_requests", "Requests by outcome", ["outcome"], registry=r
        )  # exported as vlkv_requests_total
        self.rejected = Counter(
            "vlkv_rejected_requests", "Requests refused before running", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("vlkv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("vlkv_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "vlkv_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "vlkv_time_per_output_token_seconds",
            "Mean time between tokens after the first, per request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vlkv_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "vlkv_decode_batch_size", "Running requests per scheduler step", buckets=BATCH_BUCKETS, registry=r
        )

    def publish(self, snap, queued: int) -> None:
        self.queue_depth.set(queued)
        self.running.set(snap.running)
        self.swapped.set(snap.swapped)
        self.max_running.set(snap.max_running)
        self.pool_used.set(snap.pool_used_bytes)
        self.pool_total.set(snap.pool_total_bytes)
        self.decode_steps.set(snap.decode_steps)
        for k in ("hits", "misses", "corrupt"):
            self.store[k].set(getattr(snap, f"store_{k}"))

    def finished(self, req, timed_out: bool) -> None:
        outcome = "timeout" if timed_out else req.status.value
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(len(req.tokens))
        if req.status is Status.FINISHED and req.finish_s is not None:
            self.e2e.observe(req.finish_s - req.arrival_s)
            if len(req.tokens) > 1 and req.first_token_s is not None:
                self.tpot.observe((req.finish_s - req.first_token_s) / (len(req.tokens) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
