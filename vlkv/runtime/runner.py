"""The runner: executes a :class:`~vlkv.runtime.step_plan.StepPlan` on the engine's backend.

It runs what the plan says and nothing else: a prefill (plain, or through the
:class:`~vlkv.runtime.link_stage.LinkStage` for a linking request), or one backend call per decode
group. It never admits, preempts or emits; the scheduler's ``commit`` does, from the
:class:`StepOutputs` returned here. A decode group whose call raises is undone and its requests
rerun one by one, so only a request that fails alone is reported failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vlkv.runtime.backend import StepOutput
from vlkv.runtime.step_plan import DecodeGroup, StepPlan, decode_group, undo


@dataclass
class GroupRun:
    """One backend call that returned: its group and its output."""

    group: DecodeGroup
    out: StepOutput


@dataclass
class StepOutputs:
    """What running a plan produced.

    Attributes:
        prefill: the prefill's :class:`StepOutput` (None for a decode plan or a failed prefill).
        prefill_s: wall seconds of the prefill.
        runs: decode calls that returned (a retried group's requests as one run each).
        failed: ``(request, exception)`` for each request that failed alone (or whose failed step
            could not be undone).
        retried: decode groups that raised and were rerun one request at a time.
        run_s: wall seconds of the whole run.
    """

    prefill: StepOutput | None = None
    prefill_s: float = 0.0
    runs: list[GroupRun] = field(default_factory=list)
    failed: list[tuple[object, Exception]] = field(default_factory=list)
    retried: int = 0
    run_s: float = 0.0


class Runner:
    """Runs plans on ``engine`` (its backend), linking requests through ``link`` (a
    :class:`~vlkv.runtime.link_stage.LinkStage`) and making caches on ``pool``."""

    def __init__(self, engine, pool, link):
        self.engine, self.pool, self.link = engine, pool, link

    def run(self, plan: StepPlan) -> StepOutputs:
        t0 = time.perf_counter()
        outputs = StepOutputs()
        for req in plan.prefill:
            self._prefill(req, outputs)
        for group in plan.groups:
            self._decode(group, outputs)
        outputs.run_s = time.perf_counter() - t0
        return outputs

    def _prefill(self, req, outputs: StepOutputs) -> None:
        eng = self.engine
        try:
            req.cache = eng.new_cache(req.batch, pool=self.pool)
            if self.pool.grow:
                # the prompt and its decode appends as one run of slots: a batch reads a pool view
                for layer in req.cache.layers:
                    layer.run_reserve = req.max_new_tokens
            t0 = time.perf_counter()
            if req.link is not None and req.link.method != "none":
                out = self.link.prefill(req)
            else:
                out = eng.prefill(req.batch, req.policy, req.cache)
            outputs.prefill_s = time.perf_counter() - t0
            outputs.prefill = out
        except Exception as err:  # one request's failure never stops the others
            outputs.failed.append((req, err))

    def _decode(self, group: DecodeGroup, outputs: StepOutputs) -> None:
        """One backend call over ``group``; if it raises, each request is retried alone (its appends
        undone first), so a request that cannot step fails without failing the others."""
        try:
            # a fixed pool: every layer's fresh slots of the step in one allocation (kv/pool_ahead.py);
            # what no layer took goes back before anything else (a retry's undo) runs
            self.pool.alloc_ahead()
            try:
                out = self.engine.backend.step(group.inputs, group.batch, group.stats)
            finally:
                self.pool.settle()
        except Exception as err:
            alive = []
            for i, e in enumerate(group.entries):
                try:
                    undo(group, i)
                    alive.append(e)
                except Exception as undo_err:  # a cache the failed step left unreadable fails alone
                    outputs.failed.append((e.request, undo_err))
            if len(group.entries) == 1:
                outputs.failed.extend((e.request, err) for e in alive)
                return
            outputs.retried += 1
            for e in alive:
                try:
                    single = decode_group(self.engine, [e])
                except Exception as plan_err:
                    outputs.failed.append((e.request, plan_err))
                    continue
                self._decode(single, outputs)
            return
        outputs.runs.append(GroupRun(group, out))
