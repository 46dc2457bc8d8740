"""Factored records: K/V stored as joint-head truncated-SVD factors round-trip to the same rank-R
matrices, the layout version marks them, the header's rank must agree with the bit and the
payload, and a factored record is smaller on disk than the dense one."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from tests.runtime.store.helpers import FP, make_record
from vlkv.runtime.kv.lowrank import truncated_svd
from vlkv.runtime.store import LAYOUT_VERSION, ContextStore, CorruptRecord, Record
from vlkv.runtime.store.record import COMPRESSED, FACTORED, PREFIX_SIZE


def _at_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """``t (H, m, D)`` cut to rank ``rank`` over the concatenated heads (plain reference)."""
    h, m, d = t.shape
    a, b = truncated_svd(t.permute(1, 0, 2).reshape(m, h * d).double(), rank, exact=True)
    return (a @ b).view(m, h, d).permute(1, 0, 2).to(t.dtype)


def _factored(rec: Record, rank: int, offsets=None) -> Record:
    """``rec`` with its K/V cut to ``rank`` first (what ``factor_segment`` hands the store)."""
    return Record(
        identity=rec.identity, tenant=rec.tenant, keys=[_at_rank(k, rank) for k in rec.keys],
        values=[_at_rank(v, rank) for v in rec.values], embeds=rec.embeds, modality=rec.modality,
        created=rec.created, rank=rank, offsets=offsets,
    )  # fmt: skip


def _reseal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_trip_gives_the_rank_r_matrices_back(dtype):
    dense = make_record(n=40, heads=2, dim=8, dtype=dtype)
    rec = _factored(dense, 3)
    data = rec.to_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == LAYOUT_VERSION | FACTORED
    back = Record.from_bytes(data, model_fingerprint=FP)
    assert back.rank == 3 and back.key == rec.key and back.kept == 40
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip([*rec.keys, *rec.values], [*back.keys, *back.values]):
        assert b.dtype == dtype and b.shape == a.shape
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(back.embeds, rec.embeds, rtol=0, atol=0)
    # 2 layers x 2 (K, V) x (40·3 + 3·16) numbers instead of 2 x 2 x 40·16: 0.26 of the K/V bytes
    kv_bytes = sum(t.numel() * t.element_size() for t in (*dense.keys, *dense.values))
    saved = len(dense.to_bytes()) - len(data)
    # less the longer JSON header and the extra safetensors entries (4 tensors a layer, not 2)
    assert (1 - 168 / 640) * kv_bytes - 400 < saved <= (1 - 168 / 640) * kv_bytes
    # written again, a read-back record is still factored and the same size
    assert len(back.to_bytes()) == len(data)


def test_rank_at_or_above_the_matrix_rank_is_lossless_up_to_rounding():
    dense = make_record(n=6, heads=2, dim=4)
    rec = Record(
        identity=dense.identity, tenant=dense.tenant, keys=dense.keys, values=dense.values,
        embeds=dense.embeds, modality=dense.modality, rank=64,
    )  # fmt: skip
    back = Record.from_bytes(rec.to_bytes())
    assert back.rank == 6  # min(rank, m, H·D): the stored rank
    for a, b in zip([*dense.keys, *dense.values], [*back.keys, *back.values]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_factored_and_compressed_compose():
    dense = make_record(n=12, heads=2, dim=8)
    keep = torch.tensor([0, 2, 3, 7, 8, 9, 11])
    kept = Record(
        identity=dense.identity, tenant="alice", keys=[k[:, keep] for k in dense.keys],
        values=[v[:, keep] for v in dense.values], embeds=dense.embeds, modality=dense.modality[keep],
        offsets=keep,
    )  # fmt: skip
    rec = _factored(kept, 2, offsets=keep)
    data = rec.to_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == LAYOUT_VERSION | COMPRESSED | FACTORED
    back = Record.from_bytes(data)
    assert torch.equal(back.offsets, keep) and back.rank == 2
    torch.testing.assert_close(back.keys[1], rec.keys[1], rtol=1e-5, atol=1e-5)


def test_rank_and_bit_must_agree():
    data = _factored(make_record(n=8, heads=2, dim=4), 2).to_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + hlen])
    payload = data[PREFIX_SIZE + hlen : -32]
    # the bit without a rank, a rank without the bit, a rank the payload does not hold
    cases = [({k: v for k, v in header.items() if k != "rank"}, True, "factored bit 1"),
             (header, False, "factored bit 0"),
             ({**header, "rank": 3}, True, "do not match|is \\(")]  # fmt: skip
    for head, bit, needle in cases:
        raw = json.dumps(head, sort_keys=True).encode()
        body = bytearray(data[:12] + struct.pack("<I", len(raw)) + raw + payload)
        struct.pack_into("<I", body, 8, LAYOUT_VERSION | (FACTORED if bit else 0))
        with pytest.raises(CorruptRecord, match=needle):
            Record.from_bytes(_reseal(bytes(body)))


def test_bad_rank_is_one_line():
    rec = make_record()
    with pytest.raises(ValueError, match="rank must be None or an integer >= 1, got 0"):
        Record(
            identity=rec.identity, tenant="alice", keys=rec.keys, values=rec.values,
            embeds=rec.embeds, modality=rec.modality, rank=0,
        )  # fmt: skip


def test_a_disk_store_serves_factored_records(tmp_path):
    rec = _factored(make_record(n=30, heads=2, dim=8), 4)
    ContextStore.open(tmp_path, host_bytes=0).put(rec)
    back = ContextStore.open(tmp_path, host_bytes=0, model_fingerprint=FP).get(rec.key, "alice")
    assert back is not None and back.rank == 4
    torch.testing.assert_close(back.values[0], rec.values[0], rtol=1e-5, atol=1e-5)
