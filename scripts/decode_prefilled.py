"""One prompt prefilled once and decoded per configuration: the fixture the decode-bound benchmarks share.

:class:`Prefilled` prefills a document + image + question once (batch of one, every policy's statistics
in the same pass) and copies it into each configuration's ``rows``-row cache; :func:`vlkv_steps` times
greedy decode steps of one configuration from that copy (``bench_decode_bound``, ``bench_decode_layer``,
``bench_layer_glue``, ``bench_step_cost``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from vlkv.runtime.backend import StepInputs
from vlkv.runtime.edits import apply_edits
from vlkv.runtime.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import document_prompt  # noqa: E402
from bench_decode import joint_request, stats_for  # noqa: E402
from bench_decode_peers import repeat_stats  # noqa: E402
from decode_reads import AttnTimer, DenseRead, probe  # noqa: E402


class Prefilled:
    """One prompt prefilled once (batch of one) and what each configuration starts from.

    batch: the ``--batch`` rows' :class:`PromptBatch`; one: the batch of one; cache: its prefilled full
    cache; stats: its prefill statistics (every policy kind's request as a named extra); first: ``(B,)``
    the first generated token."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        tokens: int,
        rows: int,
        policies: dict,
        layout: str = "document-first",
    ):
        from vlkv.runtime.prompt import collate

        be = engine.backend
        self.engine = engine
        self.one = document_prompt(engine, model, tokens, layout)
        self.batch = collate([self.one.prompts[0]] * rows, 0)
        ctx = engine.context(self.one)
        kinds = {}
        for key, pol in policies.items():
            kinds.setdefault(key.split("@")[0], pol)
        request, self.alias = joint_request(kinds, ctx, self.one.input_ids.shape[1])
        self.cache = engine.new_cache(self.one)
        one = self.one
        inputs = StepInputs(one.input_ids, one.positions, one.modality, one.lengths, be.embed(one))
        out = be.step(inputs, self.cache, request)
        # query-agnostic policies (kvzip, kvgrad) score by a replay over the prefilled cache: once per
        # kind on the batch of one, its scores repeated into the rows as the prefill statistics are
        self.replays, self.replay_s = {}, {}
        for kind, pol in kinds.items():
            t0 = time.perf_counter()
            got = engine.replay(pol, ctx, one, self.cache, inputs.inputs_embeds)
            if got is not None:
                out.stats.replay = got
                self.replays[kind] = repeat_stats(out.stats, rows).replay
                self.replay_s[kind] = time.perf_counter() - t0
        out.stats.replay = None
        self.stats = repeat_stats(out.stats, rows)
        self.first = out.logits.argmax(-1).expand(rows).clone()

    def cache_copy(self):
        """A ``--batch``-row cache (own pool) holding the prefilled entries in every row."""
        rows = self.batch.input_ids.shape[0]
        dst = self.engine.new_cache(self.batch)
        for a, b in zip(self.cache.layers, dst.layers):
            k, v = a.attention_kv()
            n = a.max_length

            def cols(t, n=n):  # (1, H_kv, S, ...) per-entry table → (rows, n, ...): its first head's
                return t[:, 0, :n].repeat(rows, *([1] * (t.dim() - 2)))

            b.append(
                k.expand(rows, *k.shape[1:]),
                v.expand(rows, *v.shape[1:]),
                cols(a.positions),
                cols(a.modality),
                a.lengths.repeat(rows),
                cols(a.order),
            )
        dst.processed = self.cache.processed.repeat(rows)
        return dst


def vlkv_steps(pre: Prefilled, policy, steps: int, budget_key: str | None, dense: bool = False) -> dict:
    """``steps + 1`` greedy decode steps of a configuration from its own copy of the prefill; the first
    (one-off table growth) untimed; ``dense``: read as before paged reads (:class:`DenseRead`).
    Returns seconds per step, K/V bytes attended per step, the tokens, the probe's counts."""
    if dense:
        with DenseRead():
            return vlkv_steps(pre, policy, steps, budget_key)
    eng = pre.engine
    cache = pre.cache_copy()
    if budget_key is not None:
        ctx = eng.context(pre.batch)
        stats = stats_for(pre.stats, pre.alias.get(budget_key, budget_key))
        stats.replay = pre.replays.get(budget_key)
        apply_edits(cache, policy.after_prefill(cache, stats, ctx))
    be = eng.backend
    entry = 2 * be.num_kv_heads * be.head_dim * torch.finfo(be.dtype).bits // 8
    tok, times, kv, tokens, attn = pre.first, [], [], [], []
    with AttnTimer() as timer:
        for step in range(steps + 1):
            timer.seconds = 0.0
            start = time.perf_counter()
            res = eng.decode(tok, pre.batch, policy, cache, step + 1)
            tok = res.logits.argmax(-1)
            if step:
                times.append(time.perf_counter() - start)
                attn.append(timer.seconds)
                kv.append(float(res.attended.sum()) * entry)
            tokens.append(tok.tolist())
    counts = probe(lambda: eng.decode(tok, pre.batch, policy, cache, steps + 2))
    cache.release()
    return {
        "step_s": statistics.mean(times),
        "attn_s": statistics.mean(attn),
        "kv_bytes": statistics.mean(kv),
        "tokens": tokens,
        **counts,
    }


def old_kept_but(last, s: int):
    """``ranking.kept_but`` before session 7: an int64 + bool broadcast sum (the same values)."""
    kept = torch.arange(s - 1, device=last.device)
    return (kept + (kept >= last)).expand(*last.shape[:2], s - 1)
