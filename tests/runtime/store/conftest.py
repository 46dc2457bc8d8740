"""One tiny model for the tests that need a real pool and real weights."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llava():
    from vlkv.runtime.models.registry import load_model

    return load_model("tiny-llava")
