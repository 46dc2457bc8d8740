"""Plugin tests run the Triton kernels on CPU through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, which is why it is set here, at conftest
import time, and not in a fixture.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
