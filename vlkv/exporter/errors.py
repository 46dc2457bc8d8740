"""The two ways a stage can stop without producing its outputs."""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage failed; the message is one line that says what and where (never a traceback)."""


class StageSkipped(RuntimeError):
    """A stage cannot run on this machine (TensorRT or TensorRT-LLM missing); the message says so in one line."""


class BuildLocked(RuntimeError):
    """Another live build-engine holds the output folder; the message names it, in one line."""
