"""The read paths and probes ``bench_decode_bound.py`` switches between, and its per-step counters.

``DenseRead``: decode steps read K/V as before paged reads (a padded scratch copy per layer);
``HalvesRead``: statistics steps read by ``paged_probs``' two halves (before the fused kernel wrote
probabilities); ``AttnTimer``: the wall time of a step's paged attention calls; ``probe``: one untimed
step's aten ops and the K/V bytes it gathers into scratch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_peers import count_ops  # noqa: E402


class DenseRead:
    """Inside it, decode steps read K/V the way they did before paged reads: each layer's cache gathered
    into a padded scratch copy (``KVPool.read``), then attention over it (the "before" of the issue)."""

    def __enter__(self):
        from vlkv.runtime.step_context import StepContext

        self.real = StepContext.reads_paged
        StepContext.reads_paged = lambda self, layer, i: False
        return self

    def __exit__(self, *exc):
        from vlkv.runtime.step_context import StepContext

        StepContext.reads_paged = self.real


class HalvesRead:
    """Inside it, statistics decode steps read as before the fused kernel wrote probabilities: the two
    halves of ``paged_probs`` (probabilities, then P·V, per-head tables gathered), while steps without
    statistics keep the fused read (the "before" of ``--stats-halves``). The fused append-and-read
    (``paged_append``, which writes probabilities too) is off inside: every step appends in Python."""

    def __enter__(self):
        import vlkv.plugins.paged_append as paged_append
        import vlkv.plugins.paged_probs as paged_probs

        self.real, self.append = paged_probs.fused_decode_probs, paged_append.FUSED_APPEND
        paged_probs.fused_decode_probs = lambda *args, **kwargs: None
        paged_append.FUSED_APPEND = False
        return self

    def __exit__(self, *exc):
        import vlkv.plugins.paged_append as paged_append
        import vlkv.plugins.paged_probs as paged_probs

        paged_probs.fused_decode_probs = self.real
        paged_append.FUSED_APPEND = self.append


# a statistics decode step's paged reads (``paged_probs``): timed with ``ops.paged_attention``
_PROBS_CALLS = ("fused_decode_probs", "paged_decode_probs", "paged_decode_out")


class AttnTimer:
    """Inside it, the wall time of the decode steps' paged attention calls (``ops.paged_attention``, a
    statistics step's ``paged_probs`` calls, the fused append-and-read ``paged_append.append_attend``: the
    K/V read itself, every layer; the fused call's few-row write included) adds up in ``seconds``; 0 for a
    step that reads no paged call (the dense read)."""

    def __enter__(self):
        import vlkv.plugins as plugins
        import vlkv.plugins.ops as ops
        import vlkv.plugins.paged_append as paged_append
        import vlkv.plugins.paged_probs as paged_probs

        self.seconds, self.real = 0.0, ops.paged_attention
        self.fused = paged_append.append_attend
        self.probs = {name: getattr(paged_probs, name) for name in _PROBS_CALLS}

        def timer(fn):
            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t

            return timed

        timed = timer(self.real)
        ops.paged_attention = timed
        paged_append.append_attend = timer(self.fused)
        for name, fn in self.probs.items():
            setattr(paged_probs, name, timer(fn))
        self.cached = vars(plugins).get("paged_attention")
        if self.cached is not None:  # the package's lazy export, once resolved, is its own name
            plugins.paged_attention = timed
        return self

    def __exit__(self, *exc):
        import vlkv.plugins as plugins
        import vlkv.plugins.ops as ops
        import vlkv.plugins.paged_append as paged_append
        import vlkv.plugins.paged_probs as paged_probs

        ops.paged_attention = self.real
        paged_append.append_attend = self.fused
        for name, fn in self.probs.items():
            setattr(paged_probs, name, fn)
        if self.cached is not None:
            plugins.paged_attention = self.cached


def probe(step) -> dict:
    """One more (untimed) step, counted: aten ops dispatched and the K/V bytes copied into scratch
    (the CPU paged read's gathers, those of its statistics form ``paged_probs``, and ``KVPool.read``'s
    padded copies on the dense read)."""
    import vlkv.plugins.paged_cpu as paged_cpu
    import vlkv.plugins.paged_probs as paged_probs
    from vlkv.runtime.kv.pool import KVPool

    gathered = [0]
    real, real_read = paged_cpu._gather, KVPool.read

    def gather(pool, flat, out=None):
        gathered[0] += flat.numel() * pool.shape[-1] * pool.element_size()
        return real(pool, flat, out)

    def read(self, layer, ids, *args, **kwargs):
        gathered[0] += 2 * ids.numel() * self.spec.head_dim * self.spec.dtype.itemsize
        return real_read(self, layer, ids, *args, **kwargs)

    paged_cpu._gather, paged_probs._gather, KVPool.read = gather, gather, read
    try:
        ops = count_ops(step)
    finally:
        paged_cpu._gather, paged_probs._gather, KVPool.read = real, real, real_read
    return {"ops": ops, "gathered_bytes": gathered[0]}
