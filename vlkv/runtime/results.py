"""What a generation returns: each prompt's tokens and text, the batch's cache cost, and the K/V entries
held and attended over the decode steps (``Engine.generate``'s result)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from vlkv.runtime.cache import KVCache


@dataclass
class SampleResult:
    """One prompt's generation. ``kept_per_layer[l]`` = entries layer ``l`` holds at the end;
    ``cached_tokens``: prompt tokens reused from a stored prefix or linked record (not recomputed)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    kept_per_layer: list[int]
    cached_tokens: int = 0


@dataclass
class GenerationResult:
    """A batch's generation plus what the cache cost.

    ``kv_bytes``: bytes the K/V tensors hold (capacity, padding included); ``kv_bytes_used``:
    bytes of valid entries; ``full_kv_bytes``: what an uncompressed cache of every processed token
    would hold. Times are wall-clock seconds.

    ``extras`` always has ``kv_stored_fraction`` and ``kv_used_fraction``: over the decode steps, the
    K/V entries held and the entries attended, as fractions of an uncompressed cache (A-VL's
    Table 3; None without decode steps). ``cache_hit_rate`` is added when requested.
    """

    samples: list[SampleResult]
    policy: str
    budget: float
    kv_bytes: int
    kv_bytes_used: int
    full_kv_bytes: int
    peak_kv_bytes: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    extras: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class KVUsage:
    """K/V entries held ("stored") and attended ("used") over decode steps, against the entries an
    uncompressed cache would hold (A-VL's Table 3 reports both fractions)."""

    stored: float = 0.0
    used: float = 0.0
    full: float = 0.0

    def add(self, cache: KVCache, attended: Tensor | None) -> None:
        """Count one step; call after the step's append, before the policy's edits."""
        stored = float(cache.lengths().sum())
        self.stored += stored
        self.used += float(attended.sum()) if attended is not None else stored
        self.full += float(cache.processed.sum()) * len(cache.layers)

    def fractions(self) -> dict[str, float | None]:
        if not self.full:
            return {"kv_stored_fraction": None, "kv_used_fraction": None}
        return {"kv_stored_fraction": self.stored / self.full, "kv_used_fraction": self.used / self.full}
