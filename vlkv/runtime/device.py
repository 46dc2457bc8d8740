"""The one place a device name becomes a ``torch.device`` (CLI, scripts, server)."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` → a device that exists here; else a one-line ``ValueError``."""
    try:
        dev = torch.device(name) if not isinstance(name, torch.device) else name
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {str(name)!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(name)!r}: no CUDA device is available here (torch.cuda.is_available() is False)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev
