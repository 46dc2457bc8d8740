"""Real-text continuation perplexity: compress once after a long context, then teacher-force.

The protocol (``docs/benchmarks/README.md``):

1. cut real prose into windows of ``context + continuation`` tokens (:func:`text_windows`);
2. prefill the ``context`` tokens, letting the policy compress the cache **once** (no edit after);
3. feed the ``continuation`` tokens teacher-forced, in one chunk over the compressed cache, and
   take each token's NLL (:func:`continuation_nll`);
4. compare policies on the *same* windows with paired bootstrap intervals over windows
   (:func:`paired_delta`): ``ΔPPL = PPL(policy) / PPL(baseline) − 1``.

kvpress presses act during prefill only, so step 3 is exactly what its pipeline does and the two
libraries are measured on one footing (``vlkv.eval.peers.peer_continuation_nll``).
Text-only: policies see no image spans (A-VL's vision paths are not exercised here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.runtime.cache import Modality
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import Policy
from vlkv.runtime.prompt import EncodedPrompt, Spans, collate

__all__ = [
    "Window",
    "continuation_nll",
    "paired_delta",
    "ppl",
    "run_protocol",
    "text_windows",
]


@dataclass(frozen=True)
class Window:
    """One measurement window: ``context`` ids are compressed, ``continuation`` ids are scored.

    Attributes:
        source: where the text came from (e.g. ``"kjv:Judges"``) and the token offset.
        context: ``n`` token ids (no special tokens added).
        continuation: ``T`` token ids that follow ``context`` in the source.
    """

    source: str
    context: tuple[int, ...]
    continuation: tuple[int, ...]


def text_windows(
    tokenize: Callable[[str], list[int]],
    texts: Sequence[tuple[str, str]],
    per_text: int,
    context: int = 1024,
    continuation: int = 128,
) -> list[Window]:
    """``per_text`` non-overlapping windows from each ``(name, text)``, evenly spread over the text.

    Windows are interleaved text by text (window 0 of every text, then window 1 …), so the first
    ``k`` windows of the result cover every source. Raises ``ValueError`` when a text is too short.
    """
    if per_text < 1 or context < 1 or continuation < 1:
        raise ValueError("per_text, context and continuation must be >= 1")
    size = context + continuation
    per_source = []
    for name, text in texts:
        ids = tokenize(text)
        if len(ids) < per_text * size:
            raise ValueError(
                f"text {name!r} has {len(ids)} tokens, fewer than {per_text} windows of {size} need"
            )
        stride = (len(ids) - size) // max(per_text - 1, 1) if per_text > 1 else 0
        per_source.append(
            [
                Window(
                    f"{name}@{s}",
                    tuple(ids[s : s + context]),
                    tuple(ids[s + context : s + size]),
                )
                for s in (i * stride for i in range(per_text))
            ]
        )
    return [w for group in zip(*per_source) for w in group]


def _batch(windows: Sequence[Window], pad_id: int):
    prompts = []
    for w in windows:
        ids = torch.tensor(w.context, dtype=torch.long)
        n = ids.shape[0]
        prompts.append(
            EncodedPrompt(
                ids,
                torch.arange(n)[:, None],
                torch.full((n,), int(Modality.TEXT), dtype=torch.int8),
                {},
                Spans(n, []),
            )
        )
    return collate(prompts, pad_id)


@dataclass
class ContinuationResult:
    """Per-token NLL of a batch of windows and what the compressed cache held.

    Attributes:
        nll: ``(B, T)`` float32 NLL in nats; row ``b`` scores ``windows[b].continuation``.
        kv_bytes: K/V bytes held right after compression (the continuation's own entries excluded).
        full_kv_bytes: K/V bytes of the uncompressed context.
        meta_bytes: per-entry metadata bytes (positions, modality, scores) held after compression.
        peak_kv_bytes: K/V bytes held before the policy's edit (the prefill writes every entry).
    """

    nll: Tensor
    kv_bytes: int
    full_kv_bytes: int
    meta_bytes: int
    peak_kv_bytes: int


def _prefill_inputs(engine: Engine, batch):
    from vlkv.runtime.backend import StepInputs

    return StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
    )


def _continue(engine: Engine, cache, policy: Policy, first_logits: Tensor, windows) -> Tensor:
    """``(B, T)`` NLL of the continuations over ``cache`` (already compressed), no further edit."""
    from vlkv.runtime.backend import StepInputs

    cont = torch.tensor([w.continuation for w in windows], dtype=torch.long)
    b, t = cont.shape
    # positions follow the policy's mode (original / compacted), one per continuation token
    pos = engine.decode_positions(policy, cache) + torch.arange(t - 1)[None, :, None]
    step = engine.backend.step(
        StepInputs(
            cont[:, :-1],
            pos,
            torch.full((b, t - 1), int(Modality.GENERATED), dtype=torch.int8),
            torch.full((b,), t - 1, dtype=torch.long),
            all_logits=True,
        ),
        cache,
        None,
    )
    logits = torch.cat([first_logits[:, None].float(), step.logits.float()], 1)  # (B, T, V)
    nll = torch.nn.functional.cross_entropy(logits.reshape(b * t, -1), cont.reshape(-1), reduction="none")
    return nll.reshape(b, t)


def _check_lengths(windows: Sequence[Window]) -> None:
    lengths = {(len(w.context), len(w.continuation)) for w in windows}
    if len(lengths) != 1:
        raise ValueError(f"windows must share context/continuation lengths, got {sorted(lengths)}")


@torch.no_grad()
def continuation_nll(engine: Engine, windows: Sequence[Window], policy: Policy) -> ContinuationResult:
    """Compress each window's context once with ``policy``, then score its continuation.

    All windows must share context and continuation lengths (one padding-free batch).
    """
    _check_lengths(windows)
    batch = _batch(windows, engine.pad_id)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    peak = cache.full_kv_bytes()  # the step wrote every context entry before the policy's edit
    kv, meta = cache.kv_bytes(), cache.meta_bytes()
    return ContinuationResult(_continue(engine, cache, policy, out.logits, windows), kv, peak, meta, peak)


def _fixed_pool(engine: Engine, slots: int):
    """A pool that never grows, so it never compacts: a deep copy of a cache on it is independent
    (a growable pool remaps its owners' slot tables through weak references when it compacts)."""
    from vlkv.runtime.kv.pool import KVPool, PoolSpec

    return KVPool(PoolSpec.for_backend(engine.backend), slots + 8, grow=False)


def _freeze(x):
    """A hashable, value-equal key for a statistics request (tensors by content)."""
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), x.cpu().numpy().tobytes())
    if hasattr(x, "__dataclass_fields__"):
        return (type(x).__name__, *((k, _freeze(getattr(x, k))) for k in x.__dataclass_fields__))
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple, frozenset, set)):
        return (
            tuple(sorted(map(_freeze, x), key=repr))
            if isinstance(x, (set, frozenset))
            else tuple(map(_freeze, x))
        )
    return x


