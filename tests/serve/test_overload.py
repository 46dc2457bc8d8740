"""Overload, timeouts and SIGTERM against a real uvicorn: 429 + Retry-After, 504 that frees the KV,
a drain that finishes in-flight streams before the process exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from tests.serve.conftest import MODEL, start_server

TIMEOUT_S = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("serve"),
        "--max-running",
        "1",
        "--max-queue",
        "1",
        "--request-timeout",
        str(TIMEOUT_S),
        "--max-tokens",
        "3000",
    )
    yield srv
    srv.stop()


def body(max_tokens: int, stream: bool = False, text: str = "Go on.") -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


def first_chunks(lines, n: int) -> None:
    seen = 0
    for line in lines:
        seen += line.startswith("data: ")
        if seen >= n:
            return


def test_full_queue_gets_429_with_retry_after(server):
    url = f"{server.url}/v1/chat/completions"
    with (
        httpx.stream("POST", url, json=body(300, stream=True), timeout=30) as running,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream
        first_chunks(lines, 2)  # prefilled: it holds the only running slot
        queued = pool.submit(httpx.post, url, json=body(2), timeout=30)
        deadline = time.monotonic() + 10
        while server.metrics()["vlkv_queue_depth"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(url, json=body(2), timeout=30)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    # the stream is closed: its request is cancelled and the queued one runs
    assert queued.result(30).status_code == 200
    server.wait_metric("vlkv_pool_used_bytes", 0)


def test_request_past_its_timeout_gets_504_and_frees_its_kv(server):
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body(3000), timeout=30)
    assert r.status_code == 504, r.text
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 5
    assert r.json()["error"]["type"] == "timeout_error"
    server.wait_metric("vlkv_pool_used_bytes", 0)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body(2), timeout=30).status_code == 200


def test_stream_past_its_timeout_ends_with_an_error_chunk(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body(3000, stream=True), timeout=30
    ) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout_error"
    server.wait_metric("vlkv_pool_used_bytes", 0)


def test_non_streaming_client_that_goes_away_cancels_its_request(server):
    cancelled = server.metrics().get('vlkv_requests_total{outcome="cancelled"}', 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body(3000), timeout=httpx.Timeout(30, read=0.5))
    # cancelled on disconnect (polled every 0.25 s), well before the 3 s request timeout
    server.wait_metric('vlkv_requests_total{outcome="cancelled"}', cancelled + 1, timeout_s=TIMEOUT_S - 0.5)
    server.wait_metric("vlkv_pool_used_bytes", 0)


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_eight_huge_images_in_one_request_are_a_400_in_bounded_memory(server):
    """Eight 40-megapixel PNGs (a few KB each, 120 MB each decoded) or eight 200000x1 PNGs (660 bytes,
    gigabytes once resized) in one request: one 400, refused from the headers, and the server's peak
    memory does not move by more than noise."""
    import base64
    import io

    from PIL import Image

    def url(width: int, height: int, mode: str) -> str:
        buf = io.BytesIO()
        Image.new(mode, (width, height)).save(buf, format="PNG", optimize=True)
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    before = _peak_rss_mb(server.proc.pid)
    for image, words in (
        (url(7300, 5500, "1"), "40.1 Mpx"),
        (url(200_000, 1, "RGB"), "aspect ratio 200000:1"),
    ):
        parts = [{"type": "image_url", "image_url": {"url": image}}] * 8 + [{"type": "text", "text": "x"}]
        req = {**body(2), "messages": [{"role": "user", "content": parts}]}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=req, timeout=30)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]
    grew = _peak_rss_mb(server.proc.pid) - before
    assert grew < 64, f"peak RSS grew {grew:.0f} MiB refusing the images"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body(2), timeout=30).status_code == 200


def test_sigterm_drains_in_flight_streams_then_exits_0(server):
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body(16, stream=True), timeout=30) as resp:
        lines = resp.iter_lines()
        first_chunks(lines, 2)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(x) for x in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 16 tokens, not cut off
    with pytest.raises(httpx.HTTPError):  # the listener is closed: new work is refused
        r = httpx.post(url, json=body(2), timeout=5)
        if r.status_code == 503:
            raise httpx.HTTPError("refused with 503")
    assert server.proc.wait(30) == 0
    assert "drained" in server.log.read_text()
