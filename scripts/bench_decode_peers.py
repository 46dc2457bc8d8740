"""transformers' side of ``bench_decode_bound.py``, and the counting helpers it shares with vlkv's side.

The peers decode from the K/V vlkv prefilled (its full cache equals transformers' prefill: the
exactness tests say so), copied into a ``StaticCache`` or a ``DynamicCache``: ``generate`` then
starts from a cache holding the prompt and runs only decode steps, so no configuration pays a
transformers prefill (at 8k × 4 that would be most of the run).
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    """aten ops ``fn()`` dispatches (what a profiler would list as calls; views and copies included)."""
    with torch.no_grad(), _Count() as counter:
        fn()
    return counter.ops


def repeat_stats(stats, rows: int):
    """A prefill's :class:`~vlkv.runtime.backend.StepStats` of one row, as ``rows`` identical rows."""
    from dataclasses import fields, is_dataclass, replace

    from vlkv.runtime.backend import StepStats

    def rep(x):
        if x is None:
            return None
        if torch.is_tensor(x):
            return x.repeat(rows, *([1] * (x.dim() - 1)))
        if is_dataclass(x):
            return replace(x, **{f.name: rep(getattr(x, f.name)) for f in fields(x)})
        if isinstance(x, (list, tuple)):
            return type(x)(rep(y) for y in x)
        return x

    out = StepStats([rep(s) for s in stats], {k: [rep(s) for s in v] for k, v in stats.extra.items()})
    out.replay = None if stats.replay is None else [rep(s) for s in stats.replay]
    return out


def peer_cache(pre, kind: str, max_len: int, config):
    """A transformers cache (``static`` or ``dynamic``) holding ``pre``'s prefilled K/V in every one of
    its ``--batch`` rows; a static cache sized ``max_len``."""
    from transformers import DynamicCache, StaticCache

    rows = pre.batch.input_ids.shape[0]
    cache = StaticCache(config=config, max_cache_len=max_len) if kind == "static" else DynamicCache()
    for i, layer in enumerate(pre.cache.layers):
        k, v = layer.attention_kv()  # (1, H_kv, T, D)
        cache.update(k.expand(rows, *k.shape[1:]).contiguous(), v.expand(rows, *v.shape[1:]).contiguous(), i)
    return cache


class _Stamp:
    """A stopping criterion that never stops: ``generate`` calls it once per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _cache_kw(model) -> str:
    """The keyword a transformers model takes its cache by (``cache`` from 5.x, ``past_key_values``
    before and deprecated after)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_steps(model, pre, kind: str, steps: int) -> dict:
    """``generate`` from ``pre``'s prefilled cache: the first token fed, ``steps + 1`` tokens out; the
    first step untimed, as vlkv's. Returns seconds per step, K/V bytes attended, tokens, counts."""
    from transformers import StoppingCriteriaList

    ids = torch.cat([pre.batch.input_ids, pre.first[:, None]], dim=1)  # (B, T + 1): all but the last cached
    total = ids.shape[1] + steps + 2
    cache = peer_cache(pre, kind, total, model.config.get_text_config())
    stamp = _Stamp()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **{_cache_kw(model): cache},
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([stamp]),
        )
    if len(stamp.times) != steps + 1:
        raise RuntimeError(f"transformers {kind}: {len(stamp.times)} step stamps, expected {steps + 1}")
    new = out[:, ids.shape[1] :]
    be_layers = len(pre.cache.layers)
    lay = pre.cache.layers[0]
    k, _ = lay.attention_kv()
    entry = 2 * k.shape[1] * k.shape[-1] * k.element_size()
    # the step attends the whole prefix (mean over the timed steps); a static cache reads its full
    # buffer under a mask, counted here as what it attends
    kv = be_layers * ids.shape[0] * (ids.shape[1] + 1 + steps / 2) * entry
    pos = torch.tensor([out.shape[1] - 1])
    ops = count_ops(lambda: model(input_ids=out[:, -1:], cache_position=pos, **{_cache_kw(model): cache}))
    return {
        "step_s": (stamp.times[-1] - stamp.times[0]) / steps,
        "kv_bytes": kv,
        "tokens": [new[:, i].tolist() for i in range(new.shape[1])],
        "ops": ops,
        "gathered_bytes": 0,
    }
