"""One generation request and its life cycle inside the scheduler."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from vlkv.runtime.cache import KVCache
from vlkv.runtime.link.spec import LinkSpec, LinkStats
from vlkv.runtime.policies import Policy
from vlkv.runtime.prompt import Prompt, PromptBatch
from vlkv.runtime.sampling import Sampler

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # submitted, not prefilled
    RUNNING = "running"  # in the decode batch
    SWAPPED = "swapped"  # preempted: K/V in host memory, resumes when the pool has room
    FINISHED = "finished"  # eos or max_new_tokens
    CANCELLED = "cancelled"
    FAILED = "failed"  # refused or broken mid-flight; ``error`` says why (other requests unaffected)


@dataclass
class Request:
    """A prompt, its policy and settings, and what generation produced so far.

    Attributes:
        prompt: the request's prompt (text + images).
        policy: the KV-cache policy acting on this request's cache only.
        max_new_tokens: generated tokens at most (>= 1).
        sampler: token choice (greedy by default); each request has its own generator.
        stop_at_eos: stop at the model's end-of-sequence tokens.
        on_token: streaming callback ``(request, token_id)``, called for every generated token.
        link: how the prefill reuses stored K/V (:class:`~vlkv.runtime.link.linker.LinkSpec`); None = none.
        tenant: whose stored records the request may link (and writes).
    """

    prompt: Prompt
    policy: Policy
    max_new_tokens: int = 32
    sampler: Sampler = field(default_factory=Sampler)
    stop_at_eos: bool = True
    on_token: Callable[[Request, int], None] | None = None
    link: LinkSpec | None = None
    tenant: str = "default"
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")

    # life cycle, written by the scheduler
    status: Status = field(default=Status.WAITING, init=False)
    error: str | None = field(default=None, init=False)
    exception: BaseException | None = field(default=None, init=False, repr=False)
    tokens: list[int] = field(default_factory=list, init=False)
    batch: PromptBatch | None = field(default=None, init=False, repr=False)
    cache: KVCache | None = field(default=None, init=False, repr=False)
    reserve: int = field(default=0, init=False)  # per-layer entries the scheduler budgets for it
    arrival_s: float = field(default_factory=time.perf_counter, init=False)
    first_token_s: float | None = field(default=None, init=False)
    finish_s: float | None = field(default=None, init=False)
    prefill_s: float = field(default=0.0, init=False)
    decode_steps: int = field(default=0, init=False)
    preemptions: int = field(default=0, init=False)
    # per-request accounting recorded before its slots are freed
    final: dict = field(default_factory=dict, init=False)
    peak_kv_bytes: int = field(default=0, init=False)
    usage: dict = field(default_factory=lambda: {"stored": 0.0, "used": 0.0, "full": 0.0}, init=False)
    extras: dict = field(default_factory=dict, init=False)
    link_stats: LinkStats | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED, Status.FAILED)

    @property
    def prompt_tokens(self) -> int:
        return int(self.batch.lengths[0]) if self.batch is not None else 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from a stored prefix or a linked record (not recomputed); 0 without
        linking. The server reports it as ``usage.prompt_tokens_details.cached_tokens``."""
        return 0 if self.link_stats is None else self.link_stats.reused_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s
