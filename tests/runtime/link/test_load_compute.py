"""Load ‖ compute: a request's store hits load on background threads while its misses go through the
vision tower and become records; the result is the sequential path's, bit for bit."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store import ContextStore

SPEC = LinkSpec("mpic", 2)


class GatedStore:
    """A store whose reads wait (up to ``wait_s``) until the vision tower has started: a read that
    ends after it proves the two overlapped; run in order, the read times out first."""

    def __init__(self, inner, started: threading.Event, events: list, wait_s: float):
        self.inner, self.started, self.events, self.wait_s = inner, started, events, wait_s

    def find(self, identity, tenant):
        self.events.append(("load-start", threading.current_thread().name))
        ok = self.started.wait(self.wait_s)
        self.events.append(("load-end" if ok else "load-timeout", threading.current_thread().name))
        return self.inner.find(identity, tenant)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _watch_vision(engine, monkeypatch, started, events):
    adapter = engine.backend.adapter
    real = adapter.image_features

    def features(vision):
        events.append(("vision", threading.current_thread().name))
        started.set()
        return real(vision)

    monkeypatch.setattr(adapter, "image_features", features)


def _stored(engine, tmp_path, images):
    """A disk store holding images 0 and 1 (made by a first request)."""
    engine.generate(
        [Prompt("Look.", images[:2])], make_policy("full"), 1, link=SPEC, store=ContextStore.open(tmp_path)
    )


def _link(engine, store, prompt, loader=None):
    batch = engine.encode([prompt])
    pool = engine.new_cache(batch).pool
    source = RecordSource.for_engine(engine, SegmentStore(pool), store)
    source.loader = loader
    cache = engine.new_cache(batch, pool=pool)
    out, stats = link_prefill(engine, batch, prompt.images, cache, SPEC, source)
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, 5):
        tokens.append(
            int(engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step).logits.argmax(-1))
        )
    return out, stats, tokens


def test_parallel_loads_give_the_sequential_result(engines, images, tmp_path):
    engine = engines["tiny-qwen2-vl"]
    _stored(engine, tmp_path / "store", images)
    prompt = Prompt("Two known, one new, in another order:", [images[1], images[2], images[0], images[1]])
    for name in ("seq", "par"):  # each run writes the new image back: give each its own copy
        shutil.copytree(tmp_path / "store", tmp_path / name)
    seq = _link(engine, ContextStore.open(tmp_path / "seq", host_bytes=0), prompt)
    with ThreadPoolExecutor(2) as loader:
        par = _link(engine, ContextStore.open(tmp_path / "par", host_bytes=0), prompt, loader)
    assert (par[1].hits, par[1].misses) == (seq[1].hits, seq[1].misses) == (3, 1)
    assert par[1] == seq[1]
    torch.testing.assert_close(par[0].logits, seq[0].logits, rtol=0, atol=0)
    assert par[2] == seq[2]


def test_hits_load_while_misses_compute(engines, images, tmp_path, monkeypatch):
    engine = engines["tiny-llava"]
    _stored(engine, tmp_path / "store", images)
    for name in ("a", "b"):  # each run writes the new image back: give each its own copy
        shutil.copytree(tmp_path / "store", tmp_path / name)
    prompt = Prompt("One known, one new:", [images[0], images[2]])
    started, events = threading.Event(), []
    _watch_vision(engine, monkeypatch, started, events)
    with ThreadPoolExecutor(2, thread_name_prefix="test-load") as loader:
        store = GatedStore(ContextStore.open(tmp_path / "a", host_bytes=0), started, events, wait_s=30)
        _, stats, _ = _link(engine, store, prompt, loader)
    assert (stats.hits, stats.misses) == (1, 1)
    kinds = [k for k, _ in events]
    assert kinds.count("load-end") == 1 and "load-timeout" not in kinds
    assert kinds.index("vision") < kinds.index("load-end")  # the read was in flight during the vision tower
    assert dict((k, t) for k, t in events)["load-start"].startswith("test-load")
    # in order (no loader) the same read cannot overlap: it waits in vain, then the tower runs
    started.clear()
    events.clear()
    store = GatedStore(ContextStore.open(tmp_path / "b", host_bytes=0), started, events, wait_s=0.2)
    _link(engine, store, prompt)
    assert [k for k, _ in events] == ["load-start", "load-timeout"] * 2 + ["vision"]  # hit, then miss


def test_the_scheduler_loads_on_its_own_threads(engines, images, tmp_path, monkeypatch):
    engine = engines["tiny-llava"]
    _stored(engine, tmp_path, images)
    started, events = threading.Event(), []
    _watch_vision(engine, monkeypatch, started, events)
    store = GatedStore(ContextStore.open(tmp_path, host_bytes=0), started, events, wait_s=30)
    prompt = Prompt("One known, one new:", [images[1], images[2]])
    res = engine.generate([prompt], make_policy("full"), 2, stop_at_eos=False, link=SPEC, store=store)
    assert (res.extras["store"]["hits"], res.extras["store"]["misses"]) == (1, 1)
    loads = [(k, t) for k, t in events if k != "vision"]
    assert [k for k, _ in loads] == ["load-start", "load-end"] and loads[0][1].startswith("vlkv-load")


def test_store_lookups_never_run_on_the_engine_thread(engines, images, tmp_path):
    """A linking request's store reads (remote tiers: a network round trip each) run on the loader
    threads while it waits for admission; the engine thread only takes their answers."""
    import threading

    from vlkv.runtime.request import Request, Status
    from vlkv.runtime.scheduler import Scheduler
    from vlkv.runtime.store import DiskTier

    engine_thread = threading.get_ident()
    calls: list[tuple[str, bool]] = []

    class WatchedDisk(DiskTier):  # a real disk tier that notes which thread asks it
        def get(self, key, touch=True):
            calls.append(("get", threading.get_ident() == engine_thread))
            return super().get(key, touch)

        def __contains__(self, key):
            calls.append(("contains", threading.get_ident() == engine_thread))
            return super().__contains__(key)

    engine = engines["tiny-llava"]
    prompts = [Prompt("Look.", [images[0]]), Prompt("Again, closer.", [images[0], images[1]])]
    engine.generate(prompts[:1], make_policy("full"), 1, link=SPEC, store=ContextStore.open(tmp_path))
    sched = Scheduler(engine, store=ContextStore([WatchedDisk(tmp_path, 1 << 30)]), link_threshold=0.0)
    busy = sched.submit(
        Request(Prompt("A stream already running."), make_policy("full"), 6, stop_at_eos=False)
    )
    sched.step()
    reqs = [sched.submit(Request(p, make_policy("full"), 2, stop_at_eos=False, link=SPEC)) for p in prompts]
    calls.clear()
    sched.run()
    assert busy.status is Status.FINISHED and all(r.status is Status.FINISHED for r in reqs)
    assert reqs[0].link_stats.hits == 1 and (reqs[1].link_stats.hits, reqs[1].link_stats.misses) == (1, 1)
    reads = [c for c in calls if c[0] == "get"]
    assert reads and not any(on_engine for _, on_engine in calls), calls
