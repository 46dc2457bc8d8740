"""The explicit policy registry: names → policy classes, resolved in :func:`make_policy`.

Any per-entry scoring policy also takes ``allocator=NAME`` (``uniform``, ``pyramid``, ``sparsity``)
plus that allocator's settings prefixed ``allocator_`` (e.g. ``allocator_beta=10``); it then comes
back wrapped in an :class:`~vlkv.runtime.policies.allocators.AllocatedPolicy`.
"""

from __future__ import annotations

import dataclasses

from vlkv.runtime.policies.allocators import ALLOCATORS, NOT_COMPOSABLE, AllocatedPolicy, make_allocator
from vlkv.runtime.policies.attnpack import AttnPackPolicy
from vlkv.runtime.policies.avl import AVLPolicy
from vlkv.runtime.policies.base import Policy
from vlkv.runtime.policies.cadence import Cadence
from vlkv.runtime.policies.elastic import ElasticPolicy
from vlkv.runtime.policies.full import FullPolicy
from vlkv.runtime.policies.h2o import H2OPolicy
from vlkv.runtime.policies.knorm import KnormPolicy
from vlkv.runtime.policies.kvgrad import KVgradPolicy
from vlkv.runtime.policies.kvzip import KVzipPolicy
from vlkv.runtime.policies.local import LocalPolicy
from vlkv.runtime.policies.pyramid import PyramidKVPolicy
from vlkv.runtime.policies.snapkv import SnapKVPolicy
from vlkv.runtime.policies.vlcache import VLCachePolicy

POLICIES: dict[str, type[Policy]] = {
    "full": FullPolicy,
    "local": LocalPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "elastic": ElasticPolicy,
    "pyramidkv": PyramidKVPolicy,
    "vlcache": VLCachePolicy,
    "avl": AVLPolicy,
    "attnpack": AttnPackPolicy,
    "kvzip": KVzipPolicy,
    "kvgrad": KVgradPolicy,
    "knorm": KnormPolicy,
}

ALLOCATOR_PREFIX = "allocator_"

# policies that spread their budget themselves (allocators do not forward the replay request)
_OWN_ALLOCATION = {
    **NOT_COMPOSABLE,
    "kvzip": "it spreads its budget over layers itself (scope=model|layer)",
    "kvgrad": "it spreads its budget over layers itself (scope=model|layer)",
}


def _allocator_fields() -> list[str]:
    names = {f.name for cls in ALLOCATORS.values() for f in dataclasses.fields(cls)}
    return ["allocator", *sorted(ALLOCATOR_PREFIX + n for n in names)]


CADENCE_FIELD = "evict_every"


def policy_fields(name: str) -> list[str]:
    """Settable fields of a registered policy (with the ``allocator`` and cadence settings where it composes)."""
    cls = _resolve(name)
    own = [f.name for f in dataclasses.fields(cls) if f.init]
    if cls.can_defer_edits:
        own.append(CADENCE_FIELD)
    return own if name in _OWN_ALLOCATION or "allocator" in own else own + _allocator_fields()


def _resolve(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    return POLICIES[name]


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy by name; unknown names or fields raise ``ValueError`` naming them."""
    cls = _resolve(name)
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    if "allocator" in kwargs and "allocator" not in own and name in _OWN_ALLOCATION:
        raise ValueError(f"allocator cannot be combined with policy {name!r}: {_OWN_ALLOCATION[name]}")
    known = set(policy_fields(name))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)} for policy {name!r}; known: {', '.join(sorted(known))}"
        )
    every = kwargs.pop(CADENCE_FIELD, None)
    alloc = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
    base = cls(**kwargs)
    spec = getattr(base, "inner_spec", lambda: None)()
    if spec is not None:  # a policy composed around another one named by a setting (attnpack's evict=)
        base.inner = make_policy(spec[0], **spec[1])
    policy = _allocated(base, alloc)
    return policy if every is None else Cadence(inner=policy, every=every)


def _allocated(policy: Policy, alloc: dict) -> Policy:
    if not alloc:
        return policy
    if "allocator" not in alloc:
        raise ValueError(
            f"setting(s) {', '.join(sorted(alloc))} need allocator=NAME ({', '.join(ALLOCATORS)})"
        )
    allocator = make_allocator(
        alloc.pop("allocator"), **{k[len(ALLOCATOR_PREFIX) :]: v for k, v in alloc.items()}
    )
    return AllocatedPolicy(scorer=policy, allocator=allocator)
