"""The training tests' script module."""

from __future__ import annotations

import pytest

from tests.eval import train_script


@pytest.fixture(scope="session")
def tp():
    return train_script.load()
