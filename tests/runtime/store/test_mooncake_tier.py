"""The Mooncake tier against a real ``mooncake_master`` (TCP on 127.0.0.1, started and stopped by PID here).

The same must-holds as the Redis tier: records shared across processes, the master killed mid-run
and restarted, injected damage in every tier — a counted miss each time, never an exception.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.runtime.store.helpers import FP, OTHER_FP, make_record
from tests.runtime.store.servers import MooncakeMaster, mooncake_master_binary, run_share
from vlkv.runtime.store import ContextStore, DiskTier, HostTier, Record, Tier
from vlkv.runtime.store.mooncake_tier import MooncakeTier
from vlkv.runtime.store.remote import Backoff, remote_faults
from vlkv.runtime.store.url import open_store

try:  # CI installs it with the dev extra (and libibverbs1): a missing piece fails, it is never skipped
    import mooncake.store  # noqa: F401
except ImportError as exc:
    pytest.fail(
        f"cannot import mooncake.store ({exc}): pip install 'vlkv[store]'; apt-get install libibverbs1",
        pytrace=False,
    )
if mooncake_master_binary() is None:
    pytest.fail("no mooncake_master: pip install 'vlkv[store]'", pytrace=False)

PROCS, PER_PROC = 4, 250
SMALL = "&segment=32MiB&buffer=8MiB"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.stop(grace_s=1.0)  # slow to exit on SIGTERM: SIGKILL after the grace period


@pytest.fixture(scope="module")
def tier(master):
    t = MooncakeTier(
        f"127.0.0.1:{master.port}",
        f"http://127.0.0.1:{master.http_port}/metadata",
        segment_bytes=64 << 20,
        buffer_bytes=16 << 20,
        admin=f"http://127.0.0.1:{master.admin_port}",
    )
    yield t
    t.close()


def _same(a: Record, b: Record) -> bool:
    pairs = zip([*a.keys, *a.values, a.embeds, a.modality], [*b.keys, *b.values, b.embeds, b.modality])
    return a.key == b.key and a.tenant == b.tenant and all(torch.equal(x, y) for x, y in pairs)


def test_tier_protocol_round_trip(tier):
    assert isinstance(tier, Tier) and tier.victims(1 << 30) == []
    a, b = make_record(content=b"mc-a", seed=1), make_record(content=b"mc-b", seed=2)
    tier.put(a.key, a.to_bytes())
    tier.put(b.key, b.to_bytes())
    tier.put(a.key, a.to_bytes())  # a second write replaces (upsert), never errors
    assert a.key in tier and tier.get(a.key) == a.to_bytes()
    assert {a.key, b.key} <= set(tier.keys())
    assert tier.bytes_used() >= len(a.to_bytes()) + len(b.to_bytes())
    assert tier.delete(a.key) and not tier.delete(a.key) and a.key not in tier and tier.get(a.key) is None
    assert tier.faults.faults == 0, tier.faults


def test_store_over_mooncake_is_shared_and_verified(master, tier):
    store = open_store(master.url + SMALL, host_bytes=1 << 20, model_fingerprint=FP)
    assert [t.name for t in store.tiers] == ["host", "mooncake"]
    rec = make_record(content=b"shared", seed=3)
    assert store.put(rec) == ["host", "mooncake"]
    other = ContextStore([tier], model_fingerprint=FP)  # another client of the same pool
    got = other.get(rec.key, "alice")
    assert got is not None and _same(got, rec)
    assert other.get(rec.key, "bob") is None and other.stats.foreign == 1
    store.tiers[-1].close()


def test_processes_share_records(master):
    results = run_share(master.url + SMALL, PROCS, PER_PROC)
    assert len(results) == PROCS
    for r in results:
        assert r["lost"] == 0 and r["corrupt"] == 0 and r["faults"] == 0, r
        assert r["hits"] == PROCS * PER_PROC and r["others"] == (PROCS - 1) * PER_PROC, r


def test_master_killed_mid_run_then_restarted(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    try:
        t = MooncakeTier(
            f"127.0.0.1:{m.port}",
            f"http://127.0.0.1:{m.http_port}/metadata",
            segment_bytes=32 << 20,
            buffer_bytes=8 << 20,
            timeout_s=0.5,
            backoff=Backoff(base_s=0.05, max_s=0.5),
        )
        store = ContextStore([t], model_fingerprint=FP)
        recs = [make_record(content=f"k{i}".encode(), seed=i) for i in range(10)]
        for rec in recs:
            store.put(rec)
        assert all(store.get(r.key, "alice") is not None for r in recs)
        m.kill()
        deadline, calls = time.monotonic() + 10.0, 0
        while t.faults.faults == 0 or calls < 20:  # every call a miss; faults show once the client notices
            assert time.monotonic() < deadline, t.faults
            t0 = time.monotonic()
            assert store.get(recs[calls % 10].key, "alice") is None
            store.put(make_record(content=f"down{calls}".encode(), seed=calls))  # dropped, never raises
            assert time.monotonic() - t0 < 2 * t.timeout_s + 0.2
            calls += 1
        assert t.faults.down + t.faults.timeout >= 1
        m.start()
        deadline, fresh = time.monotonic() + 15.0, make_record(content=b"after", seed=99)
        while True:  # the master forgot every object; new records hit once the client has re-mounted
            store.put(fresh)
            if store.get(fresh.key, "alice") is not None:
                break
            assert time.monotonic() < deadline, t.faults
            time.sleep(0.1)
        assert t.faults.recoveries >= 1
        assert remote_faults(store)["mooncake"]["faults"] == t.faults.faults
        t.close()
    finally:
        m.stop(grace_s=1.0)


def test_master_down_at_start_is_a_miss():
    t0 = time.monotonic()
    store = open_store(
        "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:1/metadata&timeout=0.5", host_bytes=0
    )
    assert store.get(make_record().key, "alice") is None
    assert store.tiers[-1].faults.faults >= 1 and time.monotonic() - t0 < 3


def test_injected_faults_are_all_detected(tier, tmp_path):
    """1,050 damaged or mismatched records over host, disk and mooncake: every one a counted miss."""
    host, disk = HostTier(1 << 24), DiskTier(tmp_path / "disk", 1 << 26)
    store = ContextStore([host, disk, tier], model_fingerprint=FP)
    before = tier.faults.faults
    puts = {"host": host.put, "disk": disk.put, "mooncake": tier.put}
    rng = random.Random(1)
    kinds = ("bitflip", "truncate", "garbage", "wrong_model", "wrong_layout", "tenant_swap", "foreign")
    injected = dict.fromkeys(puts, 0)
    t0 = time.monotonic()
    for i in range(1050):
        assert time.monotonic() - t0 < 30, f"too slow: {i} faults in 30 s"
        name, kind = list(puts)[i % 3], kinds[(i // 3) % len(kinds)]
        good = make_record(content=f"mf{i}".encode(), seed=i, n=2)
        key, data = good.key, good.to_bytes()
        if kind == "bitflip":
            pos = rng.randrange(len(data) * 8)
            data = bytearray(data)
            data[pos // 8] ^= 1 << (pos % 8)
        elif kind == "truncate":
            data = data[: rng.randrange(1, len(data))]  # Mooncake stores no empty objects
        elif kind == "garbage":
            data = rng.randbytes(rng.randrange(1, 300))
        elif kind == "wrong_model":
            data = make_record(content=f"mf{i}".encode(), fp=OTHER_FP, seed=i, n=2).to_bytes()
        elif kind == "wrong_layout":
            from tests.runtime.store.test_redis_tier import _relayout

            data = _relayout(data)
        elif kind == "tenant_swap":
            data = make_record(tenant="bob", content=f"mf{i}".encode(), seed=i, n=2).to_bytes()
        else:
            bob = make_record(tenant="bob", content=f"mf{i}".encode(), seed=i, n=2)
            key, data = bob.key, bob.to_bytes()
        puts[name](key, bytes(data))
        injected[name] += 1
        assert store.get(key, "alice") is None, (i, name, kind)
        if i % 100 == 0:
            store.put(good)
            assert _same(store.get(good.key, "alice"), good)
    caught = {n: s.corrupt + s.stale + s.foreign for n, s in store.stats.tiers.items()}
    assert caught == injected and tier.faults.faults == before
