"""The explicit backend registry: names → factories taking a loaded model."""

from __future__ import annotations

from collections.abc import Callable


def _torch(loaded):
    from vlkv.runtime.torch_backend import TorchBackend

    return TorchBackend(loaded.model, loaded.family, loaded.image_token_id)


def _onnxruntime(loaded):
    from vlkv.runtime.ort_backend import OrtBackend

    return OrtBackend(loaded.model, loaded.family, loaded.image_token_id)


BACKENDS: dict[str, Callable] = {"torch": _torch, "onnxruntime": _onnxruntime}


def make_backend(name: str, loaded):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    return BACKENDS[name](loaded)
