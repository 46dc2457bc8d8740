from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vlkv.runtime.models.images import BUILTINS, load_image


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtins_are_rgb_default_size_and_deterministic(name):
    a, b = load_image(f"builtin:{name}"), load_image(f"builtin:{name}")
    assert a.mode == "RGB" and a.size == (112, 112)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(a).std() > 10  # not a flat picture


def test_builtin_size_is_width_by_height():
    img = load_image("builtin:gradient:96x64")
    assert img.size == (96, 64)
    px = np.asarray(img)
    assert tuple(px[0, 0]) == (0, 0, 128) and tuple(px[-1, -1]) == (255, 255, 128)


def test_checkerboard_alternates_every_8_pixels():
    px = np.asarray(load_image("builtin:checkerboard:32x16"))
    assert np.array_equal(px[0, 0], px[0, 7]) and not np.array_equal(px[0, 7], px[0, 8])
    assert np.array_equal(px[0, 0], px[8, 8]) and not np.array_equal(px[0, 0], px[8, 0])


def test_builtins_differ():
    arrays = [np.asarray(load_image(f"builtin:{n}")) for n in sorted(BUILTINS)]
    assert not np.array_equal(arrays[0], arrays[1]) and not np.array_equal(arrays[1], arrays[2])


def test_file_round_trip_and_conversion(tmp_path):
    gray = Image.fromarray(np.arange(64 * 48, dtype=np.uint32).reshape(48, 64).astype(np.uint8) % 251)
    path = tmp_path / "gray.png"
    gray.save(path)
    img = load_image(path)
    assert img.mode == "RGB" and img.size == (64, 48)
    assert np.array_equal(np.asarray(img)[..., 1], np.asarray(gray))
    assert load_image(gray).mode == "RGB"


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.png"
    with pytest.raises(FileNotFoundError) as exc:
        load_image(str(path))
    assert str(path) in _one_line(exc)


def test_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "text.png"
    path.write_text("not an image")
    with pytest.raises(ValueError) as exc:
        load_image(path)
    assert str(path) in _one_line(exc)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("builtin:plaid", "builtin:plaid"),
        ("builtin:noise:0x5", "0x5"),
        ("builtin:noise:12", "12"),
        ("builtin:noise:axb", "axb"),
    ],
)
def test_bad_builtin_specs(spec, needle):
    with pytest.raises(ValueError) as exc:
        load_image(spec)
    assert needle in _one_line(exc)
