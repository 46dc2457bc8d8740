"""One-node ``Reshape`` / ``Expand`` for tracing.

Tracing ``x.view(b, q, H, D)`` with dynamic ``b, q`` writes a Shape/Gather/Unsqueeze/Concat chain per
call; a decoder graph has hundreds of them, which slows both the export and every ONNX Runtime step.
These autograd functions export as ONE node with a constant shape instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _Reshape(torch.autograd.Function):
    """``Reshape`` with ONNX semantics (0 copies the input's dim, -1 is inferred)."""

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.long)))


class _Expand(torch.autograd.Function):
    """``Expand`` to a constant broadcast shape (1 = keep that dim of ``x``)."""

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return x.expand([-1 if s == 1 else s for s in shape])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Expand", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.long)))


def reshape(x: Tensor, *shape: int) -> Tensor:
    """``x`` reshaped to ``shape`` (0 = keep that dim of ``x``, -1 = inferred)."""
    return _Reshape.apply(x, shape)


def expand(x: Tensor, *shape: int) -> Tensor:
    """``x`` broadcast to ``shape`` (1 = keep that dim of ``x``, which may itself be 1 or the target)."""
    return _Expand.apply(x, shape)
