"""The explicit policy registry: names → policy classes, resolved in :func:`make_policy`."""

from __future__ import annotations

import dataclasses

from vlkv.runtime.policies.base import Policy
from vlkv.runtime.policies.elastic import ElasticPolicy
from vlkv.runtime.policies.full import FullPolicy
from vlkv.runtime.policies.h2o import H2OPolicy
from vlkv.runtime.policies.local import LocalPolicy
from vlkv.runtime.policies.snapkv import SnapKVPolicy

POLICIES: dict[str, type[Policy]] = {
    "full": FullPolicy,
    "local": LocalPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "elastic": ElasticPolicy,
}


def policy_fields(name: str) -> list[str]:
    """Settable fields of a registered policy."""
    return [f.name for f in dataclasses.fields(_resolve(name)) if f.init]


def _resolve(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    return POLICIES[name]


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy by name; unknown names or fields raise ``ValueError`` naming them."""
    cls = _resolve(name)
    known = set(policy_fields(name))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)} for policy {name!r}; known: {', '.join(sorted(known))}"
        )
    return cls(**kwargs)
