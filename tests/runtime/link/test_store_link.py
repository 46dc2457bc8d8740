"""Linking through the persistent context store: records outlive the process, damage is a counted
miss that recomputes, tenants never share."""

from __future__ import annotations

import pytest

from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store import ContextStore

SPEC = LinkSpec("mpic", 2)


def _run(engine, store_dir, prompt, tenant="default"):
    store = ContextStore.open(store_dir)  # a fresh store object: what a new process sees
    res = engine.generate(
        [prompt],
        make_policy("full"),
        4,
        stop_at_eos=False,
        link=SPEC,
        store=store,
        tenant=tenant,
        link_threshold=0.0,
    )
    return res.extras["store"], res.samples[0].token_ids


def _record_files(store_dir):
    return [p for p in store_dir.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_records_persist_and_damage_is_a_counted_miss_that_recomputes(engines, images, tmp_path):
    engine = engines["tiny-llava"]
    prompt = Prompt("What is this?", [images[0]])
    full = engine.generate([prompt], make_policy("full"), 4, stop_at_eos=False).samples[0].token_ids
    first, tokens = _run(engine, tmp_path, prompt)
    assert (first["hits"], first["misses"]) == (0, 1) and tokens == full  # a miss recomputes all
    second, linked = _run(engine, tmp_path, prompt)
    assert second["hits"] == 1 and second["bytes_loaded"] > 0 and second["reused_tokens"] > 0
    for damage in ("flip", "truncate"):
        (path,) = _record_files(tmp_path)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        else:
            data = data[: len(data) // 3]
        path.write_bytes(bytes(data))
        st, tokens = _run(engine, tmp_path, prompt)
        assert st["corrupt"] == 1 and st["hits"] == 0 and st["misses"] == 1, damage
        assert tokens == full  # never used: recomputed, and rewritten for the next request
        again, tokens = _run(engine, tmp_path, prompt)
        assert again["hits"] == 1 and tokens == linked


def test_two_tenants_with_the_same_image_never_share(engines, images, tmp_path):
    engine = engines["tiny-llava"]
    prompt = Prompt("What is this?", [images[1]])
    _run(engine, tmp_path, prompt, tenant="alice")
    st, _ = _run(engine, tmp_path, prompt, tenant="bob")
    assert (st["hits"], st["misses"]) == (0, 1)
    st, _ = _run(engine, tmp_path, prompt, tenant="alice")
    assert st["hits"] == 1
    with pytest.raises(ValueError, match="invalid tenant name"):
        _run(engine, tmp_path, prompt, tenant="../bob")


def test_a_client_uuid_is_an_alias_the_pixels_decide(engines, images, tmp_path):
    """Two different images sent with one uuid never share K/V (the record key is the pixels'); the
    same pixels under any uuid still hit, across processes."""
    from vlkv.runtime.request import Request
    from vlkv.runtime.scheduler import Scheduler

    engine = engines["tiny-llava"]

    def run(image, uuid: str) -> Request:
        sched = Scheduler(engine, store=ContextStore.open(tmp_path), link_threshold=0.0)  # a new process
        req = Request(Prompt("What is it?", [image]), make_policy("full"), 4, stop_at_eos=False, link=SPEC)
        req.extras["image_uuids"] = [uuid]
        sched.submit(req)
        sched.run()
        sched.flush()  # the record was written back in the background
        return req

    first = run(images[0], "client-photo-1")
    assert (first.link_stats.hits, first.link_stats.misses) == (0, 1)
    other = run(images[1], "client-photo-1")  # other pixels, same uuid: never the first image's record
    assert (other.link_stats.hits, other.link_stats.reused_tokens) == (0, 0)
    alone = engine.generate([Prompt("What is it?", [images[1]])], make_policy("full"), 4, stop_at_eos=False)
    assert other.tokens == alone.samples[0].token_ids
    same = run(images[0], "another-name")  # the same pixels under another uuid: a hit
    assert same.link_stats.hits == 1 and same.link_stats.bytes_loaded > 0
