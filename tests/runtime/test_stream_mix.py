"""Every policy in one stream on a fixed pool: preemption, a cancel, and each request's tokens equal
its solo run (the runtime's promise that batching never changes an answer)."""

from __future__ import annotations

import pytest

from tests.runtime.test_scheduler import sched_entry_bytes
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

# every registered policy, A-VL's selected attention, both AttentionPack paths, kvzip's per-head holes
# and its head-uniform form, the gradient variant, a decode cadence and every allocator
SPECS = [
    ("full", {}),
    ("local", {"budget": 0.4}),
    ("h2o", {"budget": 0.5}),
    ("snapkv", {"budget": 0.3}),
    ("knorm", {"budget": 0.4}),
    ("elastic", {"budget": 0.5}),
    ("pyramidkv", {"budget": 0.4}),
    ("vlcache", {"budget": 0.3}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("attnpack", {"rank": 4}),
    ("attnpack", {"rank": 4, "path": "b"}),
    ("kvzip", {"budget": 0.5}),
    ("kvgrad", {"budget": 0.5}),
    ("h2o", {"budget": 0.4, "evict_every": 3}),
    ("snapkv", {"budget": 0.4, "allocator": "pyramid"}),
    ("h2o", {"budget": 0.4, "allocator": "sparsity"}),
    ("kvzip", {"budget": 0.4, "heads": "own", "allocator": None}),
    ("local", {"budget": 0.5, "allocator": "uniform"}),
]
TEXTS = [
    "Describe it.",
    "What colour is the sky in this one?",
    "Hi",
    "Count the objects, then name them all.",
]


def _stream(images) -> list[tuple[Prompt, str, dict, int]]:
    """Two requests per setting: 0-2 images, four prompt lengths, 10-14 new tokens."""
    out = []
    for i, (name, kw) in enumerate(SPECS * 2):
        kw = {k: v for k, v in kw.items() if v is not None}
        imgs = [images[(i + j) % len(images)] for j in range(i % 3)]
        out.append((Prompt(TEXTS[i % len(TEXTS)], imgs), name, kw, 10 + i % 5))
    return out


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_every_policy_in_one_stream_on_a_fixed_pool_equals_each_solo_run(name, engines, images):
    engine = engines[name]
    stream = _stream(images)
    solo = [
        engine.generate([p], make_policy(pol, **kw), m, stop_at_eos=False).samples[0].token_ids
        for p, pol, kw, m in stream
    ]
    longest = max(int(engine.encode([p]).lengths[0]) for p, *_ in stream)
    # the longest prompt and a little more fit: prompts are written whole before their policies
    # compress them, so requests are admitted into what compression freed and decoding outgrows the
    # pool. Whether it outgrows it depends on the mix's order and sizes, so the pool shrinks until a
    # run preempts (adding a policy to SPECS must not quietly turn preemption off)
    for third in (3, 6, 16):
        pool_bytes = sched_entry_bytes(engine) * (longest + 8) * (third + 1) // third
        sched, reqs, victim = _run_stream(engine, stream, pool_bytes)
        _check_against_solo(sched, reqs, victim, stream, solo)
        if sum(r.preemptions for r in reqs) > 0:
            break
    assert sum(r.preemptions for r in reqs) > 0, "no pool size made the stream preempt"


def _run_stream(engine, stream, pool_bytes: int):
    """Half the stream, three steps, the other half, a cancel of one decoding request, then the rest."""
    sched = Scheduler(engine, pool_bytes, overcommit=2.0)
    reqs = [Request(p, make_policy(pol, **kw), m, stop_at_eos=False) for p, pol, kw, m in stream]
    half = len(reqs) // 2
    for r in reqs[:half]:
        sched.submit(r)
    for _ in range(3):
        sched.step()
    for r in reqs[half:]:  # the second half arrives while the first decodes
        sched.submit(r)
    sched.step()
    victim = next(r for r in sched.running if 1 < len(r.tokens) < r.max_new_tokens)
    sched.cancel(victim)
    assert victim.status is Status.CANCELLED
    sched.run()
    return sched, reqs, victim


def _check_against_solo(sched, reqs, victim, stream, solo) -> None:
    assert sched.max_concurrent >= 3 and sched.retried_steps == 0
    for r, (_, pol, kw, _), want in zip(reqs, stream, solo):
        if r is victim:
            continue
        assert r.status is Status.FINISHED, f"{r.id} {pol} {kw}: {r.error}"
        assert r.tokens == want, f"{r.id}: {pol} {kw}"
    assert sched.pool.used_bytes() == 0  # finished, cancelled and preempted requests left nothing
