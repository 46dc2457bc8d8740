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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vlkv.runtime.cache import Modality
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import Policy
from vlkv.runtime.prompt import EncodedPrompt, Spans, collate

__all__ = [
    "ReferenceLogits",
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
        kl: ``(B, T)`` float64 KL(reference ‖ this run) per continuation token, when a reference was
            given (the full cache's logits on the same windows); else None.
        top1: ``(B, T)`` bool, this run's argmax == the reference's, when a reference was given.
        logits: ``(B, T, V)`` float32 continuation logits, only when asked (``keep_logits``).
    """

    nll: Tensor
    kv_bytes: int
    full_kv_bytes: int
    meta_bytes: int
    peak_kv_bytes: int
    kl: Tensor | None = None
    top1: Tensor | None = None
    logits: Tensor | None = None


def _score(logits: Tensor, windows, reference: Tensor | None, keep_logits: bool):
    """``(nll, kl, top1, logits)`` of ``logits (B, T, V)`` against the continuations and, when given,
    the reference logits ``(B, T, V)``."""
    from vlkv.eval.metrics import kl_divergence

    cont = torch.tensor([w.continuation for w in windows], dtype=torch.long)
    b, t = cont.shape
    flat = logits.reshape(b * t, -1)
    nll = torch.nn.functional.cross_entropy(flat, cont.reshape(-1), reduction="none").reshape(b, t)
    kl = top1 = None
    if reference is not None:
        if reference.shape != logits.shape:
            raise ValueError(
                f"reference logits {tuple(reference.shape)} do not match this run's {tuple(logits.shape)}"
            )
        ref = reference.reshape(b * t, -1)
        kl = kl_divergence(ref, flat).reshape(b, t)
        top1 = (ref.argmax(-1) == flat.argmax(-1)).reshape(b, t)
    return nll, kl, top1, (logits if keep_logits else None)


def _prefill_inputs(engine: Engine, batch):
    from vlkv.runtime.backend import StepInputs

    return StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
    )


def _continue(engine: Engine, cache, policy: Policy, first_logits: Tensor, windows) -> Tensor:
    """``(B, T, V)`` float32 logits of the continuations over ``cache`` (already compressed), no
    further edit; row ``t`` predicts continuation token ``t``."""
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
    return torch.cat([first_logits[:, None].float(), step.logits.float()], 1)


def _check_lengths(windows: Sequence[Window]) -> None:
    lengths = {(len(w.context), len(w.continuation)) for w in windows}
    if len(lengths) != 1:
        raise ValueError(f"windows must share context/continuation lengths, got {sorted(lengths)}")


@torch.no_grad()
def continuation_nll(
    engine: Engine,
    windows: Sequence[Window],
    policy: Policy,
    reference: Tensor | None = None,
    keep_logits: bool = False,
) -> ContinuationResult:
    """Compress each window's context once with ``policy``, then score its continuation.

    All windows must share context and continuation lengths (one padding-free batch).

    Args:
        reference: optional ``(B, T, V)`` logits of the full cache on the same windows: the result
            then carries per-token KL and top-1 agreement against it.
        keep_logits: return this run's ``(B, T, V)`` logits (to serve as a later reference).
    """
    _check_lengths(windows)
    batch = _batch(windows, engine.pad_id)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    peak = cache.full_kv_bytes()  # the step wrote every context entry before the policy's edit
    kv, meta = cache.kv_bytes(), cache.meta_bytes()
    logits = _continue(engine, cache, policy, out.logits, windows)
    nll, kl, top1, kept = _score(logits, windows, reference, keep_logits)
    return ContinuationResult(nll, kv, peak, meta, peak, kl, top1, kept)


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
    engine: Engine,
    windows: Sequence[Window],
    policies: Sequence[Policy],
    reference: Tensor | None = None,
    keep_logits: Sequence[int] = (),
) -> list[ContinuationResult]:
    """:func:`continuation_nll` for several policies, one prefill per distinct statistics request.

    Policies that ask the same prefill statistics (e.g. one scorer at several budgets) and have no
    prefill filter share one forward pass; each edits its own copy of the cache. The result equals
    running :func:`continuation_nll` per policy (tested), at a fraction of the cost.
    ``reference`` is as in :func:`continuation_nll`; ``keep_logits`` lists the policies (indices)
    whose logits the results keep.
    """
    import copy

    from vlkv.runtime.edits import apply_edits

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
            i = members[0]
            results[i] = continuation_nll(engine, windows, policies[i], reference, i in keep_logits)
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
            logits = _continue(engine, cache, policies[i], out.logits, windows)
            nll, kl, top1, kept = _score(logits, windows, reference, i in keep_logits)
            results[i] = ContinuationResult(nll, kv, peak, meta, peak, kl, top1, kept)
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


class ReferenceLogits:
    """The full cache's continuation logits per window, on disk, so KL and top-1 agreement can be
    taken against them by later runs and by other processes (kvpress's adapter reads the files).

    One ``(T, V)`` float32 file per window (``<dir>/<window source>.pt``): 25 MB for 128 tokens of a
    49k vocabulary, so keep ``dir`` out of the repository.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def path(self, window: Window) -> Path:
        return self.dir / (re.sub(r"[^A-Za-z0-9._=@-]+", "_", window.source) + ".pt")

    def has(self, windows: Sequence[Window]) -> bool:
        return all(self.path(w).is_file() for w in windows)

    def get(self, windows: Sequence[Window]) -> Tensor | None:
        """``(B, T, V)`` for ``windows``, or None when any window has no stored reference."""
        if not self.has(windows):
            return None
        rows = [torch.load(self.path(w), weights_only=True) for w in windows]
        for w, r in zip(windows, rows):
            if r.dim() != 2 or r.shape[0] != len(w.continuation):
                raise ValueError(
                    f"{self.path(w)} holds logits {tuple(r.shape)}, not ({len(w.continuation)}, V): "
                    "delete it to measure the reference again"
                )
        return torch.stack(rows)

    def put(self, windows: Sequence[Window], logits: Tensor) -> None:
        """Store ``logits (B, T, V)``, row ``b`` for ``windows[b]``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for w, row in zip(windows, logits):
            tmp = self.path(w).with_suffix(".tmp")
            torch.save(row.float().contiguous().clone(), tmp)
            tmp.replace(self.path(w))


def run_protocol(
    engine: Engine,
    windows: Sequence[Window],
    configs: Sequence[tuple[str, Policy]],
    batch_size: int = 4,
    progress=None,
    reference: ReferenceLogits | None = None,
) -> dict[str, dict]:
    """Score each ``(label, policy)`` on every window; returns ``{label: {"nll": (W, T), ...}}``.

    Each entry also carries ``kv_bytes``, ``full_kv_bytes``, ``meta_bytes`` summed over windows,
    ``peak_kv_bytes`` (largest batch) and ``seconds`` (wall time shared evenly among the configs:
    configurations with equal prefill statistics share one prefill).

    With ``reference``: a ``full`` policy among ``configs`` stores its logits there, and every
    configuration also gets ``kl`` ``(W, T)`` float64 and ``top1`` ``(W, T)`` bool against the stored
    full-cache logits (absent when no reference exists for some window).
    """
    import time

    full = [i for i, (_, p) in enumerate(configs) if p.name == "full"]

    def batch(ws):
        ref = reference.get(ws) if reference is not None else None
        if reference is not None and ref is None and full:
            # measure the reference first so every configuration of this batch is scored against it
            ref = continuation_nll(engine, ws, configs[full[0]][1], keep_logits=True).logits
            reference.put(ws, ref)
        return shared_continuation_nll(engine, ws, [p for _, p in configs], ref)

    t0 = time.perf_counter()
    parts = [batch(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)]
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
        if all(p.kl is not None for p in mine):
            out[label]["kl"] = torch.cat([p.kl for p in mine])
            out[label]["top1"] = torch.cat([p.top1 for p in mine])
        if progress:
            progress(label, out[label])
    return out
