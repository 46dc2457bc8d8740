"""What a decode group reads back once per step (``vlkv.runtime.step_reads``): the K/V bytes of
requests with per-head holes or low-rank factors come from that one read, and equal what the cache
counts layer by layer."""

from __future__ import annotations

from vlkv.runtime import step_reads
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

MIX = [  # holes (kvzip's head budgets), low-rank image K/V, and a dense request in one batch
    ("kvzip", {"budget": 0.5}),
    ("attnpack", {"rank": 4}),
    ("full", {}),
    ("h2o", {"budget": 0.5}),
]


def test_a_groups_kv_bytes_equal_the_caches_own_count(engines, images, monkeypatch):
    engine = engines["tiny-llava"]
    checked: list[str] = []
    plain = step_reads.GroupReads.kv_bytes

    def compared(self, i):
        got, cache = plain(self, i), self._caches[i]
        assert got == cache.kv_bytes(), (i, got, cache.kv_bytes())
        if not step_reads._dense(cache):
            checked.append("holes" if any(la.holes is not None for la in cache.layers) else "lowrank")
        return got

    monkeypatch.setattr(step_reads.GroupReads, "kv_bytes", compared)
    sched = Scheduler(engine)
    prompt = Prompt(f"{engine.placeholder}\nWhat is in the picture? Say it twice.", [images[0]], raw=True)
    reqs = [sched.submit(Request(prompt, make_policy(n, **kw), 6, stop_at_eos=False)) for n, kw in MIX]
    sched.run()
    assert all(r.status is Status.FINISHED for r in reqs), [r.error for r in reqs]
    assert "holes" in checked and "lowrank" in checked, sorted(set(checked))
