"""Compressed records: kept entries and their offsets round-trip exactly, the layout version marks
them (a pre-compression reader takes them for another layout), dense records are unchanged, and a
compressed record moves fewer bytes."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from tests.runtime.store.helpers import FP, assert_same_record, make_record
from vlkv.runtime.store import LAYOUT_VERSION, ContextStore, CorruptRecord, Record, StaleRecord
from vlkv.runtime.store.record import COMPRESSED, PREFIX_SIZE


def _compressed(rec: Record, keep: list[int]) -> Record:
    idx = torch.tensor(keep)
    return Record(
        identity=rec.identity, tenant=rec.tenant,
        keys=[k[:, idx] for k in rec.keys], values=[v[:, idx] for v in rec.values],
        embeds=rec.embeds, modality=rec.modality[idx], offsets=idx, created=rec.created,
    )  # fmt: skip


def _reseal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def test_round_trip_keeps_offsets_and_marks_the_layout():
    dense = make_record(n=9)
    rec = _compressed(dense, [0, 3, 4, 8])
    data = rec.to_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == LAYOUT_VERSION | COMPRESSED
    back = Record.from_bytes(data, model_fingerprint=FP)
    assert_same_record(rec, back)
    assert torch.equal(back.offsets, torch.tensor([0, 3, 4, 8])) and (back.length, back.kept) == (9, 4)
    # dense records keep the plain layout version and read as before
    assert struct.unpack_from("<I", dense.to_bytes(), 8)[0] == LAYOUT_VERSION
    assert Record.from_bytes(dense.to_bytes()).offsets is None
    assert len(data) < len(dense.to_bytes()) and rec.nbytes < dense.nbytes
    # a reader of another layout (what a reader from before compressed records is) refuses it
    with pytest.raises(StaleRecord, match="layout version"):
        Record.from_bytes(data, layout_version=LAYOUT_VERSION + 1)


def test_a_header_that_keeps_more_than_it_has_is_corrupt():
    data = _compressed(make_record(n=6), [1, 2]).to_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + hlen])
    for kept in (7, 3):  # more than the span; or not what the payload holds
        bad = json.dumps({**header, "kept": kept}, sort_keys=True).encode()
        body = data[:12] + struct.pack("<I", len(bad)) + bad + data[PREFIX_SIZE + hlen : -32]
        with pytest.raises(CorruptRecord):
            Record.from_bytes(_reseal(body))
    # a dense layout claiming fewer entries than its span
    bad = json.dumps({**header, "kept": 2}, sort_keys=True).encode()
    body = bytearray(data[:12] + struct.pack("<I", len(bad)) + bad + data[PREFIX_SIZE + hlen : -32])
    struct.pack_into("<I", body, 8, LAYOUT_VERSION)
    with pytest.raises(CorruptRecord, match="keeps 2 of 6"):
        Record.from_bytes(_reseal(bytes(body)))


@pytest.mark.parametrize(
    "offsets,needle",
    [([0, 0, 2], "increase strictly"), ([1, 2, 6], "increase strictly"), ([0, 1], "offsets must be")],
)
def test_bad_offsets_are_refused_naming_them(offsets, needle):
    rec = make_record(n=6)
    idx = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=needle):
        Record(
            identity=rec.identity, tenant="alice", keys=[k[:, idx] for k in rec.keys],
            values=[v[:, idx] for v in rec.values], embeds=rec.embeds, modality=rec.modality[idx],
            offsets=torch.tensor(offsets),
        )  # fmt: skip


def test_a_disk_store_serves_compressed_records(tmp_path):
    rec = _compressed(make_record(n=8), [2, 5])
    ContextStore.open(tmp_path, host_bytes=0).put(rec)
    back = ContextStore.open(tmp_path, host_bytes=0, model_fingerprint=FP).get(rec.key, "alice")
    assert back is not None and torch.equal(back.offsets, rec.offsets)
