"""Linking on a fixed pool: admission counts the records a linking prefill makes, a pool too small
for them falls back to a plain prefill, and a failure at any step of linking leaves the pool as it
was (no slot without an owner)."""

from __future__ import annotations

import pytest

from vlkv.runtime.kv.pool import PoolFull
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.store import ContextStore

NEW = 3
SPECS = {
    "mpic": LinkSpec("mpic", 2),
    "compressed-factored": LinkSpec("mpic", 2, store_budget=0.5, store_scorer="stride", store_rank=4),
    "prefix": LinkSpec("prefix"),
}


def _bytes_per_slot(engine) -> int:
    b = engine.backend
    return 2 * b.num_kv_heads * b.head_dim * b.dtype.itemsize * b.num_layers


def _full(engine, prompt) -> list[int]:
    return engine.generate([prompt], make_policy("full"), NEW, stop_at_eos=False).samples[0].token_ids


def _request(prompt, spec) -> Request:
    return Request(prompt, make_policy("full"), NEW, stop_at_eos=False, link=spec, tenant="t1")


def test_a_linking_request_near_capacity_completes(engines, images):
    engine = engines["tiny-llava"]
    prompt = Prompt("What is it?", [images[0]])
    n = int(engine.encode([prompt]).lengths[0])
    # room for the prompt and its new tokens, not for the image's record beside it
    sched = Scheduler(engine, (n + NEW + 2) * _bytes_per_slot(engine), link_threshold=0.0)
    req = sched.submit(_request(prompt, SPECS["mpic"]))
    sched.run()
    assert req.status is Status.FINISHED, req.error
    assert "link_fallback" in req.extras and req.cached_tokens == 0
    assert req.tokens == _full(engine, prompt)
    assert sched.pool.used_bytes() == 0  # the fallback gave the records it could not finish back
    # a pool with room for the record links, then a second request hits it
    roomy = Scheduler(engine, (3 * n + NEW) * _bytes_per_slot(engine), link_threshold=0.0)
    first = roomy.submit(_request(prompt, SPECS["mpic"]))
    roomy.run()
    again = roomy.submit(_request(Prompt("And this?", [images[0]]), SPECS["mpic"]))
    roomy.run()
    assert "link_fallback" not in first.extras and again.cached_tokens > 0


def test_admission_waits_for_the_records_a_linking_request_makes(engines, images):
    """A running request holds part of the pool: a linking request whose prompt fits beside it but
    whose image record does not waits for it (instead of failing), then links."""
    engine = engines["tiny-llava"]
    busy = Prompt("Tell me a long story about the sea.")
    prompt = Prompt("What is it?", [images[1]])
    n_busy = int(engine.encode([busy]).lengths[0])
    n = int(engine.encode([prompt]).lengths[0])
    img = sum(b - a for a, b in engine.encode([prompt]).spans[0].image_spans)
    slots = n_busy + 8 + n + 1 + img  # the second prompt fits beside the first, its record does not
    sched = Scheduler(engine, slots * _bytes_per_slot(engine), link_threshold=0.0, overcommit=4.0)
    first = sched.submit(Request(busy, make_policy("full"), 8, stop_at_eos=False))
    second = sched.submit(_request(prompt, SPECS["mpic"]))
    sched.step()
    assert first.status is Status.RUNNING and second.status is Status.WAITING
    sched.run()
    assert first.status is second.status is Status.FINISHED, (first.error, second.error)
    assert "link_fallback" not in second.extras and second.link_stats.misses == 1


def _refs_clear(pool) -> bool:
    return all(int(r.sum()) == 0 for r in pool._refs)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("fault", [RuntimeError, PoolFull])
def test_a_failure_at_any_step_of_linking_leaves_the_pool_as_it_was(name, fault, engines, images, tmp_path):
    engine = engines["tiny-llava"]
    spec = SPECS[name]
    prompt = Prompt("Compare the two.", [images[0], images[1]])
    # one image is in the store (a load into the pool), the other is computed (a new record)
    prime = Scheduler(engine, store=ContextStore.open(tmp_path), link_threshold=0.0)
    prime.submit(_request(Prompt("First.", [images[0]]), spec))
    prime.run()
    prime.flush()
    plain = _full(engine, prompt)

    def run(fail_alloc: int = 0, fail_step: int = 0):
        sched = Scheduler(
            engine, 4096 * _bytes_per_slot(engine), store=ContextStore.open(tmp_path), link_threshold=0.0
        )
        before = sched.pool.used_bytes()
        counts = {"alloc": 0, "step": 0}
        alloc, step = sched.pool.alloc, engine.backend.step

        def failing_alloc(layer, n):
            counts["alloc"] += 1
            if counts["alloc"] == fail_alloc:
                raise fault(f"injected at allocation {fail_alloc}")
            return alloc(layer, n)

        def failing_step(*args, **kwargs):
            counts["step"] += 1
            if counts["step"] == fail_step:
                raise fault(f"injected at step {fail_step}")
            return step(*args, **kwargs)

        sched.pool.alloc = failing_alloc
        engine.backend.step = failing_step
        try:
            req = sched.submit(_request(prompt, spec))
            sched.run()
            sched.flush()
        finally:
            del engine.backend.step  # the class's method again
        sched.segments.release()
        assert sched.pool.used_bytes() == before and _refs_clear(sched.pool), (fail_alloc, fail_step)
        return req, counts

    clean, counts = run()
    assert clean.status is Status.FINISHED and clean.link_stats.hits >= (0 if name == "prefix" else 1)
    assert counts["alloc"] > 4 and counts["step"] >= NEW
    for i in range(1, counts["alloc"] + 1):
        req, _ = run(fail_alloc=i)
        if fault is PoolFull and req.status is Status.FINISHED and "link_fallback" in req.extras:
            assert req.tokens == plain, i  # the plain prefill's answer
    for i in range(1, counts["step"] + 1):
        run(fail_step=i)
