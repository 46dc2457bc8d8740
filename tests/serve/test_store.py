"""`vlkv serve --store`: requests link the images earlier requests computed; `cache_salt` scopes them."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MODEL, data_url, png_bytes, start_server


@pytest.fixture(scope="module")
def linked_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-store")
    # tiny random weights have no saved link-check: this server opts in to unchecked linking
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLKV_LINK_UNCHECKED", "1")
        server = start_server(tmp, "--store", str(tmp / "store"), "--link", "mpic", "--link-k", "2")
    yield server
    server.stop()


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _chat(server, image: str, text: str, **extra) -> httpx.Response:
    # k = 2 asked per request: the tiny model's images are 16 tokens, and a request's own None
    # fields must not reset the server's --link-k (ServeConfig.link_spec; reported to the lead)
    extra["vlkv"] = {"link_k": 2, **extra.get("vlkv", {})}
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
    assert _cached(_chat(linked_server, image, "What is it?", cache_salt="alice")) == 0
    assert linked_server.metrics()["vlkv_store_misses"] == 1
    again = _cached(_chat(linked_server, image, "And now?", cache_salt="alice"))
    assert again > 0  # the image's tokens but MPIC's k = 2 leading ones
    m = linked_server.metrics()
    assert (m["vlkv_store_hits"], m["vlkv_store_misses"]) == (1, 1)
    assert _cached(_chat(linked_server, image, "Yours?", cache_salt="bob")) == 0  # another tenant
    m = linked_server.metrics()
    assert (m["vlkv_store_hits"], m["vlkv_store_misses"]) == (1, 2)
    assert _cached(_chat(linked_server, image, "Yours again?", cache_salt="bob")) == again
    plain = _chat(linked_server, image, "No linking.", vlkv={"link": "none"})
    assert _cached(plain) == 0
    bad = _chat(linked_server, image, "x", vlkv={"link": "blend"})
    assert bad.status_code == 400 and "unknown link method 'blend'" in bad.json()["error"]["message"]
    # started without --pool-bytes: the server's pool is fixed (sized from --kv-memory-fraction)
    assert "fixed KV pool of" in linked_server.log.read_text()
    assert linked_server.metrics()["vlkv_pool_total_bytes"] > 0


def test_a_client_uuid_is_only_an_alias_of_the_pixels(linked_server):
    def with_uuid(image: str, uuid: str, text: str, salt: str = "carol") -> httpx.Response:
        part = {"type": "image_url", "image_url": {"url": image}, "uuid": uuid}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
            "max_tokens": 2,
            "temperature": 0,
            "cache_salt": salt,
            "vlkv": {"link_k": 2},
        }
        return httpx.post(f"{linked_server.url}/v1/chat/completions", json=body, timeout=60)

    assert _cached(with_uuid(data_url(png_bytes(11)), "photo-1", "What is it?")) == 0
    # other bytes, same uuid: never the first image's K/V
    other = with_uuid(data_url(png_bytes(12)), "photo-1", "What is it?")
    assert _cached(other) == 0
    plain = with_uuid(data_url(png_bytes(12)), "photo-2", "What is it?", salt="dave")  # other tenant
    assert _cached(plain) == 0
    assert other.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    # the same bytes under another uuid: the pixels decide, so it is a hit
    assert _cached(with_uuid(data_url(png_bytes(11)), "photo-9", "Again?")) > 0
    # another tenant's uuid names nothing of theirs
    assert _cached(with_uuid(data_url(png_bytes(13)), "photo-1", "Again?", salt="erin")) == 0


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


def test_a_text_only_prefix_is_reused_per_cache_salt_only(linked_server):
    def ask(salt: str | None) -> int:
        body = {
            "model": MODEL,
            "prompt": "A long system prompt every client sends, word for word, before its question. Hi?",
            "max_tokens": 2,
            "temperature": 0,
            "vlkv": {"link": "prefix"},
            **({} if salt is None else {"cache_salt": salt}),
        }
        return _cached(httpx.post(f"{linked_server.url}/v1/completions", json=body, timeout=60))

    assert ask("alice") == 0
    assert ask("bob") == 0  # the same text under another salt: nothing reused
    assert ask(None) == 0  # nor under the shared default tenant
    assert ask("alice") > 0 and ask("bob") > 0 and ask(None) > 0  # each tenant reuses its own
