"""A static decode step's statistics (``runtime/static_step.py``): its mode (one set of buffers and one graph
each) and, after the forward or a graph's replay, the step's :class:`~vlkv.runtime.backend.StepStats` from
the probabilities the statistics kernel left in the buffers (host-half work, outside what a graph
captures)."""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.runtime.backend import StepStats
from vlkv.runtime.static_buffers import StaticBuffers


def stats_mode(stats) -> str | None:
    """A step's statistics mode, one set of buffers (and one graph) each: None (no statistics),
    ``"probs"`` (the output from the statistics kernel's own read) or ``"exact"`` (the plain read's
    output as well: some request asked ``exact_output``)."""
    if stats is None:
        return None
    exact = stats.exact_output or any(sub.exact_output for sub in stats.extra.values())
    return "exact" if exact else "probs"


def step_stats(bufs: StaticBuffers, inputs, cache, stats) -> StepStats:
    """The step's :class:`StepStats` from ``bufs.probs`` after the forward: per layer the requested row
    sets' :class:`~vlkv.plugins.AttnStats` over the read table's ``C`` columns (``colsum (B, H, C)``, 0
    past each request's length; the scheduler trims them to each request's width), the values the eager
    step's ``StepContext.put_one_row_stats`` makes, each row set's computed for every layer at once
    (:func:`layers_stats`). Device ops and, where ``stats`` names rows, a read of them: host-half work,
    outside what a graph captures."""
    from vlkv.runtime.step_context import StepContext

    ctx = StepContext(cache, inputs, stats)
    held = bufs.visible()  # (L, B, 1 or H_kv, 1, C): the hole step's from its forward
    for name, req in ctx.requests.items():
        per = layers_stats(bufs.probs, held, ctx.one_rows[name], req.threshold, bufs.select)
        per = [st if req.wants(layer) else None for layer, st in enumerate(per)]
        if name:
            ctx.stats.extra[name] = per
        else:
            ctx.stats[:] = per
    return ctx.stats


def layers_stats(
    probs: Tensor, held: Tensor, rows: Tensor | None, threshold: float | None, select: Tensor | None = None
) -> list:
    """The eager step's ``attention_rows._one_row_stats`` of every layer in one call: ``probs (L, B,
    H_kv, G, C)``, ``held (L, B, 1 or H_kv, 1, C)`` bool the columns each row sees, ``rows (B, 1)`` bool
    (requests whose row is asked; None: every one), ``threshold`` as there → per layer an
    :class:`~vlkv.plugins.AttnStats` (``colsum (B, H, C)``, ``below`` / ``visible (B, H)``), views of
    the step's few tensors: a handful of ops a step where the eager step spends 8 a layer."""
    from vlkv.plugins import AttnStats
    from vlkv.runtime.attention_rows import _one_row_stats

    st = _one_row_stats(probs, held, rows, threshold)
    colsum = st.colsum
    if select is not None:  # the list's positions back to the columns they name (probabilities 0 past
        # each list: what lands on a padding position's column is 0)
        at = select.repeat_interleave(probs.shape[3], dim=2)  # (L, B, H, C), as the eager step's scatter
        colsum = torch.zeros_like(colsum).scatter_add_(3, at, colsum)
    belows = [None] * probs.shape[0] if st.below is None else st.below.unbind(0)
    return [AttnStats(c, lo, v) for c, lo, v in zip(colsum.unbind(0), belows, st.visible.unbind(0))]
