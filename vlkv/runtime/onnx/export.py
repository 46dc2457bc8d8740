"""Trace a module to ONNX with the legacy TorchScript exporter and save it (external data when large).

The legacy exporter is fast and handles per-layer dynamic axes (toolchain.md A6); the dynamo exporter
is not used.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# ORT 1.31 reads IR <= 13; onnx 1.23 would write 14 (toolchain.md, onnx_ort.IR_VERSION).
IR_VERSION = 10
# Above this many bytes of weights a model is saved with external data (protobuf's 2 GiB limit).
EXTERNAL_DATA_BYTES = 1 << 30


def trace_to_onnx(
    module: nn.Module,
    feeds: dict[str, torch.Tensor],
    path: str | Path,
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    opset: int = 17,
    finish: Callable | None = None,
) -> Path:
    """Export ``module(*feeds.values())`` to ``path``; graph inputs are named after ``feeds``' keys.

    ``finish(proto) -> proto`` may edit the loaded model before it is checked and saved.
    """
    import onnx

    if opset < 14:
        raise ValueError(f"opset must be >= 14, got {opset}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary directory: above 2 GiB the exporter writes one external-data file per weight
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "raw.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
            torch.onnx.export(
                module,
                tuple(feeds.values()),
                str(raw),
                input_names=list(feeds),
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                dynamo=False,
            )
        proto = onnx.load(str(raw))
    if finish is not None:
        proto = finish(proto)
    proto.ir_version = IR_VERSION
    onnx.checker.check_model(proto)
    save_model(proto, path)
    return path


def save_model(proto, path: str | Path) -> None:
    """Save ``proto`` at ``path``, its weights in ``<name>.data`` beside it when over 1 GiB."""
    import onnx

    path = Path(path)
    large = sum(t.ByteSize() for t in proto.graph.initializer) > EXTERNAL_DATA_BYTES
    onnx.save(proto, str(path), save_as_external_data=large, location=path.name + ".data")
