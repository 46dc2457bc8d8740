"""Server pieces without a server: SSE framing, incremental detokenization, media sandbox."""

from __future__ import annotations

import json

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
