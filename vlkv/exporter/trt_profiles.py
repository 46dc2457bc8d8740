"""TensorRT optimisation-profile shapes, derived from an ONNX graph's symbolic input dims (pure Python).

Each input dim is an int or a symbolic name (``batch_size``), possibly a sum such as
``past_sequence_length + sequence_length``. A per-layer name such as ``past_sequence_length_3`` takes
the value of ``past_sequence_length`` unless the profile names it explicitly. A profile gives ``[min, opt, max]`` per name; an input's
min/opt/max shapes follow by evaluating each dim. Nothing here needs TensorRT, so profiles are
checked against the graph on every machine.
"""

from __future__ import annotations

import re
from pathlib import Path

from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe import Recipe

Dim = int | str
Shape3 = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_TERM = re.compile(r"\s*([+-]?)\s*([A-Za-z_][\w.]*|\d+)\s*")


def onnx_inputs(onnx_path: str | Path) -> list[tuple[str, list[Dim]]]:
    """Graph inputs (initializers excluded) as ``(name, dims)``; unnamed dynamic dims become ``"?"``."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims: list[Dim] = []
        for d in value.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
        inputs.append((value.name, dims))
    return inputs


def eval_dim(dim: Dim, values: dict[str, int]) -> int:
    """Evaluate an int, a name, or a sum/difference of names and ints, e.g. ``"past + seq"``."""
    if isinstance(dim, int):
        return dim
    pos, total = 0, 0
    while pos < len(dim):
        match = _TERM.match(dim, pos)
        if match is None or match.end() == pos:
            raise KeyError(dim)
        sign, term = match.groups()
        value = int(term) if term.isdigit() else _lookup(term, values)
        total += -value if sign == "-" else value
        pos = match.end()
    return total


def _lookup(symbol: str, values: dict[str, int]) -> int:
    # Per-layer axes (past_sequence_length_3) fall back to the shared name unless given explicitly.
    if symbol in values:
        return values[symbol]
    base, _, index = symbol.rpartition("_")
    if base and index.isdigit() and base in values:
        return values[base]
    raise KeyError(symbol)


def profile_shapes(
    inputs: list[tuple[str, list[Dim]]], dims: dict[str, list[int]], label: str
) -> dict[str, Shape3]:
    """min/opt/max shape per input for one profile.

    Raises:
        StageError: an input dim names a symbol the profile does not give.
    """
    shapes: dict[str, Shape3] = {}
    for name, input_dims in inputs:
        triple = []
        for k in range(3):
            values = {sym: v[k] for sym, v in dims.items()}
            try:
                triple.append(tuple(eval_dim(d, values) for d in input_dims))
            except KeyError:
                missing = [d for d in input_dims if isinstance(d, str)]
                raise StageError(
                    f"profile {label}: input {name} has dims {missing} but the profile gives only {sorted(dims)}"
                ) from None
        shapes[name] = (triple[0], triple[1], triple[2])
    return shapes


def vision_dims(recipe: Recipe) -> dict[str, list[int]]:
    """The vision graph's symbols: ``batch`` (LLaVA) and ``num_patches`` (Qwen2-VL)."""
    v = recipe.vision
    return {
        "batch": [v.min_batch, v.opt_batch, v.max_batch],
        "num_patches": [v.min_patches, v.opt_patches, v.max_patches],
    }


def engine_profiles(
    onnx_path: str | Path, profiles: list[tuple[str, dict[str, list[int]]]]
) -> dict[str, dict[str, Shape3]]:
    """``{profile name: {input: (min, opt, max)}}`` for a graph and named dim tables."""
    inputs = onnx_inputs(onnx_path)
    return {label: profile_shapes(inputs, dims, label) for label, dims in profiles}
