"""Tiers alone: byte budgets and LRU order, atomic disk writes, opaque ids, store paths refused in one line."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.runtime.store.helpers import FP, make_record
from vlkv.runtime.store import ContextStore, DeviceTier, DiskTier, HostTier, Record


def _key(i: int) -> str:
    return f"{i:064x}"


def test_host_tier_lru_within_budget():
    tier = HostTier(max_bytes=300)
    for i in range(3):
        tier.put(_key(i), bytes(100))
    assert tier.bytes_used() == 300 and tier.victims(0) == []
    tier.get(_key(0))  # 0 becomes the most recent
    assert tier.victims(100) == [_key(1)]
    tier.put(_key(3), bytes(150))  # the tier alone evicts what the store would have demoted
    assert tier.keys() == [_key(0), _key(3)] and tier.bytes_used() == 250
    with pytest.raises(TypeError):
        tier.put(_key(4), make_record())
    with pytest.raises(ValueError, match="exceeds the host tier's budget"):
        tier.put(_key(5), bytes(301))
    assert tier.keys() == [_key(0), _key(3)]  # a refused put evicts nothing


def test_device_tier_holds_records_on_its_device():
    rec = make_record()
    tier = DeviceTier(max_bytes=rec.nbytes, device="cpu")
    tier.put(rec.key, rec)
    got = tier.get(rec.key)
    assert isinstance(got, Record) and got.keys[0].device == torch.device("cpu")
    assert tier.bytes_used() == rec.nbytes and rec.key in tier


def test_disk_write_is_atomic_and_a_crash_leftover_is_never_read(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    data = make_record().to_bytes()
    key = make_record().key
    tier.put(key, data)
    # a writer killed mid-write leaves only its temp file: half a record under a name no read opens
    leftover = tmp_path / f".{key}.deadbeef.tmp"
    leftover.write_bytes(data[: len(data) // 2])
    again = DiskTier(tmp_path, max_bytes=1 << 20)
    assert again.keys() == [key] and again.get(key) == data
    assert again.bytes_used() == len(data)
    # a live writer's temp file is left alone; an old one is collected
    assert again.gc_temp(older_than_s=600) == 0 and leftover.exists()
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    assert again.gc_temp(older_than_s=600) == 1 and not leftover.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.vkr"]


def test_disk_lru_survives_reopen_and_budget_evicts_oldest(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=250)
    for i in range(2):
        tier.put(_key(i), bytes(100))
        os.utime(tier.file(_key(i)), (1000 + i, 1000 + i))
    tier = DiskTier(tmp_path, max_bytes=250)
    assert tier.keys() == [_key(0), _key(1)]
    tier.get(_key(0))  # read → touched → most recent, on disk too
    tier = DiskTier(tmp_path, max_bytes=250)
    assert tier.keys() == [_key(1), _key(0)]
    tier.put(_key(2), bytes(100))
    assert sorted(tier.keys()) == [_key(0), _key(2)] and not tier.file(_key(1)).exists()


def test_ids_are_opaque_hex_never_paths(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1000)
    for bad in ("../x", "a" * 63, "A" * 64, "/etc/passwd", ""):
        with pytest.raises(ValueError, match="record id"):
            tier.get(bad)
        with pytest.raises(ValueError, match="record id"):
            HostTier(10).put(bad, b"x")
    (tmp_path / "notes.txt").write_text("not a record")
    (tmp_path / "xyz.vkr").write_text("not a record id")
    assert DiskTier(tmp_path, max_bytes=1000).keys() == []


def test_store_paths_that_cannot_hold_a_store_are_one_line_errors(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, why in [(afile, "not a directory"), (afile / "sub", "not a directory")]:
        with pytest.raises(ValueError, match=why) as info:
            DiskTier(path, max_bytes=10)
        assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="does not exist"):
        DiskTier(tmp_path / "missing", max_bytes=10, create=False)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ValueError, match="max_bytes"):
        DiskTier(tmp_path, max_bytes=-1)


def test_an_unwritable_store_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # root ignores permission bits; /proc refuses new files even to root
    path = ro if os.geteuid() != 0 else "/proc"
    try:
        with pytest.raises(ValueError, match="not writable") as info:
            DiskTier(path, max_bytes=10)
        assert str(path) in str(info.value)
    finally:
        ro.chmod(0o700)


def _disk_store(tmp_path):
    return ContextStore([DiskTier(tmp_path / "store", 1 << 30)], model_fingerprint=FP)


def test_a_record_replaced_by_a_symlink_is_never_followed(tmp_path):
    store = _disk_store(tmp_path)
    (tier,) = store.tiers
    rec = make_record()
    store.put(rec)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(rec.to_bytes())  # even a valid record: a link is never a record file
    os.utime(outside, (1000, 1000))
    path = tier.file(rec.key)
    path.unlink()
    path.symlink_to(outside)
    assert rec.key not in tier and tier.head(rec.key) == (b"", 0)
    assert store.get(rec.key, "alice") is None and store.stats.corrupt == 1
    assert not path.is_symlink() and not path.exists()  # the link is gone ...
    assert (
        outside.read_bytes() == rec.to_bytes() and outside.stat().st_mtime == 1000
    )  # ... its target untouched
    fifo = tier.file(make_record(content=b"other").key)
    os.mkfifo(fifo)  # a FIFO would block a plain open: refused without waiting
    assert tier.get(fifo.name.removesuffix(".vkr")) == b""


def test_an_oversized_record_file_is_refused_from_its_header(tmp_path):
    store = _disk_store(tmp_path)
    (tier,) = store.tiers
    rec = make_record()
    store.put(rec)
    path = tier.file(rec.key)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(4 << 30)  # 4 GiB (sparse): the header still says the record's own size
    data = tier.get(rec.key)
    assert len(data) < size  # the header only, never the 4 GiB
    assert store.get(rec.key, "alice") is None and store.stats.corrupt == 1 and not path.exists()
    store.put(rec)  # recomputed and written again
    assert store.get(rec.key, "alice").key == rec.key