@torch.no_grad()
def shared_continuation_nll(
    engine: Engine, windows: Sequence[Window], policies: Sequence[Policy]
) -> list[ContinuationResult]:
    """:func:`continuation_nll` for several policies, one prefill per distinct statistics request.

    Policies that ask the same prefill statistics (e.g. one scorer at several budgets) and have no
    prefill filter share one forward pass; each edits its own copy of the cache. The result equals
    running :func:`continuation_nll` per policy (tested), at a fraction of the cost.
    """
    import copy

    from vlkv.runtime.engine import apply_edits

    _check_lengths(windows)
    batch = _batch(windows, engine.pad_id)
    ctx = engine.context(batch)
    rows = batch.input_ids.shape[1]
    groups: dict = {}
    for i, policy in enumerate(policies):
        if policy.prefill_filter(engine.new_cache(batch), ctx) is not None:
            key = ("unshared", i)
        else:
            key = ("request", _freeze(policy.prefill_request(ctx, rows)))
        groups.setdefault(key, []).append(i)
    results: list[ContinuationResult | None] = [None] * len(policies)
    for key, members in groups.items():
        if key[0] == "unshared":
            results[members[0]] = continuation_nll(engine, windows, policies[members[0]])
            continue
        base = engine.new_cache(
            batch, _fixed_pool(engine, len(windows) * (rows + len(windows[0].continuation)))
        )
        request = policies[members[0]].prefill_request(ctx, rows)
        out = engine.backend.step(_prefill_inputs(engine, batch), base, request)
        peak = base.full_kv_bytes()
        replays: dict = {}  # one replay per distinct request: kvzip at three budgets scores once
        for i in members:
            cache = copy.deepcopy(base) if i != members[-1] else base
            stats = copy.deepcopy(out.stats) if i != members[-1] else out.stats
            # query-agnostic policies (kvzip, kvgrad) score from a replay over the prefilled cache
            ask = getattr(policies[i], "replay_request", None)
            key = _freeze(ask(ctx) if ask is not None else None)
            if key not in replays:
                replays[key] = engine.replay(policies[i], ctx, batch, cache)
            stats.replay = replays[key]
            apply_edits(cache, policies[i].after_prefill(cache, stats, ctx))
            kv, meta = cache.kv_bytes(), cache.meta_bytes()
            nll = _continue(engine, cache, policies[i], out.logits, windows)
            results[i] = ContinuationResult(nll, kv, peak, meta, peak)
    return results


