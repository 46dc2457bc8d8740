"""Fixtures for the model-registry tests: built-in images and per-family prompts."""

from __future__ import annotations

import pytest

from vlkv.runtime.models.images import load_image
from vlkv.runtime.models.registry import load_model

# Two images whose token counts differ for the size-dependent families (see test_tiny.py).
IMAGE_SPECS = ("builtin:noise", "builtin:gradient:96x64")


@pytest.fixture(scope="session")
def two_images():
    """A 112x112 and a 96x64 (width x height) RGB image."""
    return [load_image(spec) for spec in IMAGE_SPECS]


@pytest.fixture
def tiny():
    """A fresh tiny LLaVA per test (the projector tests install modules into it)."""
    return load_model("tiny-llava")
