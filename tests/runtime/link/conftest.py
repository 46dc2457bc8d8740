"""The tiny test models have random weights and no saved ``vlkv link-check``: linking is default-deny,
so every test here opts in explicitly (as an operator would with ``VLKV_LINK_UNCHECKED=1``), and
subprocesses it starts inherit the opt-in. Tests of the default itself remove it."""

from __future__ import annotations

import pytest

from vlkv.runtime.link.gate import UNCHECKED_ENV


@pytest.fixture(autouse=True)
def unchecked_linking(monkeypatch):
    monkeypatch.setenv(UNCHECKED_ENV, "1")
