"""Record bytes: a round trip is exact; every kind of damage raises the specific error, never a record."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load

from tests.runtime.store.helpers import FP, OTHER_FP, assert_same_record, make_record
from vlkv.runtime.store import LAYOUT_VERSION, CorruptRecord, Record, StaleRecord
from vlkv.runtime.store.record import MAGIC, PREFIX_SIZE, peek


def _reseal(body: bytes) -> bytes:
    """``body`` (a record without its digest) with a valid SHA-256 appended: damage a checksum cannot see."""
    return body + hashlib.sha256(body).digest()


def _parts(data: bytes) -> tuple[dict, int]:
    hlen = struct.unpack_from("<I", data, 12)[0]
    return json.loads(data[PREFIX_SIZE : PREFIX_SIZE + hlen]), hlen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(dtype):
    rec = make_record(dtype=dtype, expires=1.8e9)
    data = rec.to_bytes()
    assert data[:8] == MAGIC
    back = Record.from_bytes(data, model_fingerprint=FP)
    assert_same_record(rec, back)
    assert back.keys[0].dtype == dtype and back.modality.dtype == torch.int8


def test_payload_is_plain_safetensors_and_header_self_describing():
    rec = make_record(layers=3, n=7)
    data = rec.to_bytes()
    header, hlen = _parts(data)
    assert header["key"] == rec.key and header["tenant"] == "alice" and header["model_fingerprint"] == FP
    assert (header["num_layers"], header["kv_heads"], header["length"], header["head_dim"]) == (3, 2, 7, 4)
    assert header["dtype"] == "float32" and header["checksum"] == "sha256"
    assert struct.unpack_from("<I", data, 8)[0] == LAYOUT_VERSION
    payload = data[PREFIX_SIZE + hlen : -32]
    tensors = load(payload)  # no pickle anywhere: safetensors parses it
    assert sorted(tensors) == sorted(["embeds", "modality", "k.0", "k.1", "k.2", "v.0", "v.1", "v.2"])
    info = peek(data[: PREFIX_SIZE + hlen], len(data))
    assert (info.key, info.tenant, info.length, info.nbytes) == (rec.key, "alice", 7, len(data))


def test_a_bit_flip_anywhere_is_detected():
    data = make_record().to_bytes()
    _, hlen = _parts(data)
    # the magic, the version, the header length, the header, the payload, the digest
    offsets = [
        0,
        9,
        13,
        PREFIX_SIZE + 5,
        PREFIX_SIZE + hlen + 3,
        len(data) // 2 + hlen // 2,
        len(data) - 40,
        len(data) - 1,
    ]
    for at in offsets:
        for bit in (0, 7):
            bad = bytearray(data)
            bad[at] ^= 1 << bit
            with pytest.raises((CorruptRecord, StaleRecord)):
                Record.from_bytes(bytes(bad), model_fingerprint=FP)
    # past the prefix, a flip is always a checksum failure
    bad = bytearray(data)
    bad[len(data) - 100] ^= 4
    with pytest.raises(CorruptRecord, match="checksum"):
        Record.from_bytes(bytes(bad))


@pytest.mark.parametrize("keep", [0, 3, PREFIX_SIZE, PREFIX_SIZE + 10, -33, -1])
def test_truncation_is_detected(keep):
    data = make_record().to_bytes()
    with pytest.raises(CorruptRecord, match="truncated"):
        Record.from_bytes(data[:keep])


def test_trailing_bytes_and_wrong_magic_are_corrupt():
    data = make_record().to_bytes()
    with pytest.raises(CorruptRecord, match="truncated"):
        Record.from_bytes(data + b"\0")
    with pytest.raises(CorruptRecord, match="magic"):
        Record.from_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(CorruptRecord, match="magic"):
        Record.from_bytes(b"\x80\x04\x95" + b"\0" * 100)  # a pickle is not a record


def test_wrong_layout_version_is_stale():
    data = make_record().to_bytes()
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, 8, LAYOUT_VERSION + 1)
    with pytest.raises(StaleRecord, match="layout version"):
        Record.from_bytes(_reseal(bytes(body)), model_fingerprint=FP)


def test_wrong_model_fingerprint_is_stale():
    data = make_record(fp=OTHER_FP).to_bytes()
    with pytest.raises(StaleRecord, match="model"):
        Record.from_bytes(data, model_fingerprint=FP)
    Record.from_bytes(data)  # a tool that does not ask about the model reads it


def _forge(data: bytes, **changes) -> bytes:
    """Rewrite header fields and reseal: what a checksum alone cannot catch."""
    header, hlen = _parts(data)
    header.update(changes)
    new = json.dumps(header, sort_keys=True).encode()
    body = data[:12] + struct.pack("<I", len(new)) + new + data[PREFIX_SIZE + hlen : -32]
    return _reseal(body)


def test_a_resealed_header_edit_cannot_move_a_record_to_another_tenant_or_shape():
    data = make_record().to_bytes()
    with pytest.raises(CorruptRecord, match="key does not match"):
        Record.from_bytes(_forge(data, tenant="mallory"))
    with pytest.raises(CorruptRecord, match="header"):
        Record.from_bytes(_forge(data, length=6))
    with pytest.raises(CorruptRecord, match="header"):
        Record.from_bytes(_forge(data, tenant="../etc"))
    with pytest.raises(CorruptRecord, match="missing"):
        Record.from_bytes(_forge(data, num_layers="2"))


def test_invalid_records_are_refused_at_construction():
    rec = make_record()
    with pytest.raises(ValueError, match="values"):
        Record(
            identity=rec.identity, tenant="a", keys=rec.keys, values=[v[:, :3] for v in rec.values],
            embeds=rec.embeds, modality=rec.modality,
        )  # fmt: skip
    with pytest.raises(ValueError, match="embeds"):
        Record(
            identity=rec.identity, tenant="a", keys=rec.keys, values=rec.values,
            embeds=rec.embeds[:2], modality=rec.modality,
        )  # fmt: skip
    with pytest.raises(ValueError, match="tenant"):
        make_record(tenant="a/b")
