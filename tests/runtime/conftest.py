"""Fixtures of the CLI refusal tests (test_cli_errors.py, test_cli_image_errors.py)."""

from __future__ import annotations

import pytest

from vlkv.runtime.engine import Engine


@pytest.fixture
def no_model_compute(monkeypatch):
    def ran(*args, **kwargs):
        raise AssertionError("the model ran although the input should have been refused")

    monkeypatch.setattr(Engine, "generate", ran)
    monkeypatch.setattr(Engine, "prefill", ran)


@pytest.fixture
def no_decode(monkeypatch):
    """Decoding any image file's pixels fails the test: a refusal must come from the header alone."""
    from PIL import ImageFile

    def decoded(self, *args, **kwargs):
        raise AssertionError(f"pixels of a {self.size} image were decoded although its size is refused")

    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
