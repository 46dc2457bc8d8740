"""The server's settings: one dataclass, checked once at start (one-line ``ValueError`` per field)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(slots=True)
class ServeConfig:
    """What ``vlkv serve`` was started with.

    Attributes:
        model: built-in model name or checkpoint directory (the served model's id).
        pool_bytes: fixed KV pool in bytes (admission, preemption); None = sized from
            ``kv_memory_fraction`` once the model is loaded (a server's pool is always fixed).
        kv_memory_fraction: share in (0, 1] of the memory free after the model is loaded that the
            pool takes (None: :data:`~vlkv.runtime.kv.sizing.DEFAULT_KV_FRACTION`); not with ``pool_bytes``.
        allowed_media_dir: local image files are read only under this directory (resolved); None = refused.
        max_body_bytes: largest request body (HTTP 413 above).
        max_images: most images per request.
        max_image_bytes: largest encoded image.
        max_tokens: largest ``max_tokens`` a request may ask; also the chat default.
        max_queue: most requests accepted and not yet prefilled; more get 429 with ``Retry-After``.
        max_running: most requests decoded together (the scheduler's batch).
        request_timeout_s: a request still running after this long is cancelled (HTTP 504).
        policy, budget: the KV policy for requests that name none (``budget`` None: the default).
        store: context-store spec (directory, ``redis://`` or ``mooncake://``); None = no store.
        link, link_k, link_pick, link_r, link_deviation, store_budget, store_scorer, store_rank: how requests link stored
            images and write new records unless their ``vlkv`` field says otherwise
            (:class:`~vlkv.runtime.link.linker.LinkSpec`).
        link_threshold: link-check agreement in [0, 1] a method needs to link (None: the default).
    """

    model: str = "tiny-llava"
    pool_bytes: int | None = None
    kv_memory_fraction: float | None = None
    allowed_media_dir: str | None = None
    max_body_bytes: int = 32 * 2**20
    max_images: int = 8
    max_image_bytes: int = 16 * 2**20
    max_tokens: int = 256
    max_queue: int = 64
    max_running: int = 256
    request_timeout_s: float = 600.0
    policy: str = "full"
    budget: float | None = None
    store: str | None = None
    link: str = "none"
    link_k: int = 32
    link_pick: str | None = None
    # None: LinkSpec's default (one place holds them)
    link_r: float | None = None
    link_deviation: str | None = None
    store_budget: float | None = None
    store_scorer: str | None = None
    store_rank: int | None = None
    link_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_images",
            "max_image_bytes",
            "max_tokens",
            "max_queue",
            "max_running",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.pool_bytes is not None and self.pool_bytes < 1:
            raise ValueError(f"pool_bytes must be >= 1, got {self.pool_bytes}")
        if self.kv_memory_fraction is not None:
            from vlkv.runtime.kv.sizing import check_fraction

            if self.pool_bytes is not None:
                raise ValueError("give --pool-bytes or --kv-memory-fraction, not both")
            check_fraction(self.kv_memory_fraction)
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(f"request_timeout_s must be a finite number > 0, got {self.request_timeout_s}")
        if self.link_threshold is not None and not 0.0 <= self.link_threshold <= 1.0:  # NaN too
            raise ValueError(f"--link-threshold must be in [0, 1], got {self.link_threshold}")
        self.link_spec()  # one line naming a bad method, k, r, deviation or record budget
        if self.link != "none" and self.store is None:
            raise ValueError("--link needs --store (where the records live)")
        if self.allowed_media_dir is not None:
            if not os.path.isdir(self.allowed_media_dir):
                raise ValueError(f"allowed media dir not found: {self.allowed_media_dir}")
            self.allowed_media_dir = os.path.realpath(self.allowed_media_dir)

    def fixed_pool(self, spec, free: int, position_limit: int | None):
        """The server's fixed pool size (:class:`~vlkv.runtime.kv.sizing.PoolSize`) for a model whose
        pool layout is ``spec``, with ``free`` bytes free after loading it; ``pool_bytes`` when given."""
        from vlkv.runtime.kv.sizing import DEFAULT_KV_FRACTION, PoolSize, pool_size

        if self.pool_bytes is not None:
            return PoolSize(self.pool_bytes, free, self.pool_bytes / max(free, 1), None)
        fraction = DEFAULT_KV_FRACTION if self.kv_memory_fraction is None else self.kv_memory_fraction
        return pool_size(spec, fraction, free, self.max_running, position_limit)

    def link_spec(self, **overrides):
        """The server's :class:`LinkSpec`, with a request's ``overrides`` (None values ignored)."""
        from vlkv.runtime.link.spec import LinkSpec

        fields = {
            "method": self.link,
            "k": self.link_k,
            "pick": self.link_pick,
            "r": self.link_r,
            "deviation": self.link_deviation,
            "store_budget": self.store_budget,
            "store_scorer": self.store_scorer,
            "store_rank": self.store_rank,
        }
        # a request's unset (None) fields keep the server's settings, not LinkSpec's defaults
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return LinkSpec(**{k: v for k, v in fields.items() if v is not None})
