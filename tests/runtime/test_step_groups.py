"""Any mix of policies in one batch: read paths decide who shares a backend step, and a step that
raises is retried one request at a time, so one request's failure never fails the others."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vlkv.runtime.backend import AttendIndex, StatsRequest
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.full import FullPolicy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.step_groups import Entry, ReadPath, group_entries


def _solo(engine, prompt, name, kw, max_new) -> list[int]:
    return engine.generate([prompt], make_policy(name, **kw), max_new, stop_at_eos=False).samples[0].token_ids


def _entry(path: ReadPath, threshold: float | None = None, stats: bool = True) -> Entry:
    return Entry(object(), None, StatsRequest(threshold=threshold) if stats else None, None, path)


def test_groups_keep_selection_apart_from_holes_and_rank_space_and_plain_rows_ride_along():
    sel, holes, rank, plain = (
        ReadPath(selected=True),
        ReadPath(holes=True),
        ReadPath(rank_space=True),
        ReadPath(),
    )
    a, b = _entry(sel), _entry(holes)
    c, d = _entry(plain, stats=False), _entry(rank, stats=False)
    e = _entry(plain, threshold=0.01)
    groups = group_entries([a, b, c, d, e])
    assert [[x in g for x in (a, b, c, d, e)] for g in groups] == [
        [True, False, True, False, False],  # the selecting row, and the plain rider
        [False, True, False, True, False],  # holes beside rank-space factors: both read whole caches
        [False, False, False, False, True],  # another statistics threshold
    ]
    # with only selecting groups, a rider that must read whole caches gets a step of its own
    assert group_entries([_entry(sel), _entry(holes, stats=False)])[1][0].path == holes
    assert len(group_entries([_entry(plain, stats=False)] * 3)) == 1


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_avl_core_kvzip_and_full_in_one_batch_equal_their_solo_runs(name, engines, images):
    # the reproduction: A-VL's selected attention beside kvzip's per-head holes failed all three
    engine = engines[name]
    specs = [
        ("avl", {"budget": 0.5, "core": 0.3}),
        ("kvzip", {"budget": 0.5}),
        ("full", {}),
        ("attnpack", {"rank": 4, "path": "b"}),
        ("kvgrad", {"budget": 0.4}),
    ]
    prompts = [Prompt("Describe it.", [images[i % 3]]) for i in range(len(specs))]
    sched = Scheduler(engine)
    reqs = [
        sched.submit(Request(p, make_policy(n, **kw), 5, stop_at_eos=False))
        for p, (n, kw) in zip(prompts, specs)
    ]
    sched.run()
    assert sched.max_concurrent == len(specs)
    assert sched.retried_steps == 0  # grouped by read path up front, nothing raised
    for r, p, (n, kw) in zip(reqs, prompts, specs):
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == _solo(engine, p, n, kw, 5), n
    assert sched.pool.used_bytes() == 0


@dataclass
class _Broken(FullPolicy):
    """A full-cache policy whose attend lists go out of range from decode step ``at`` on: the
    backend raises inside a batched step, after the step has written into every cache."""

    at: int = 2

    def decode_attend(self, cache, ctx):
        if ctx.step < self.at:
            return None
        h = cache.layers[0].kv_heads
        bad = AttendIndex(torch.full((1, h, 1), 10**6, dtype=torch.long), torch.ones(1, h, dtype=torch.long))
        return [bad] * len(cache.layers)


@dataclass
class _Refuses(FullPolicy):
    """A policy that raises when asked what its next decode step needs."""

    def decode_request(self, cache, ctx):
        if ctx.step >= 2:
            raise RuntimeError("injected policy failure")
        return None


@pytest.mark.parametrize("broken", [_Broken, _Refuses])
def test_a_request_that_fails_alone_fails_alone(broken, engines, images):
    engine = engines["tiny-llava"]
    specs = [
        ("full", {}),
        ("h2o", {"budget": 0.5}),
        ("local", {"budget": 0.4}),
        ("avl", {"budget": 0.5, "core": 0.3}),
    ]
    prompts = [Prompt("Describe it.", [images[i % 3]]) for i in range(len(specs) + 1)]
    sched = Scheduler(engine)
    bad = Request(prompts[-1], broken(), 6, stop_at_eos=False)
    reqs = [
        sched.submit(Request(p, make_policy(n, **kw), 6, stop_at_eos=False))
        for p, (n, kw) in zip(prompts, specs)
    ]
    sched.submit(bad)
    sched.run()
    assert bad.status is Status.FAILED and len(bad.tokens) == 2, bad.error  # its first tokens came out
    if broken is _Broken:
        assert sched.retried_steps == 1  # the batched step raised once; its rows were rerun alone
    for r, p, (n, kw) in zip(reqs, prompts, specs):
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == _solo(engine, p, n, kw, 6), n
    assert sched.pool.used_bytes() == 0
