"""Resolve a :class:`Recipe` from defaults → a YAML file → ``--set a.b=c`` overrides.

Values given with ``--set`` are parsed with ``yaml.safe_load`` (``--set trt.fp16=false`` is a bool,
``--set vision.sample_grid_thw=[1,4,4]`` a list). Unknown keys and wrongly typed values are
:class:`RecipeError` lines that name the full dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vlkv.exporter.recipe import Recipe, RecipeError


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """Defaults, then the YAML at ``path`` (if any), then each ``a.b=c`` override, validated.

    Raises:
        RecipeError: one line naming the file, the dotted key or the value at fault.
    """
    # The file is read first so that a missing or broken file fails before anything heavy is imported.
    update = {} if path is None else read_yaml(path)
    data = _merge(_defaults(), update)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return recipe_from_dict(data)


def _defaults() -> dict:
    # Derived fields (profiles from decoder limits, family from the model) must not be frozen into
    # the defaults that a YAML then merges into.
    data = dataclasses.asdict(Recipe())
    data["decoder"]["profiles"] = []
    data["model"]["family"] = "auto"
    return data


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of a recipe file (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise RecipeError(f"recipe file '{path}': invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file '{path}': top level must be a mapping, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=c"`` → ``("a.b", yaml.safe_load("c"))``."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. policy.budget=0.5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise RecipeError(f"--set {key}: cannot parse value {raw!r}") from None
    return key, value


def _merge(base: dict, update: dict) -> dict:
    # Mappings merge key by key; anything else (lists included) replaces the default wholesale.
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where)]
        elif isinstance(node, dict):
            if part not in node:
                # Unknown section names are reported by recipe_from_dict with close matches.
                node[part] = {}
            node = node[part]
        else:
            raise RecipeError(f"--set {key}: '{'.'.join(parts[:depth])}' is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError(f"--set {key}: '{'.'.join(parts[:-1])}' is a value, not a section")


def _list_index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise RecipeError(f"--set {where}: index must be in [0, {len(node)}), got {part!r}")
    return int(part)


def recipe_from_dict(data: dict) -> Recipe:
    """Build and validate a Recipe from plain data; every error is one RecipeError line."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: top level must be a mapping, got {type(data).__name__}")
    return _build(Recipe, data, "")


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=3)
            hint = f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""
            raise RecipeError(f"{prefix}{key}: unknown key{hint}; known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(value, hints[key], f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except RecipeError:
        raise
    except ValueError as exc:
        raise RecipeError(f"{prefix}{exc}") from None


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{key}: expected a list, got {value!r}")
        (item,) = args
        return [_coerce(v, item, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping, got {value!r}")
        if not args:
            return dict(value)
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    return _scalar(value, hint, key)


def _scalar(value: Any, hint: Any, key: str) -> Any:
    # bool is a subclass of int in Python, so it must be rejected explicitly for numeric fields.
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise RecipeError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise RecipeError(f"{key}: expected a string, got {value!r}")
    raise RecipeError(f"{key}: unsupported field type {hint!r}")
