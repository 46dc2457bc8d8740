"""Images for prompts: files on disk, or built-in synthetic pictures so demos and tests need no files.

A built-in spec is ``builtin:NAME`` or ``builtin:NAME:WxH`` (default 112x112), e.g.
``builtin:checkerboard``, ``builtin:gradient:96x64``, ``builtin:noise``. ``noise`` is seeded, so the
same spec always gives the same pixels.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import numpy as np
from PIL import Image

BUILTIN_PREFIX = "builtin:"
DEFAULT_SIZE = (112, 112)  # (width, height): one 2x2-tile image for every tiny model
NOISE_SEED = 0
MAX_SIDE = 4096


def _checkerboard(width: int, height: int) -> np.ndarray:
    """8 px squares alternating between two colours; (height, width, 3) uint8."""
    y, x = np.mgrid[0:height, 0:width]
    on = ((x // 8 + y // 8) % 2).astype(bool)
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[on] = (230, 230, 40)
    out[~on] = (30, 40, 160)
    return out


def _gradient(width: int, height: int) -> np.ndarray:
    """Red rises left→right, green top→bottom, blue is constant; (height, width, 3) uint8."""
    red = np.linspace(0, 255, width, dtype=np.float64)[None, :].repeat(height, 0)
    green = np.linspace(0, 255, height, dtype=np.float64)[:, None].repeat(width, 1)
    blue = np.full((height, width), 128.0)
    return np.stack([red, green, blue], axis=-1).round().astype(np.uint8)


def _noise(width: int, height: int) -> np.ndarray:
    """Uniform RGB noise from a fixed seed; (height, width, 3) uint8."""
    return np.random.default_rng(NOISE_SEED).integers(0, 256, (height, width, 3), dtype=np.uint8)


BUILTINS: dict[str, Callable[[int, int], np.ndarray]] = {
    "checkerboard": _checkerboard,
    "gradient": _gradient,
    "noise": _noise,
}


def _builtin(spec: str) -> Image.Image:
    name, _, size = spec[len(BUILTIN_PREFIX) :].partition(":")
    if name not in BUILTINS:
        raise ValueError(
            f"unknown built-in image {spec!r}; known: {', '.join(BUILTIN_PREFIX + n for n in BUILTINS)}"
        )
    width, height = DEFAULT_SIZE
    if size:
        w, sep, h = size.partition("x")
        if not (sep and w.isdigit() and h.isdigit() and 1 <= int(w) <= MAX_SIDE and 1 <= int(h) <= MAX_SIDE):
            raise ValueError(
                f"built-in image size must be WxH with sides in [1, {MAX_SIDE}], got {size!r} in {spec!r}"
            )
        width, height = int(w), int(h)
    return Image.fromarray(BUILTINS[name](width, height))


def load_image(path_or_spec: str | os.PathLike | Image.Image) -> Image.Image:
    """Return an RGB ``PIL.Image`` from a file path, a ``builtin:`` spec, or an image (converted).

    Raises ``FileNotFoundError`` naming the path when a file is missing and ``ValueError`` for a bad
    built-in spec or an unreadable file; every message is one line.
    """
    if isinstance(path_or_spec, Image.Image):
        return path_or_spec.convert("RGB")
    spec = os.fspath(path_or_spec)
    if spec.startswith(BUILTIN_PREFIX):
        return _builtin(spec)
    if not os.path.isfile(spec):
        raise FileNotFoundError(
            f"image file not found: {spec} (or use one of: {', '.join(BUILTIN_PREFIX + n for n in BUILTINS)})"
        )
    try:
        with warnings.catch_warnings():
            # Between MAX_IMAGE_PIXELS and twice that PIL only warns; the size check below refuses.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(spec) as img:
                _check_pixels(spec, *img.size)
                return img.convert("RGB")
    except Image.DecompressionBombError as exc:
        # PIL refuses at open() above twice the limit, before the size is readable here.
        why = str(exc).splitlines()[0].rstrip(".")
        raise ValueError(f"image {spec} is too large to decode safely ({why}): downscale it") from None
    except OSError as exc:
        raise ValueError(f"cannot read image {spec}: {str(exc).splitlines()[0]}") from None


def _check_pixels(spec: str, width: int, height: int) -> None:
    """Refuse images above PIL's decompression-bomb limit (about 89 Mpx): decoding one takes GBs."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise ValueError(
            f"image {spec} is {width}x{height} ({width * height / 1e6:.1f} Mpx), above the "
            f"{limit / 1e6:.1f} Mpx limit (PIL.Image.MAX_IMAGE_PIXELS): downscale it"
        )
