"""Continuous batching: a stream of requests, each with its own policy, equals each run alone."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import RequestTooLarge, Scheduler

POLICIES = [
    ("full", {}),
    ("h2o", {"budget": 0.5}),
    ("snapkv", {"budget": 0.3}),
    ("local", {"budget": 0.4}),
    ("elastic", {"budget": 0.5}),
    ("vlcache", {"budget": 0.3}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("pyramidkv", {"budget": 0.4}),
]
TEXTS = [
    "Describe it.",
    "What colour is the sky in this one?",
    "Hi",
    "Count the objects, then name them all.",
]


def _stream(images, n: int = 32) -> list[tuple[Prompt, str, dict, int]]:
    """``n`` requests: different prompt lengths, 0-3 images, policies, budgets and lengths."""
    out = []
    for i in range(n):
        imgs = [images[(i + j) % len(images)] for j in range(i % 4)]
        name, kw = POLICIES[i % len(POLICIES)]
        out.append((Prompt(TEXTS[i % len(TEXTS)] + " " * (i % 3), imgs), name, kw, 2 + i % 5))
    return out


def _solo(engine, prompt, name, kw, max_new) -> list[int]:
    return engine.generate([prompt], make_policy(name, **kw), max_new, stop_at_eos=False).samples[0].token_ids


def _run_stream(engine, stream, pool_bytes=None, waves: int = 4, **kw):
    """Submit the stream in waves while earlier requests decode; returns the requests and the scheduler."""
    sched = Scheduler(engine, pool_bytes, **kw)
    reqs = [Request(p, make_policy(name, **kw), m, stop_at_eos=False) for p, name, kw, m in stream]
    per = len(reqs) // waves
    for w in range(waves):
        for r in reqs[w * per : (w + 1) * per if w < waves - 1 else None]:
            sched.submit(r)
        sched.step()  # these join while the earlier waves decode
        sched.step()
    sched.run()
    return reqs, sched


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_a_stream_of_requests_equals_each_request_alone(name, engines, images):
    engine = engines[name]
    stream = _stream(images)
    reqs, sched = _run_stream(engine, stream)
    assert sched.max_concurrent > 8  # really batched together
    for r, (p, pol, kw, m) in zip(reqs, stream):
        assert r.status is Status.FINISHED
        assert r.tokens == _solo(engine, p, pol, kw, m), f"{r.id}: {pol} {kw}"
    assert sched.pool.used_bytes() == 0  # everything freed


def test_a_small_pool_preempts_and_still_gives_every_request_its_tokens(engines, images):
    engine = engines["tiny-llava"]
    stream = [(Prompt("Describe the picture in detail.", [images[i % 3]]), "full", {}, 12) for i in range(6)]
    entry = sched_entry_bytes(engine)
    n = engine.encode([stream[0][0]]).lengths.item()
    # reservations may take twice the pool, so decoding outgrows it and requests are swapped out
    sched = Scheduler(engine, entry * (2 * n + 12), overcommit=2.0)
    reqs = [sched.submit(Request(p, make_policy(pol), m, stop_at_eos=False)) for p, pol, _, m in stream]
    while sched.has_work:
        sched.step()
        # swapped requests hold no slots; what the running ones report is what the pool has allocated
        assert sched.pool.used_bytes() == sum(r.cache.kv_bytes() for r in sched.running)
        assert all(r.cache.layers[0].offloaded is not None for r in sched.swapped)
    assert sum(r.preemptions for r in reqs) > 0
    for r, (p, pol, kw, m) in zip(reqs, stream):
        assert r.tokens == _solo(engine, p, pol, kw, m)
    assert sched.pool.used_bytes() == 0


def sched_entry_bytes(engine) -> int:
    be = engine.backend
    return 2 * be.num_kv_heads * be.head_dim * torch.empty((), dtype=be.dtype).element_size() * be.num_layers


def test_compressed_requests_admit_more_beside_each_other(engines, images):
    engine = engines["tiny-llava"]
    prompt = Prompt("Describe the picture in detail please.", [images[0]])
    n = engine.encode([prompt]).lengths.item()
    pool_bytes = sched_entry_bytes(engine) * 4 * (n + 8)

    def concurrency(name, **kw) -> int:
        sched = Scheduler(engine, pool_bytes)
        for _ in range(16):
            sched.submit(Request(prompt, make_policy(name, **kw), 8, stop_at_eos=False))
        sched.run()
        return sched.max_concurrent

    full, small = concurrency("full"), concurrency("snapkv", budget=0.2)
    assert full <= 4 and small >= 3 * full


def test_accounting_matches_the_pool_through_joins_evictions_and_cancellation(engines, images):
    engine = engines["tiny-llava"]
    sched = Scheduler(engine, sched_entry_bytes(engine) * 2000)
    seen = []
    reqs = [
        sched.submit(
            Request(Prompt(t, [images[i % 3]] * (i % 2)), make_policy(p, budget=0.4), 10, stop_at_eos=False)
        )
        for i, (t, p) in enumerate(zip(TEXTS * 2, ["h2o", "local", "snapkv", "elastic"] * 2))
    ]
    reqs[0].on_token = lambda r, t: seen.append(t)
    for i in range(6):
        sched.step()
        live = [r for r in sched.running if r.cache is not None]
        # entries plus the spare slots decode evictions hand to the next appends
        assert sched.pool.used_bytes() == sum(r.cache.kv_bytes() + r.cache.spare_bytes() for r in live)
        if i == 2:
            victim = reqs[3]
            held = victim.cache.kv_bytes() + victim.cache.spare_bytes()
            before = sched.pool.used_bytes()
            sched.cancel(victim)
            assert victim.status is Status.CANCELLED
            assert sched.pool.used_bytes() == before - held  # freed at once
    sched.run()
    assert seen == reqs[0].tokens  # streamed token by token
    assert sched.pool.used_bytes() == 0


@pytest.mark.parametrize("policy", ["h2o", "local"])
def test_an_evicting_decode_step_writes_only_its_new_tokens(policy, engines, images):
    engine = engines["tiny-llava"]
    sched = Scheduler(engine)
    reqs = [
        sched.submit(Request(Prompt(t, [images[0]]), make_policy(policy, budget=0.3), 8, stop_at_eos=False))
        for t in TEXTS[:3]
    ]
    sched.step()  # prefill all three, first decode step
    per_token = sched_entry_bytes(engine)
    for _ in range(4):
        before = sched.pool.bytes_written
        running = len(sched.running)
        sched.step()
        assert sched.pool.bytes_written - before == running * per_token  # O(new tokens), not O(cache)
    assert all(r.cache.kv_bytes() < r.final.get("full_kv_bytes", 10**12) for r in reqs if not r.done)


def test_a_request_larger_than_the_pool_is_refused_and_others_run_on(engines, images):
    engine = engines["tiny-llava"]
    sched = Scheduler(engine, sched_entry_bytes(engine) * 100)
    ok = sched.submit(Request(Prompt("Hi"), make_policy("full"), 4, stop_at_eos=False))
    sched.step()
    with pytest.raises(RequestTooLarge) as err:
        sched.submit(Request(Prompt("Describe. " * 30, [images[0]]), make_policy("full"), 4))
    msg = str(err.value)
    assert "\n" not in msg and "the pool holds 100" in msg and "KV entries per layer" in msg
    sched.run()
    assert ok.status is Status.FINISHED and len(ok.tokens) == 4


def test_a_prompt_past_the_position_limit_is_refused_before_any_compute(engines):
    from vlkv.runtime.limits import LimitError, position_limit

    engine = engines["tiny-llava"]
    limit = position_limit(engine.loaded)
    sched = Scheduler(engine)
    with pytest.raises(LimitError, match="past .* limit of"):
        sched.submit(Request(Prompt("Hi"), make_policy("full"), limit))
    assert not sched.has_work and sched.pool.used_bytes() == 0
