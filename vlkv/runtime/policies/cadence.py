"""Decode cadence: run a policy's decode-time eviction every N steps instead of every step.

An evicting decode step pays for ranking every entry of every layer; doing it every ``N`` steps
lets the cache grow by at most ``N - 1`` entries past its target in between, and each eviction
then removes the surplus at once. Statistics are still folded in at every step (the wrapped
policy's :meth:`~vlkv.runtime.policies.base.Policy.observe`), so H2O's accumulated attention is
the same as without the wrapper; ``every = 1`` is exactly the wrapped policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vlkv.runtime.policies.base import Policy


@dataclass
class Cadence(Policy):
    """Wraps a policy that evicts while decoding; its decode edits run when ``step % every == 0``.

    Attributes:
        inner: the wrapped policy (``h2o``, ``local``, or either with an allocator).
        every: decode steps between evictions, >= 1.
    """

    inner: Policy = field(default_factory=Policy)
    every: int = 1

    name: ClassVar[str] = "cadence"

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"evict_every must be an integer >= 1, got {self.every!r}")
        inner = self.inner
        if not inner.evicts_during_decode:
            raise ValueError(
                f"evict_every needs a policy that evicts while decoding; {inner.name!r} compresses once"
            )
        if not inner.can_defer_edits:
            raise ValueError(
                f"evict_every is not available for {inner.name!r}: its decode edits keep their own schedule"
            )
        self.budget, self.positions = inner.budget, inner.positions
        super().__post_init__()
        # instance attributes shadow the class-level ones the engine and reports read
        self.name = inner.name if self.every == 1 else f"{inner.name}+every{self.every}"
        self.evicts_during_decode = True
        self.can_defer_edits = True
        # batched over requests as the inner policy is, at the same step when the cadence reads it
        mode = inner.cohort_decode
        self.cohort_decode = mode if self.every == 1 or mode is None else "same_step"
        self.cohort_state, self.cohort_readonly = inner.cohort_state, inner.cohort_readonly

    def prefill_request(self, ctx, rows):
        return self.inner.prefill_request(ctx, rows)

    def decode_request(self, cache, ctx):
        return self.inner.decode_request(cache, ctx)

    def prefill_filter(self, cache, ctx):
        return self.inner.prefill_filter(cache, ctx)

    def decode_attend(self, cache, ctx):
        return self.inner.decode_attend(cache, ctx)

    def after_prefill(self, cache, stats, ctx):
        return self.inner.after_prefill(cache, stats, ctx)

    def observe(self, cache, stats, ctx):
        self.inner.observe(cache, stats, ctx)

    def after_decode(self, cache, stats, ctx):
        if ctx.step % self.every == 0:
            return self.inner.after_decode(cache, stats, ctx)
        self.inner.observe(cache, stats, ctx)
        return None
