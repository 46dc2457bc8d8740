"""Images for prompts: files on disk, or built-in synthetic pictures so demos and tests need no files.

A built-in spec is ``builtin:NAME`` or ``builtin:NAME:WxH`` (default 112x112), e.g.
``builtin:checkerboard``, ``builtin:gradient:96x64``, ``builtin:noise``. ``noise`` is seeded, so the
same spec always gives the same pixels.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

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


# ---------------------------------------------------------------- size limits
# Qwen2-VL's own processor refuses an aspect ratio past 200; past it every processor either refuses
# or, for a shortest-edge resize (CLIP / LLaVA), makes an intermediate image aspect x wider than it keeps.
MAX_ASPECT = 200
# Decoding more pixels than this per image is refused whatever the model keeps: 32 Mpx is ~96 MB RGB.
PIXEL_CEILING = 32_000_000
# ...and up to this much is accepted whatever the model keeps, so a 12-16 Mpx photo works on a small model.
PIXEL_FLOOR = 16_000_000
# Decoding up to 16x per side more than the processor keeps is useful headroom; more is wasted memory.
OVERSAMPLE = 256


@dataclass(frozen=True)
class ImageLimits:
    """What a model's image processor makes of an image, as limits checked before pixels are decoded.

    Attributes:
        max_pixels: largest ``width * height`` decoded (derived from what the processor keeps).
        max_aspect: largest ``long side / short side``.
        shortest_edge: the side a shortest-edge resize scales the short side to (0: none), whose
            intermediate image (``shortest_edge**2 * aspect`` pixels) must fit ``max_pixels`` too.
    """

    # The defaults (no model named) are the loosest any model gets: never stricter than image_limits().
    max_pixels: int = PIXEL_CEILING
    max_aspect: float = MAX_ASPECT
    shortest_edge: int = 0

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if self.max_aspect < 1:
            raise ValueError(f"max_aspect must be >= 1, got {self.max_aspect}")
        if self.shortest_edge < 0:
            raise ValueError(f"shortest_edge must be >= 0, got {self.shortest_edge}")

    def check(self, width: int, height: int, what: str = "image") -> None:
        """Raise ``ValueError`` (one line naming ``what`` and the limit) for a size the model should not decode."""
        if width < 1 or height < 1:
            raise ValueError(f"{what} is {width}x{height}: an image needs at least one pixel on each side")
        aspect = max(width, height) / min(width, height)
        if aspect > self.max_aspect:
            raise ValueError(
                f"{what} is {width}x{height}, aspect ratio {aspect:.0f}:1; this model takes at most "
                f"{self.max_aspect:g}:1: crop it"
            )
        if width * height > self.max_pixels:
            raise ValueError(
                f"{what} is {width}x{height} ({width * height / 1e6:.1f} Mpx); this model decodes at most "
                f"{self.max_pixels / 1e6:.1f} Mpx per image: downscale it"
            )
        resized = self.shortest_edge**2 * aspect
        if resized > self.max_pixels:
            raise ValueError(
                f"{what} is {width}x{height}: resized to a {self.shortest_edge} px short side it would be "
                f"{resized / 1e6:.1f} Mpx, above this model's {self.max_pixels / 1e6:.1f} Mpx: crop it"
            )


def _field(obj, name: str):
    """``obj.name`` or ``obj[name]`` (HF keeps sizes in dicts or ``SizeDict``s), else None."""
    if obj is None:
        return None
    value = getattr(obj, name, None)
    if value is None and isinstance(obj, dict):
        value = obj.get(name)
    return value


def image_limits(processor) -> ImageLimits:
    """The :class:`ImageLimits` of an HF processor (or image processor), from the pixels it keeps.

    Kept pixels: Qwen2-VL's ``max_pixels``; LLaVA-NeXT's largest grid pinpoint plus its base image;
    otherwise the crop (or fixed resize) size. The cap is ``OVERSAMPLE`` x that, within
    ``[PIXEL_FLOOR, PIXEL_CEILING]``.
    """
    ip = getattr(processor, "image_processor", processor)
    size, crop = getattr(ip, "size", None), getattr(ip, "crop_size", None)
    shortest = _field(size, "shortest_edge") or 0
    kept = 0
    if getattr(ip, "merge_size", None) is not None:  # Qwen2-VL: size.longest_edge is max_pixels
        kept = (
            getattr(ip, "max_pixels", None) or _field(size, "max_pixels") or _field(size, "longest_edge") or 0
        )
        shortest = 0  # smart_resize bounds its output by max_pixels, whatever the aspect ratio
    else:
        pinpoints = getattr(ip, "image_grid_pinpoints", None) or []
        base = (_field(crop, "height") or shortest or 0) * (_field(crop, "width") or shortest or 0)
        fixed = (_field(size, "height") or 0) * (_field(size, "width") or 0)
        kept = max([h * w for h, w in pinpoints] + [0]) + max(base, fixed)
    cap = min(PIXEL_CEILING, max(PIXEL_FLOOR, OVERSAMPLE * int(kept)))
    return ImageLimits(cap, MAX_ASPECT, int(shortest))


def load_image(
    path_or_spec: str | os.PathLike | Image.Image, limits: ImageLimits | None = None
) -> Image.Image:
    """Return an RGB ``PIL.Image`` from a file path, a ``builtin:`` spec, or an image (converted).

    ``limits`` (default: :class:`ImageLimits`'s) are checked on the header, before any pixel is
    decoded. Raises ``FileNotFoundError`` naming the path when a file is missing and ``ValueError``
    for a bad built-in spec, an unreadable file or a size past the limits; every message is one line.
    """
    limits = limits or ImageLimits()
    if isinstance(path_or_spec, Image.Image):
        limits.check(*path_or_spec.size, "image")
        return path_or_spec.convert("RGB")
    spec = os.fspath(path_or_spec)
    if spec.startswith(BUILTIN_PREFIX):
        img = _builtin(spec)
        limits.check(*img.size, spec)
        return img
    if not os.path.isfile(spec):
        raise FileNotFoundError(
            f"image file not found: {spec} (or use one of: {', '.join(BUILTIN_PREFIX + n for n in BUILTINS)})"
        )
    try:
        with warnings.catch_warnings():
            # Between MAX_IMAGE_PIXELS and twice that PIL only warns; the size checks below refuse.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(spec) as img:  # lazy: reads the header only
                _check_pixels(spec, *img.size)
                limits.check(*img.size, f"image {spec}")
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
