"""The two ways a stage can stop without producing its outputs."""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage failed; the message is one line that says what and where (never a traceback)."""


class StageSkipped(RuntimeError):
    """A stage cannot run on this machine (TensorRT or TensorRT-LLM missing); the message says so in one line."""
