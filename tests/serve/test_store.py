"""`vlkv serve --store`: requests link the images earlier requests computed; `cache_salt` scopes them."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MODEL, data_url, png_bytes, start_server


@pytest.fixture(scope="module")
def linked_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-store")
    server = start_server(tmp, "--store", str(tmp / "store"), "--link", "mpic", "--link-k", "2")
    yield server
    server.stop()


def _chat(server, image: str, text: str, **extra) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]}],
        "max_tokens": 3,
        "temperature": 0,
        **extra,
    }  # fmt: skip
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_later_request_links_the_stored_image_and_tenants_never_share(linked_server):
    image = data_url(png_bytes(7))
    assert _chat(linked_server, image, "What is it?", cache_salt="alice").status_code == 200
    assert linked_server.metrics()["vlkv_store_misses"] == 1
    assert _chat(linked_server, image, "And now?", cache_salt="alice").status_code == 200
    m = linked_server.metrics()
    assert (m["vlkv_store_hits"], m["vlkv_store_misses"]) == (1, 1)
    assert _chat(linked_server, image, "Yours?", cache_salt="bob").status_code == 200  # another tenant
    m = linked_server.metrics()
    assert (m["vlkv_store_hits"], m["vlkv_store_misses"]) == (1, 2)
    plain = _chat(linked_server, image, "No linking.", vlkv={"link": "none"})
    assert plain.status_code == 200
    bad = _chat(linked_server, image, "x", vlkv={"link": "blend"})
    assert bad.status_code == 400 and "unknown link method 'blend'" in bad.json()["error"]["message"]


def test_a_client_uuid_is_the_record_identity(linked_server):
    before = linked_server.metrics()["vlkv_store_hits"]

    def with_uuid(image: str, uuid: str, text: str) -> int:
        part = {"type": "image_url", "image_url": {"url": image}, "uuid": uuid}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
            "max_tokens": 2,
            "temperature": 0,
            "cache_salt": "carol",
        }
        return httpx.post(f"{linked_server.url}/v1/chat/completions", json=body, timeout=60).status_code

    assert with_uuid(data_url(png_bytes(11)), "photo-1", "What is it?") == 200
    # other bytes, same uuid: the client says it is the same image, so its record is linked
    assert with_uuid(data_url(png_bytes(12)), "photo-1", "Again?") == 200
    assert linked_server.metrics()["vlkv_store_hits"] == before + 1


def test_cacheblend_and_compressed_records_pass_through(linked_server):
    image = data_url(png_bytes(23))
    ok = _chat(linked_server, image, "What is it?", vlkv={"store_budget": 0.5, "store_scorer": "stride"})
    assert ok.status_code == 200
    factored = _chat(linked_server, image, "What is it?", vlkv={"store_rank": 4})
    assert factored.status_code == 200
    blend = _chat(
        linked_server, image, "And now?", vlkv={"link": "cacheblend", "link_r": 0.5, "link_deviation": "v"}
    )
    assert blend.status_code == 200
    for opts, words in (
        ({"link": "cacheblend", "link_r": 2.0}, "link r must be a fraction in [0, 1]"),
        ({"link_deviation": "q"}, "link deviation must be one of k, v"),
        ({"store_budget": 0.0}, "store budget must be a fraction in (0, 1]"),
        ({"store_scorer": "best"}, "unknown record scorer 'best'"),
        ({"store_rank": -2}, "store rank must be an integer >= 0"),
    ):
        bad = _chat(linked_server, image, "x", vlkv=opts)
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], opts


def test_server_link_defaults_are_checked_at_start():
    from vlkv.serve.config import ServeConfig

    with pytest.raises(ValueError, match="link r must be a fraction"):
        ServeConfig(store="x", link="cacheblend", link_r=1.5)
    cfg = ServeConfig(store="x", link="mpic", store_budget=0.5, store_scorer="stride", store_rank=8)
    spec = cfg.link_spec(k=4)
    assert (spec.method, spec.k, spec.store_budget, spec.store_scorer) == ("mpic", 4, 0.5, "stride")
    assert spec.store_rank == 8 and cfg.link_spec(store_rank=0).store_rank == 0
