"""Tables and dropped columns the one-column drop's tests share (``test_drops``, ``test_drops_shift``), and
their fixture: the C++ kernel they compare with must have built."""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.evict_rows as evict_rows


@pytest.fixture(autouse=True)
def _kernel_built():
    """Every test here compares the C++ kernel with torch; a C++ compiler is part of the CPU test
    environment (``.ci/run``)."""
    if evict_rows.kernel() is None:
        pytest.fail("the evict-rows kernel did not build (is a C++ compiler installed?)")


def _tables(layers: int, b: int, h: int, c: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        out.append(
            [
                torch.randint(0, 10_000, (b, h, c), generator=g),  # slots
                torch.randint(0, 10_000, (b, h, c, 3), generator=g),  # positions (M-RoPE)
                torch.randint(0, 4, (b, h, c), generator=g).to(torch.int8),  # modality
                torch.randint(0, 10_000, (b, h, c), generator=g),  # order
                torch.randn(b, h, c, generator=g),  # a running score
            ]
        )
    return out


def _dropped_columns(layers: int, b: int, h: int, n: int, where: str) -> torch.Tensor:
    """(layers, b, h) int64: one column in [0, n) per row — seeded anywhere, all first or all last."""
    if where == "anywhere":
        return torch.randint(0, n, (layers, b, h), generator=torch.Generator().manual_seed(n))
    return torch.full((layers, b, h), 0 if where == "first" else n - 1)
