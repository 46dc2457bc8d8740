"""Prompt + decode appends as one run of slots per request (growable pools): the run's spares are handed
out as one run, a batch decode that reads dense K/V gives each request's solo tokens, and spare slots
are never leaked."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def test_alloc_run_hands_out_one_run_and_keeps_the_stack():
    pool = KVPool(PoolSpec(num_layers=1, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu"))
    first = pool.alloc(0, 3)  # growable: grows, lowest ids first
    run = pool.alloc_run(0, 5)
    assert torch.equal(run, torch.arange(pool.capacity(0) - 5, pool.capacity(0)).expand(2, 5))
    assert not bool((run[:, :, None] == first[:, None, :]).any())
    free_before = pool.free_slots(0)
    more = pool.alloc(0, free_before)  # every other free id is still handed out, none of the run's
    assert not bool(torch.isin(more, run).any())
    pool.release(0, run)
    assert pool.free_slots(0) == 5


@pytest.fixture
def prompts(images):
    return [Prompt("Describe the picture in detail.", [images[0]]) for _ in range(3)]


def test_batch_decode_of_runs_equals_each_solo_run(engines, prompts):
    # A-VL's selected attention (core-only decode) still reads dense K/V (a gather of every request's
    # run); plain and statistics decode steps read the pool through its tables
    # (tests/runtime/test_paged_read.py)
    engine = engines["tiny-llava"]
    policy = make_policy("avl", budget=1.0, core=0.3)
    got = engine.generate(prompts, policy, 8, stop_at_eos=False)
    solo = engine.generate(prompts[:1], policy, 8, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [solo.samples[0].token_ids] * len(prompts)


def test_ragged_and_evicting_requests_fall_back_and_leak_nothing(engines, images, monkeypatch):
    from vlkv.runtime.request import Request
    from vlkv.runtime.scheduler import Scheduler

    engine = engines["tiny-llava"]
    ragged = [
        Prompt("Hi.", []),
        Prompt("Describe the picture.", [images[1]]),
        Prompt("Tell me more please.", []),
    ]
    for policy in (make_policy("full"), make_policy("h2o", budget=0.5)):
        sched = Scheduler(engine)
        reqs = [
            sched.submit(Request(p, policy, max_new_tokens=4 + 3 * i, stop_at_eos=False))
            for i, p in enumerate(ragged)
        ]
        sched.run()
        assert all(r.error is None and len(r.tokens) == r.max_new_tokens for r in reqs)
        assert sched.pool.used_bytes() == 0  # prompts, appends and unused spare slots all released
