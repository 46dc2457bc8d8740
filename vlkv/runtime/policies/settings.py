"""Policy settings as a user gives them (``vlkv generate --set``, the server's ``vlkv.settings``):
the default budget, type checks against the policy's dataclass fields, and the settings that would
keep every entry and so silently turn compression off.

Every check raises :class:`SettingError` with one line; ``prefix`` is how the caller names a setting
(``"--set "`` on the command line, ``"vlkv.settings."`` in a request body).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

from vlkv.runtime.policies.registry import POLICIES, policy_fields

# The kept fraction for compressing policies when the user names no budget; "full" needs none.
DEFAULT_BUDGET = 0.5
NO_BUDGET = ("full",)


class SettingError(ValueError):
    """A policy setting that cannot be used (one-line message naming it)."""


def default_budget(policy: str, settings: dict | None = None) -> dict:
    """``{"budget": DEFAULT_BUDGET}`` for a policy that compresses by budget, else ``{}``.

    ``full`` takes no budget, and a policy whose lossless axis is another knob (attnpack's rank,
    ``exact_at_full_budget = False``) keeps its own default unless it evicts too (``evict=NAME``).
    """
    cls = POLICIES.get(policy)
    if policy in NO_BUDGET or cls is None:
        return {}
    if not getattr(cls, "exact_at_full_budget", True) and not (settings or {}).get("evict"):
        return {}
    return {"budget": DEFAULT_BUDGET}


def _allowed(cls, name: str) -> set:
    hint = typing.get_type_hints(cls)[name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return set(typing.get_args(hint)) if union else {hint}


def setting_types(policy: str) -> dict[str, set]:
    """Setting name → allowed Python types, from the policy's (and allocators') dataclass fields."""
    from vlkv.runtime.policies.allocators import ALLOCATORS
    from vlkv.runtime.policies.registry import ALLOCATOR_PREFIX

    out: dict[str, set] = {}
    cls = POLICIES.get(policy)
    if cls is None:
        return out  # make_policy names the unknown policy
    for f in dataclasses.fields(cls):
        if f.init:
            out[f.name] = _allowed(cls, f.name)
    for name in policy_fields(policy):
        if name == "allocator" and name not in out:
            out[name] = {str}
        elif name.startswith(ALLOCATOR_PREFIX) and name not in out:
            bare = name[len(ALLOCATOR_PREFIX) :]
            out[name] = set().union(
                *(
                    _allowed(a, bare)
                    for a in ALLOCATORS.values()
                    if bare in {f.name for f in dataclasses.fields(a)}
                )
            )
    return out


def _type_ok(value, kinds: set) -> bool:
    if value is None:
        return type(None) in kinds
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    if isinstance(value, float):
        return float in kinds and math.isfinite(value)
    return isinstance(value, str) and str in kinds


def check_setting_types(policy: str, settings: dict, prefix: str = "") -> None:
    """Refuse a setting of the wrong type (a string for a number, null, a list, NaN)."""
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
    types_ = setting_types(policy)
    for key, value in settings.items():
        kinds = types_.get(key)
        if kinds is None or _type_ok(value, kinds):
            continue  # unknown keys are named by make_policy
        want = " or ".join(names.get(k, "null") for k in sorted(kinds, key=str))
        raise SettingError(
            f"{prefix}{key} must be {want} for policy {policy!r}, got {json.dumps(value, default=str)}"
        )


def check_setting_sizes(settings: dict, limit: int | None, model: str, prefix: str = "") -> None:
    """An integer setting (a count of slots, tokens or layers) past the position limit fits no prompt."""
    if limit is None:
        return
    for key, value in settings.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise SettingError(
                f"{prefix}{key}={value} is past {model}'s position limit of {limit}: no prompt is that long"
            )


def _unwrapped(policy):
    """The policy inside a cadence (``inner``) or allocation (``scorer``) wrapper."""
    while True:
        inner = getattr(policy, "inner", None) or getattr(policy, "scorer", None)
        if inner is None or not hasattr(inner, "budget"):
            return policy
        policy = inner


def check_compresses(policy, settings: dict, prompt_tokens: int, prefix: str = "") -> None:
    """Refuse given settings that keep every entry of a ``prompt_tokens``-long prompt at budget < 1.

    A policy lists in ``always_kept`` the integer settings whose entries it keeps whatever the
    budget (``local``'s sinks, ``elastic``'s start and recent); with one more entry, which every such
    policy keeps, they hold the whole prompt once their sum reaches its length: the run would report
    ``budget 0.5`` and keep the full cache. Defaults are not refused, only settings the user gave.
    """
    inner = _unwrapped(policy)
    budget = float(getattr(inner, "budget", 1.0))
    names = getattr(type(inner), "always_kept", ())
    given = [n for n in names if n in settings]
    if budget >= 1.0 or not given:
        return
    kept = sum(int(getattr(inner, n)) for n in names) + 1
    if kept < prompt_tokens:
        return
    shown = ", ".join(f"{prefix}{n}={settings[n]}" for n in given)
    fix = "lower it" if len(given) == 1 else "lower them"
    raise SettingError(
        f"{shown} keeps all {prompt_tokens} entries of the prompt (policy {inner.name!r} always keeps "
        f"{' + '.join(names)} + one more entry = {kept}), so budget {budget:g} compresses nothing: "
        f"{fix} until that sum is under {prompt_tokens}"
    )
