"""Server pieces without a server: SSE framing, incremental detokenization, media sandbox."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("fastapi", reason="vlkv serve needs the serve extra: pip install 'vlkv[serve]'")

from tests.serve.conftest import data_url, png_bytes  # noqa: E402
from vlkv.serve.app import sse  # noqa: E402
from vlkv.serve.detok import Detokenizer  # noqa: E402
from vlkv.serve.media import MediaError, load_part  # noqa: E402


def test_sse_event_is_one_line_whatever_the_text():
    text = "a\u2028b\u2029c\x85d\re\nf\x1cg\x0bh"
    event = sse({"text": text})
    assert event.endswith("\n\n") and event.isascii()
    assert len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: ") :])["text"] == text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_detokenization_adds_up_to_the_full_decode(seed):
    import random

    from vlkv.runtime.models.tokenizer import build_tokenizer

    tok = build_tokenizer("llava")
    rng = random.Random(seed)
    # bytes of multi-byte characters split across tokens, stray continuation bytes, specials
    ids = list("héllo wörld ✓ 🙂".encode()) + [rng.randrange(0, 259) for _ in range(40)]
    d = Detokenizer(tok)
    out = ""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out += d.add(ids[i : i + n])
        i += n
    out += d.finish()
    assert out == tok.decode(ids, skip_special_tokens=True)


def test_media_sandbox(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes(1))
    (media / "up.png").symlink_to(tmp_path / "secret.png")
    root = str(media.resolve())
    assert load_part("a.png", "p", root, 1 << 20).size == (64, 64)
    assert load_part(f"file://{media / 'a.png'}", "p", root, 1 << 20).size == (64, 64)
    assert load_part(data_url(png_bytes()), "p", None, 1 << 20).mode == "RGB"
    for bad in ("../secret.png", str(tmp_path / "secret.png"), "up.png", "file:///etc/passwd", "missing.png"):
        with pytest.raises(MediaError):
            load_part(bad, "p", root, 1 << 20)
    with pytest.raises(MediaError, match="no --allowed-media-dir"):
        load_part("a.png", "p", None, 1 << 20)
    with pytest.raises(MediaError, match="larger"):
        load_part(data_url(png_bytes()), "p", root, 100)


def test_media_sizes_are_checked_on_the_header_before_decoding(monkeypatch):
    import io

    from PIL import Image, ImageFile

    from vlkv.runtime.models.images import ImageLimits

    def decoded(self, *args, **kwargs):
        raise AssertionError("pixels decoded although the size is refused")

    thin = io.BytesIO()
    Image.new("RGB", (200_000, 1)).save(thin, format="PNG", optimize=True)
    assert len(thin.getvalue()) < 1000  # one request under 1 KB
    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
    limits = ImageLimits(16_000_000, 200, 56)
    with pytest.raises(
        MediaError, match=r"^p: image is 200000x1, aspect ratio 200000:1; this model takes at most 200:1"
    ):
        load_part(data_url(thin.getvalue()), "p", None, 1 << 20, limits)
    big = io.BytesIO()
    Image.new("1", (7300, 5500)).save(big, format="PNG")  # 40 Mpx, a few KB
    with pytest.raises(MediaError, match=r"is 7300x5500 \(40.1 Mpx\); this model decodes at most 16.0 Mpx"):
        load_part(data_url(big.getvalue()), "p", None, 1 << 20, limits)


def test_serve_parser_wires_into_vlkv_subcommands():
    import argparse

    from vlkv.serve.cli import add_serve_parser, cmd_serve

    parser = argparse.ArgumentParser(prog="vlkv")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "--model", "tiny-llava", "--pool-bytes", "1024", "--max-queue", "3"])
    assert args.func is cmd_serve and args.pool_bytes == 1024 and args.max_queue == 3


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "no-such-model", "--port", "0"], "unknown model name"),
        (["--pool-bytes", "0"], "pool_bytes must be >= 1"),
        (["--max-queue", "0"], "max_queue must be an integer >= 1"),
        (["--policy", "nope"], "unknown policy"),
        (["--allowed-media-dir", "/no/such/dir"], "allowed media dir not found"),
    ],
)
def test_bad_options_are_one_line_before_listening(argv, words, capsys):
    from vlkv.serve.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_cuda_graph_on_a_cpu_device_is_one_line_before_loading(capsys, monkeypatch):
    """``vlkv serve --cuda-graph`` refuses a CPU device (or another backend) in one line, before the model
    loads or a port is taken; on a CUDA device the engine is built with the graph step on."""
    import torch

    from vlkv.serve import cli

    def no_load(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(cli, "listen_socket", no_load)
    for argv in (["--cuda-graph"], ["--cuda-graph", "--device", "cuda", "--backend", "onnxruntime"]):
        if "cuda" in argv:  # resolve_device checks the device exists: a machine without one passes here
            monkeypatch.setattr("vlkv.runtime.device.resolve_device", lambda d: torch.device("cuda"))
        assert cli.main([*argv, "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "vlkv: error: --cuda-graph needs --device cuda and --backend torch", err
    args = cli.argparse.Namespace(cuda_graph=True, backend="torch")
    cli.check_cuda_graph(args, torch.device("cuda", 0))  # accepted
    cli.check_cuda_graph(cli.argparse.Namespace(cuda_graph=False, backend="torch"), torch.device("cpu"))
    built = {}

    class Engine:  # what _serve hands the flag to
        def __init__(self, loaded, backend, decode_graph=False):
            built.update(backend=backend, decode_graph=decode_graph)
            raise ValueError("stop here")

    monkeypatch.setattr("vlkv.runtime.engine.Engine", Engine)
    monkeypatch.setattr("vlkv.runtime.models.registry.load_model", lambda *a, **kw: None)
    monkeypatch.setattr(cli, "listen_socket", lambda host, port: _Sock())
    assert cli.main(["--cuda-graph", "--device", "cuda", "--port", "0"]) == 2
    assert built == {"backend": "torch", "decode_graph": True}
    assert "stop here" in capsys.readouterr().err


class _Sock:
    def close(self) -> None:
        pass


def test_port_in_use_or_bad_host_is_one_line_before_the_banner(capsys):
    import socket

    from vlkv.serve.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"vlkv: error: --port {port} is already in use on 127.0.0.1: pick another port"
    for host, words in [
        ("no-such-host.invalid", "--host 'no-such-host.invalid' is not an address to listen on"),
        ("192.0.2.1", "--host '192.0.2.1' is not an address of this machine"),  # TEST-NET-1
    ]:
        assert main(["--host", host, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert words in err and "\n" not in err.strip() and "http://" not in err


def test_link_threshold_outside_zero_one_is_refused_by_serve(capsys):
    from vlkv.serve.cli import main

    for value in ("2", "-1", "nan"):
        assert main(["--link-threshold", value, "--port", "0"]) == 2
        assert "--link-threshold must be in [0, 1]" in capsys.readouterr().err


def test_deeply_nested_json_is_a_400():
    from vlkv.serve.errors import ApiError
    from vlkv.serve.translate import MAX_JSON_DEPTH, parse_json

    for depth in (MAX_JSON_DEPTH + 1, 5000, 200_000):
        with pytest.raises(ApiError, match="request body nests too deeply") as err:
            parse_json(b"[" * depth + b"]" * depth)
        assert err.value.status == 400
    assert parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is not None


def test_multi_turn_chat_uses_the_checkpoint_chat_template():
    """A conversation is formatted by the processor's chat template; a model without one refuses it."""
    import asyncio
    import dataclasses

    from vlkv.runtime.models.registry import load_model
    from vlkv.serve.config import ServeConfig
    from vlkv.serve.errors import ApiError
    from vlkv.serve.schemas import ChatRequest
    from vlkv.serve.translate import chat_prompt

    loaded = load_model("tiny-llava")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Of what?"},
    ]
    req = ChatRequest.model_validate({"model": "tiny-llava", "messages": messages})
    with pytest.raises(ApiError, match="no chat template"):
        asyncio.run(chat_prompt(req, loaded, ServeConfig()))
    loaded.processor.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}|{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    templated = dataclasses.replace(loaded, template="chat_template")
    prompt, uuids = asyncio.run(chat_prompt(req, templated, ServeConfig()))
    assert prompt.raw and len(prompt.images) == 1 and uuids == [None]
    assert prompt.text == "system:Be brief.|user:<image>|assistant:A picture.|user:Of what?|assistant:"


# A gap may also wait on the OS (other processes on a shared 2-core box, the encoding thread's own
# core) or the GIL (the encoding thread holds it between C calls): this much slack over one decode
# step is allowed (measured worst on a loaded 2-core VM: 15-45 ms), never the whole encode.
GAP_SLACK_S = 0.05


def _gaps_while_encoding(
    engine, n_images: int, settle: int, words: int = 400
) -> tuple[float, float, float, int]:
    """A stream runs on the engine thread while a handler thread encodes a ~2,000-token prompt with
    ``n_images`` 1024x1024 images and ``words`` words of text. Returns (median gap of the settled stream before the encode, worst
    gap overlapping the encode, the encode's seconds, gaps overlapping it)."""
    import asyncio
    import statistics
    import time

    import numpy as np
    from PIL import Image

    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt
    from vlkv.runtime.request import Request
    from vlkv.runtime.scheduler import Scheduler
    from vlkv.serve.engine_loop import EngineLoop, Ticket
    from vlkv.serve.translate import encode

    rng = np.random.default_rng(0)
    pictures = [
        Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)) for _ in range(n_images)
    ]
    big = Prompt("word " * words, pictures)  # decoded pictures, as the handler's media step leaves them
    stamps: list[float] = []

    class Timed(Ticket):
        def push(self, item) -> None:  # called on the engine thread, as each token is produced
            stamps.append(time.perf_counter())
            super().push(item)

    async def run() -> tuple[float, float, float, int]:
        loop = EngineLoop(Scheduler(engine), idle_wait_s=0.01)
        loop.start()
        try:
            aio = asyncio.get_running_loop()
            stream = Request(Prompt("Go on."), make_policy("full"), 4000, stop_at_eos=False)
            stream.batch = encode(engine, stream.prompt, "prompt")
            ticket = Timed(stream, aio, time.monotonic() + 300)
            assert loop.submit(ticket)
            await ticket.accepted
            while len(stamps) < settle:  # a settled stream: its median gap is one decode step
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            batch = await asyncio.to_thread(encode, engine, big, "messages")  # what the handler does
            t1 = time.perf_counter()
            await asyncio.sleep(0.05)  # the gap that spans the encode's end is stamped too
            loop.cancel(ticket)
        finally:
            loop.stop()
        assert batch.lengths.item() >= 2000
        times = list(stamps)
        before = [b - a for a, b in zip(times, times[1:]) if b < t0][-(settle * 3 // 4) :]
        inside = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
        return statistics.median(before), max(inside) if inside else t1 - t0, t1 - t0, len(inside)

    stamps.clear()
    return asyncio.run(run())


def _check_gaps(engine, n_images: int, settle: int, slack: float, words: int = 400) -> None:
    """The encode runs off the engine thread: no gap overlapping it exceeds the median gap by more than
    ``max(median, slack, encode / 2)``. An encode on the engine thread makes one gap of a step plus the
    whole encode, so it fails every try; a handler thread's encode only takes the GIL and the cores in
    turns. The tighter "one step" bound (``max(median, slack)``: session 6-8 measurements below) is a
    speed target that a loaded CI box misses (CI at load 5 on 2 cores: 48 ms steps, worst gaps 99-110 ms,
    encodes 340-365 ms), so it is not asserted here. Each try first checks that the encode is longer
    than the allowance, so the two cases stay apart. Up to three tries: a busy box may stall any thread
    once."""
    tries = []
    for _ in range(3):
        median, worst, took, n = _gaps_while_encoding(engine, n_images, settle, words)
        allowed = max(median, slack, took / 2)
        tries.append(
            f"encode {took * 1e3:.1f} ms, median gap {median * 1e3:.2f} ms, worst {worst * 1e3:.1f} ms"
        )
        assert took > median + allowed, f"the encode is too short to tell where it ran: {tries[-1]}"
        assert n >= 1, f"no token while encoding: {tries[-1]}"
        if worst <= median + allowed:
            return
    raise AssertionError("a running stream stalled while a prompt was encoded: " + "; ".join(tries))


def test_encoding_a_large_prompt_does_not_stall_a_running_stream(engines):
    """tiny-llava (~1.5 ms steps): 16 images make a ~130 ms encode; :data:`GAP_SLACK_S` stands in for
    a step this short."""
    _check_gaps(engines["tiny-llava"], n_images=16, settle=200, slack=GAP_SLACK_S)


@pytest.mark.demo
def test_a_real_models_stream_keeps_running_while_encoding():
    """On a real model: smollm2-llava's stream keeps running while eight 1024x1024 images and ~2,100
    tokens are encoded in a handler thread (its pooled projector makes each image 64 tokens, so 1,600
    words of text keep the prompt over 2,000) (:func:`_check_gaps`' bound; the issue's one-step bound was
    met on a quiet machine: steps were ~45 ms in session 6, worst gaps 55-58 ms against a 45-47 ms
    median; the fused decode layer made them ~18 ms, session 8 under CI load: worst 36-48 ms). An encode
    on the engine thread (180-350 ms) fails."""
    import torch

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    torch.manual_seed(0)
    engine = Engine(load_model("smollm2-llava"))
    _check_gaps(engine, n_images=8, settle=24, slack=GAP_SLACK_S, words=1600)


def test_a_requests_unset_link_fields_keep_the_servers_settings(tmp_path):
    from vlkv.serve.config import ServeConfig

    cfg = ServeConfig(store=str(tmp_path / "store"), link="mpic", link_k=4, store_budget=0.5)
    spec = cfg.link_spec(method="mpic", k=None, r=None, store_budget=None)
    assert spec.k == 4 and spec.store_budget == 0.5  # was LinkSpec's own k=32: 0 tokens reused
    assert cfg.link_spec(method="mpic", k=8).k == 8


def test_link_pick_is_the_servers_unless_a_request_names_one(tmp_path):
    from types import SimpleNamespace

    from vlkv.serve.app import _link_spec
    from vlkv.serve.config import ServeConfig
    from vlkv.serve.errors import ApiError
    from vlkv.serve.schemas import VlkvOptions

    plain = ServeConfig(store=str(tmp_path / "s"), link="mpic")
    assert plain.link_spec(method="mpic").pick == "first"  # LinkSpec's default
    cfg = ServeConfig(store=str(tmp_path / "s"), link="mpic", link_pick="ramp")
    assert _link_spec(SimpleNamespace(vlkv=None), cfg).pick == "ramp"
    assert _link_spec(SimpleNamespace(vlkv=VlkvOptions(link_pick="first")), cfg).pick == "first"
    with pytest.raises(ApiError, match="unknown MPIC pick 'last'"):
        _link_spec(SimpleNamespace(vlkv=VlkvOptions(link_pick="last")), cfg)


# ---------------------------------------------------------------------- the server's fixed pool
MIB = 2**20


@pytest.fixture()
def tiny_engine(engines):
    return engines["tiny-llava"]


def _scheduler(engine, monkeypatch, free: int, **cfg):
    from vlkv.runtime.kv import sizing
    from vlkv.serve.cli import build_scheduler
    from vlkv.serve.config import ServeConfig

    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: free)
    return build_scheduler(ServeConfig(**cfg), engine)


def test_the_servers_pool_is_fixed_by_default_at_half_the_free_memory(tiny_engine, monkeypatch):
    sched, size = _scheduler(tiny_engine, monkeypatch, 8 * MIB)
    assert not sched.pool.grow and size.nbytes == 4 * MIB == sched.pool.held_bytes()
    assert size.describe() == "fixed KV pool of 4.0 MiB (0.5 of 8 MiB free)"
    sched, size = _scheduler(tiny_engine, monkeypatch, 8 * MIB, kv_memory_fraction=0.25)
    assert size.nbytes == 2 * MIB == sched.pool.held_bytes()
    sched, size = _scheduler(tiny_engine, monkeypatch, 8 * MIB, pool_bytes=MIB)  # --pool-bytes wins
    assert not sched.pool.grow and sched.pool.held_bytes() == MIB


def test_the_default_pool_is_capped_at_what_the_running_requests_can_use(tiny_engine, monkeypatch):
    from vlkv.runtime.limits import position_limit

    sched, size = _scheduler(tiny_engine, monkeypatch, 2**40, max_running=2)
    token = sched.pool.spec.entry_bytes * sched.pool.spec.num_layers
    assert size.nbytes == size.cap == 2 * position_limit(tiny_engine.loaded) * token
    assert "capped at what it can use" in size.describe()


def test_a_fraction_that_leaves_no_token_is_one_line(tiny_engine, monkeypatch):
    with pytest.raises(ValueError, match=r"^--kv-memory-fraction 0.5 of the 1000 bytes free leaves no room"):
        _scheduler(tiny_engine, monkeypatch, 1000)


def test_free_memory_is_read_from_the_os():
    from vlkv.runtime.kv.sizing import free_memory_bytes

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free_memory_bytes("cpu") <= total


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kv-memory-fraction", "0"], "--kv-memory-fraction must be in (0, 1]"),
        (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction must be in (0, 1]"),
        (["--kv-memory-fraction", "-0.2"], "--kv-memory-fraction must be in (0, 1]"),
        (["--kv-memory-fraction", "nan"], "--kv-memory-fraction must be in (0, 1]"),
        (["--kv-memory-fraction", "inf"], "--kv-memory-fraction must be in (0, 1]"),
        (
            ["--kv-memory-fraction", "0.3", "--pool-bytes", "4096"],
            "give --pool-bytes or --kv-memory-fraction",
        ),
    ],
)
def test_bad_kv_memory_fractions_are_one_line_before_loading(argv, words, capsys):
    from vlkv.serve.cli import main

    assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
