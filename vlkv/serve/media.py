"""Image parts → RGB PIL images: ``data:`` base64 URLs, and local files only under the media dir.

Every refusal is a :class:`MediaError` with one line naming the part; nothing here touches the
network (http(s) URLs are refused), and a path is resolved (``..`` and symlinks followed) before it
is checked against ``--allowed-media-dir``, so neither can lead outside it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from urllib.parse import unquote, urlparse

from PIL import Image

from vlkv.runtime.models.images import ImageLimits


class MediaError(ValueError):
    """An image part that cannot be used (one-line message)."""


def load_part(url: str, where: str, media_dir: str | None, max_bytes: int, limits: ImageLimits | None = None):
    """One ``image_url.url`` → an RGB ``PIL.Image``.

    Args:
        url: ``data:image/...;base64,...``, ``file:///abs/path`` or a plain path.
        where: the part's position for messages (``messages[0].content[1]``).
        media_dir: the resolved ``--allowed-media-dir`` (None: local files are refused).
        max_bytes: largest encoded image accepted.
        limits: the model's :class:`ImageLimits` (sides, aspect ratio, pixels), checked on the header
            before anything is decoded (default: the model-independent ones).
    """
    limits = limits or ImageLimits()
    if url.startswith("data:"):
        return _decode(_data_url(url, where, max_bytes), where, limits)
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        raise MediaError(f"{where}: http(s) image URLs are not fetched by this server; send a data: URL")
    if scheme == "file":
        path = unquote(urlparse(url).path)
    elif scheme and len(scheme) > 1:  # "c:" would be a Windows drive, not a scheme
        raise MediaError(f"{where}: unsupported image URL scheme {scheme!r} (data:, file:// or a path)")
    else:
        path = url
    return _decode(_local(path, where, media_dir, max_bytes), where, limits)


def _data_url(url: str, where: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{where}: data URL has no ',' before its payload")
    kind, *params = head[len("data:") :].split(";")
    if kind and not kind.startswith("image/"):
        raise MediaError(f"{where}: data URL media type must be image/*, got {kind[:40]!r}")
    if "base64" not in params:
        raise MediaError(f"{where}: data URL must be base64-encoded (data:image/...;base64,...)")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise MediaError(f"{where}: image is larger than this server's limit of {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaError(f"{where}: broken base64 in data URL ({err})") from None


def _local(path: str, where: str, media_dir: str | None, max_bytes: int) -> bytes:
    if media_dir is None:
        raise MediaError(f"{where}: local image files are refused (the server has no --allowed-media-dir)")
    full = os.path.realpath(os.path.join(media_dir, path))  # an absolute path replaces media_dir
    if os.path.commonpath([full, media_dir]) != media_dir:
        raise MediaError(f"{where}: image path is outside the allowed media dir")
    if not os.path.isfile(full):
        raise MediaError(f"{where}: image file not found under the allowed media dir: {path[:80]}")
    if os.path.getsize(full) > max_bytes:
        raise MediaError(f"{where}: image file is larger than this server's limit of {max_bytes} bytes")
    with open(full, "rb") as f:
        return f.read(max_bytes + 1)


def _decode(data: bytes, where: str, limits: ImageLimits):
    """Bytes → RGB image, refusing anything that is not an image, is a decompression bomb or has a
    size past ``limits`` (read from the header: ``Image.open`` is lazy, ``load`` decodes)."""
    if not data:
        raise MediaError(f"{where}: image payload is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                try:
                    limits.check(*img.size, f"{where}: image")
                except ValueError as err:
                    raise MediaError(str(err)) from None
                img.load()
                return img.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(f"{where}: image is too large to decode safely: downscale it") from None
    except (OSError, ValueError, SyntaxError) as err:  # PIL raises all three for bad files
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MediaError(f"{where}: payload is not a readable image ({why[:120]})") from None
