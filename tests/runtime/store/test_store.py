"""The context store: damage is a counted miss on every tier, tenants never meet, LRU moves records
between tiers within their byte budgets, libraries expire or are shared."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from tests.runtime.store.helpers import FP, OTHER_FP, assert_same_record, make_record
from vlkv.runtime.store import SHARED_TENANT, ContextStore, DeviceTier, DiskTier, HostTier


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _store(tmp_path, host: int = 1 << 20, disk: int = 1 << 20, device: int = 0, **kw) -> ContextStore:
    tiers = [DeviceTier(device, "cpu")] if device else []
    tiers += [HostTier(host), DiskTier(tmp_path, disk)]
    return ContextStore(tiers, model_fingerprint=FP, **kw)


def _tier(store: ContextStore, name: str):
    return next(t for t in store.tiers if t.name == name)


def _only_in(store: ContextStore, name: str, key: str, value) -> None:
    """Leave ``key`` in tier ``name`` only, holding ``value``."""
    for tier in store.tiers:
        tier.delete(key)
    _tier(store, name).put(key, value)


def _flip(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10
    return bytes(bad)


def _other_layout(data: bytes) -> bytes:
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, 8, 99)
    return bytes(body) + hashlib.sha256(body).digest()


def test_round_trip_through_host_and_disk_and_a_restart(tmp_path):
    rec = make_record()
    store = _store(tmp_path)
    store.put(rec)
    got = store.get(rec.key, "alice")
    assert_same_record(rec, got)
    assert store.stats.tiers["host"].hits == 1 and store.stats.hits == 1
    size = len(rec.to_bytes())
    assert store.stats.tiers["host"].bytes_loaded == size
    assert store.stats.tiers["disk"].bytes_written == size  # written through: it survives a restart
    again = _store(tmp_path)
    assert_same_record(rec, again.get(rec.key, "alice"))
    assert again.stats.tiers["disk"].hits == 1 and rec.key in _tier(again, "host")  # promoted


DAMAGE = {
    "bit-flip": lambda rec: (rec.key, _flip(rec.to_bytes()), "corrupt"),
    "truncation": lambda rec: (rec.key, rec.to_bytes()[:-7], "corrupt"),
    "wrong-magic": lambda rec: (rec.key, b"XXXXXXXX" + rec.to_bytes()[8:], "corrupt"),
    "wrong-layout": lambda rec: (rec.key, _other_layout(rec.to_bytes()), "stale"),
    "wrong-model": lambda rec: (make_record(fp=OTHER_FP).key, make_record(fp=OTHER_FP).to_bytes(), "stale"),
    "wrong-record": lambda rec: (rec.key, make_record(content=b"other image").to_bytes(), "corrupt"),
}


@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_damage_is_a_counted_deleted_miss_then_rewritten(tmp_path, where, damage):
    rec = make_record()
    store = _store(tmp_path)
    key, data, counter = DAMAGE[damage](rec)
    _only_in(store, where, key, data)
    assert store.get(key, "alice") is None
    assert getattr(store.stats.tiers[where], counter) == 1 and getattr(store.stats, counter) == 1
    assert store.stats.misses == 1 and store.stats.hits == 0
    assert key not in _tier(store, where)  # deleted, never served again
    assert not (where == "disk" and (tmp_path / f"{key}.vkr").exists())
    store.put(rec)  # recomputed and rewritten: a hit from now on
    assert_same_record(rec, store.get(rec.key, "alice"))


def test_a_missing_file_is_a_miss(tmp_path):
    rec = make_record()
    store = ContextStore([DiskTier(tmp_path, 1 << 20)], model_fingerprint=FP)
    store.put(rec)
    os.unlink(tmp_path / f"{rec.key}.vkr")
    assert store.get(rec.key, "alice") is None
    assert (
        store.stats.misses == 1
        and store.stats.tiers["disk"].misses == 1
        and _tier(store, "disk").keys() == []
    )


def test_damage_in_a_fast_tier_falls_through_to_an_intact_copy(tmp_path):
    rec = make_record()
    store = _store(tmp_path)
    store.put(rec)
    _tier(store, "host").put(rec.key, _flip(rec.to_bytes()))
    assert_same_record(rec, store.get(rec.key, "alice"))
    assert store.stats.tiers["host"].corrupt == 1 and store.stats.tiers["disk"].hits == 1
    assert_same_record(rec, store.get(rec.key, "alice"))  # the intact copy was promoted back
    assert store.stats.tiers["host"].hits == 1


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_two_tenants_with_the_same_image_never_hit_across(tmp_path, where):
    store = _store(tmp_path, device=1 << 20)
    alice, bob = make_record("alice", seed=1), make_record("bob", seed=2)
    assert alice.key != bob.key and alice.identity == bob.identity
    value = alice if where == "device" else alice.to_bytes()
    _only_in(store, where, alice.key, value)
    assert store.get(bob.key, "bob") is None  # bob's key: absent everywhere
    assert store.get(alice.key, "bob") is None  # alice's key, asked by bob: refused
    assert store.stats.tiers[where].foreign == 1
    assert store.find(alice.identity, "bob") is None
    assert alice.key in _tier(store, where)  # alice's record stays alice's
    assert_same_record(alice, store.get(alice.key, "alice"))
    # alice's bytes copied under bob's key (the disk bug peers shipped): a key mismatch, never served
    _only_in(store, where, bob.key, value)
    assert store.get(bob.key, "bob") is None and bob.key not in _tier(store, where)
    store.put(bob)
    got = store.find(bob.identity, "bob")
    assert got.tenant == "bob" and got.key == bob.key


def test_lru_demotes_down_and_promotes_up_within_byte_budgets(tmp_path):
    recs = [make_record(content=bytes([i]), seed=i) for i in range(4)]
    one = recs[0].nbytes
    size = max(len(r.to_bytes()) for r in recs)  # headers differ by a byte or two
    store = _store(tmp_path, device=2 * one, host=2 * size, disk=3 * size)
    device, host, disk = store.tiers
    for r in recs[:3]:
        store.put(r)
    # device holds the two newest; the oldest went down to host; disk holds all three
    assert device.keys() == [recs[1].key, recs[2].key] and host.keys() == [recs[0].key]
    assert len(disk.keys()) == 3 and store.stats.tiers["device"].evictions == 1
    got = store.get(recs[0].key, "alice")  # host hit → moved up; device's LRU (1) goes down to host
    assert got is device.get(recs[0].key)  # the caller gets the device copy
    assert device.keys() == [recs[2].key, recs[0].key] and host.keys() == [recs[1].key]
    assert store.stats.tiers["host"].hits == 1
    store.put(recs[3])  # disk over budget: its least recently used file goes
    assert disk.bytes_used() <= 3 * size and len(disk.keys()) == 3
    assert device.bytes_used() <= 2 * one and host.bytes_used() <= 2 * size
    # a record bigger than a tier skips it; bigger than every tier, it is not stored
    small = _store(tmp_path / "small", device=one, host=1 << 20, disk=1 << 20)
    big = make_record(content=b"big", n=10)
    assert small.put(big) == ["host", "disk"]
    assert small.put(make_record(content=b"huge", n=100_000)) == []


def test_static_records_expire_and_are_deleted_everywhere(tmp_path):
    clock = Clock()
    store = _store(tmp_path, static_ttl_s=60, clock=clock)
    rec = make_record()
    store.put(rec)
    assert rec.expires == clock.now + 60
    clock.now += 59
    assert store.get(rec.key, "alice") is not None
    clock.now += 2
    assert store.get(rec.key, "alice") is None and store.stats.expired == 1
    assert all(rec.key not in t for t in store.tiers)


def test_the_shared_library_is_read_by_every_tenant_written_only_by_put_shared(tmp_path):
    store = _store(tmp_path, static_ttl_s=60, clock=Clock())
    shared = make_record(SHARED_TENANT, seed=5)
    with pytest.raises(ValueError, match="put_shared"):
        store.put(shared)
    with pytest.raises(ValueError, match="shared record"):
        store.put_shared(make_record("alice"))
    store.put_shared(shared)
    assert shared.expires is None  # operator-curated: no tenant expiry
    for tenant in ("alice", "bob"):
        got = store.find(shared.identity, tenant)
        assert got is not None and got.tenant == SHARED_TENANT
    own = make_record("alice", seed=6)
    store.put(own)
    assert store.find(own.identity, "alice").tenant == "alice"  # a tenant's own record comes first
    assert store.find(own.identity, "bob").tenant == SHARED_TENANT


def test_a_record_of_another_model_is_refused_on_put(tmp_path):
    with pytest.raises(ValueError, match="does not belong"):
        _store(tmp_path).put(make_record(fp=OTHER_FP))


def test_gc_removes_expired_corrupt_stale_over_budget_and_old_temp_files(tmp_path):
    clock = Clock()
    store = ContextStore([DiskTier(tmp_path, 1 << 20)], model_fingerprint=FP, clock=clock)
    disk = store.tiers[0]
    good = [make_record(content=bytes([i]), seed=i) for i in range(3)]
    for r in good:
        store.put(r)
    expired = make_record(content=b"e", expires=clock.now - 1)
    store.put(expired)
    bad = make_record(content=b"c")
    disk.put(bad.key, _flip(bad.to_bytes()))
    old = make_record(content=b"s", fp=OTHER_FP)
    disk.put(old.key, old.to_bytes())
    tmp = tmp_path / f".{good[0].key}.abc.tmp"
    tmp.write_bytes(b"half")
    os.utime(tmp, (0, 0))
    size = max(len(r.to_bytes()) for r in good)
    report = store.gc(max_bytes=2 * size)
    assert {k: report[k] for k in ("expired", "corrupt", "stale", "evicted", "temp")} == {
        "expired": 1, "corrupt": 1, "stale": 1, "evicted": 1, "temp": 1,
    }  # fmt: skip
    assert sorted(disk.keys()) == sorted(r.key for r in good[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r.key}.vkr" for r in good[1:])


def test_entries_list_headers_and_name_damaged_files(tmp_path):
    store = _store(tmp_path)
    a, b = make_record("alice"), make_record("bob", content=b"2")
    store.put(a)
    store.put(b)
    (tmp_path / f"{'e' * 64}.vkr").write_bytes(b"garbage!" * 4)
    _tier(store, "disk").refresh()
    disk = {e.key: e for e in store.entries() if e.tier == "disk"}
    assert disk[a.key].info.tenant == "alice" and disk[b.key].info.tenant == "bob"
    assert disk[a.key].nbytes == len(a.to_bytes())
    assert disk["e" * 64].info is None and "magic" in disk["e" * 64].problem
