"""Content-keyed export cache: one directory per (graph format, model, versions, exporter code).

An entry is ``$VLKV_ONNX_CACHE/<key[:24]>/`` (default ``~/.cache/vlkv/onnx``). It is built in a
temporary sibling directory and renamed into place, so a concurrent or interrupted export never
leaves half an entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

CACHE_ENV = "VLKV_ONNX_CACHE"
# Elements of each weight tensor that enter the key (plus the tensor's sum): hashing all of a 7B
# model's bytes would cost seconds on every start; distinct weights differ in a strided sample.
_KEY_SAMPLE = 4096


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vlkv" / "onnx")


def export_key(head: dict, modules: Iterable[torch.nn.Module], code: Iterable[str | Path]) -> str:
    """Hex sha256 naming an export: ``head`` (format, family, opset, config...), the package versions,
    the source of the ``code`` files that define the graph (a changed graph must never be served from
    an old entry) and a strided sample plus the sum of every weight of ``modules``."""
    import onnx
    import transformers

    h = hashlib.sha256()
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
    }
    sources = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in code]
    h.update(json.dumps({**head, **versions, "code": sources}, sort_keys=True, default=str).encode())
    for module in modules:
        for name, t in module.state_dict().items():
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _KEY_SAMPLE)][:_KEY_SAMPLE].float().cpu().numpy()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{float(flat.sum(dtype=torch.float64))!r}".encode())
            h.update(sample.tobytes())
    return h.hexdigest()


def cached_entry(
    key: str, marker: str, build: Callable[[Path], None], cache_dir: str | Path | None = None
) -> Path:
    """The cache directory of ``key``; ``build(tmp_dir)`` fills it when ``marker`` (a file name in it)
    is missing."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / key[:24]
    if (target / marker).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its export is identical
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
