"""KV-cache policies: dataclasses that decide what to keep / merge from attention statistics."""

from vlkv.runtime.policies.base import CutEdit, FactorEdit, LayerEdit, Policy, PolicyContext
from vlkv.runtime.policies.registry import POLICIES, make_policy, policy_fields

__all__ = [
    "POLICIES",
    "CutEdit",
    "FactorEdit",
    "LayerEdit",
    "Policy",
    "PolicyContext",
    "make_policy",
    "policy_fields",
]
