"""``full``: the uncompressed cache, the reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlkv.runtime.policies.base import Policy


@dataclass
class FullPolicy(Policy):
    """Keeps every entry; ``budget`` must stay 1.0."""

    name: ClassVar[str] = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1.0:
            raise ValueError(f"budget must be 1.0 for policy 'full', got {self.budget}")
