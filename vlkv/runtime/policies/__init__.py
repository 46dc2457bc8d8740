"""KV-cache policies: dataclasses that decide what to keep / merge from attention statistics; the
scoring ones (:class:`ScorePolicy`) implement one ``score()`` and share the selection."""

from vlkv.runtime.policies.base import CutEdit, FactorEdit, LayerEdit, Policy, PolicyContext
from vlkv.runtime.policies.registry import POLICIES, make_policy, policy_fields
from vlkv.runtime.policies.scorer import ScorePolicy

__all__ = [
    "POLICIES",
    "CutEdit",
    "FactorEdit",
    "LayerEdit",
    "Policy",
    "PolicyContext",
    "ScorePolicy",
    "make_policy",
    "policy_fields",
]