def ppl(nll: Tensor) -> float:
    """``exp`` of the mean NLL over every token of every window."""
    return math.exp(float(nll.double().mean()))


def paired_delta(
    nll: Tensor, base: Tensor, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """``PPL(nll) / PPL(base) − 1`` and its paired percentile-bootstrap interval over windows.

    Args:
        nll, base: ``(W, T)`` per-token NLL on the same windows (row ``w`` = window ``w``).

    Returns:
        ``(point, low, high)``; the same resampled windows are used for both sides.
    """
    if nll.shape != base.shape or nll.dim() != 2:
        raise ValueError(f"nll and base must both be (W, T), got {tuple(nll.shape)} and {tuple(base.shape)}")
    a, b = nll.double().mean(1), base.double().mean(1)  # equal T: the token mean is the window mean
    point = math.exp(float(a.mean() - b.mean())) - 1
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.shape[0], (n_boot, a.shape[0]), generator=g)
    boots = torch.exp(a[idx].mean(1) - b[idx].mean(1)) - 1
    lo, hi = torch.quantile(boots, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return point, float(lo), float(hi)


def run_protocol(
    engine: Engine,
    windows: Sequence[Window],
    configs: Sequence[tuple[str, Policy]],
    batch_size: int = 4,
    progress=None,
) -> dict[str, dict]:
    """Score each ``(label, policy)`` on every window; returns ``{label: {"nll": (W, T), ...}}``.

    Each entry also carries ``kv_bytes``, ``full_kv_bytes``, ``meta_bytes`` summed over windows,
    ``peak_kv_bytes`` (largest batch) and ``seconds`` (wall time shared evenly among the configs:
    configurations with equal prefill statistics share one prefill).
    """
    import time

    t0 = time.perf_counter()
    parts = [
        shared_continuation_nll(engine, windows[i : i + batch_size], [p for _, p in configs])
        for i in range(0, len(windows), batch_size)
    ]
    seconds = (time.perf_counter() - t0) / len(configs)
    out = {}
    for c, (label, policy) in enumerate(configs):
        mine = [part[c] for part in parts]
        out[label] = {
            "policy": policy.name,
            "budget": float(policy.budget),
            "nll": torch.cat([p.nll for p in mine]),
            "kv_bytes": sum(p.kv_bytes for p in mine),
            "full_kv_bytes": sum(p.full_kv_bytes for p in mine),
            "meta_bytes": sum(p.meta_bytes for p in mine),
            "peak_kv_bytes": max(p.peak_kv_bytes for p in mine),
            "seconds": seconds,
        }
        if progress:
            progress(label, out[label])
    return out
