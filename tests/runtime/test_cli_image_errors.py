"""``vlkv generate`` with bad images: refused from the file's header, in one line, before any pixel is decoded
or the model runs (the fixtures ``no_model_compute`` and ``no_decode`` fail the test otherwise)."""

from __future__ import annotations

import struct
import zlib

import pytest

from tests.runtime.cli_refusal import refused as _refused
from vlkv.runtime.prompt import Prompt


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height``: PIL reads the size without decoding pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("side", "needle"),
    [(20_000, "is too large to decode safely"), (10_000, "is 10000x10000 (100.0 Mpx), above the")],
)
def test_huge_image(capsys, no_model_compute, tmp_path, side, needle):
    path = tmp_path / "huge.png"
    path.write_bytes(_png_header(side, side))
    line = _refused(capsys, "--prompt", "hi", "--image", str(path))
    assert needle in line and "downscale it" in line


def _thin_png(path, width: int, height: int):
    """A real (decodable) black PNG: 200000x1 compresses to ~660 bytes and would decode to GBs resized."""
    from PIL import Image

    Image.new("RGB", (width, height)).save(path, optimize=True)
    return path


@pytest.mark.parametrize(
    ("size", "needle"),
    [
        ((200_000, 1), "is 200000x1, aspect ratio 200000:1; this model takes at most 200:1: crop it"),
        ((60_000, 1), "is 60000x1, aspect ratio 60000:1"),
        ((1, 60_000), "is 1x60000, aspect ratio 60000:1"),
    ],
)
@pytest.mark.parametrize("model", ["tiny-llava", "tiny-qwen2-vl"])
def test_thin_image_is_refused_from_its_header(
    capsys, no_model_compute, no_decode, tmp_path, size, needle, model
):
    path = _thin_png(tmp_path / "thin.png", *size)
    if size == (200_000, 1):
        assert path.stat().st_size < 1000  # the case: one request under 1 KB
    assert needle in _refused(capsys, "--model", model, "--prompt", "hi", "--image", str(path))


@pytest.mark.parametrize("count", [1, 8])
def test_forty_megapixel_images_are_refused(capsys, no_model_compute, no_decode, tmp_path, count):
    path = tmp_path / "big.png"
    path.write_bytes(_png_header(7300, 5500))  # 40.2 Mpx: under PIL's 89 Mpx bomb limit
    line = _refused(capsys, "--prompt", "hi", *["--image", str(path)] * count)
    assert "is 7300x5500 (40.1 Mpx); this model decodes at most 16.0 Mpx per image: downscale it" in line


def test_image_limits_follow_the_processor(loaded_models):
    from vlkv.runtime.models.images import PIXEL_CEILING, PIXEL_FLOOR, ImageLimits, image_limits

    for name, model in loaded_models.items():
        limits = image_limits(model.processor)
        assert PIXEL_FLOOR <= limits.max_pixels <= PIXEL_CEILING, name
        # load_image without a model (the linker's identity hash) never refuses what encoding took
        assert ImageLimits().max_pixels >= limits.max_pixels and ImageLimits().max_aspect >= limits.max_aspect
    assert image_limits(loaded_models["tiny-llava"].processor).shortest_edge == 56
    assert image_limits(loaded_models["tiny-qwen2-vl"].processor).shortest_edge == 0  # bounded by max_pixels
    # A shortest-edge resize of a thin image is what costs memory: 2000 px short side at 150:1 is 600 Mpx.
    with pytest.raises(ValueError, match="resized to a 2000 px short side it would be 600.0 Mpx"):
        ImageLimits(32_000_000, 200, 2000).check(150, 1, "image")
    with pytest.raises(ValueError, match="max_aspect must be >= 1"):
        ImageLimits(max_aspect=0.5)


def test_python_api_images_zero_size_and_paths(engines, tmp_path):
    from PIL import Image

    engine = engines["tiny-llava"]
    with pytest.raises(ValueError, match=r"^image 1 is 0x0: an image needs at least one pixel on each side$"):
        engine.encode([Prompt("hi", [Image.new("RGB", (0, 0))])])
    path = tmp_path / "pic.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(path)
    by_path = engine.encode([Prompt("hi", [path])])  # a pathlib.Path simply works
    by_str = engine.encode([Prompt("hi", [str(path)])])
    assert by_path.input_ids.equal(by_str.input_ids)
    assert by_path.prompts[0].vision["pixel_values"].equal(by_str.prompts[0].vision["pixel_values"])


def test_not_an_image(capsys, no_model_compute, tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not a picture")
    assert f"cannot read image {path}" in _refused(capsys, "--prompt", "hi", "--image", str(path))
