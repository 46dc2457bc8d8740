"""Counting what a step asks of PyTorch: dispatched ops and host syncs.

A decode step at batch sizes that matter is launch-bound: every dispatched op is a kernel launch
(or a CPU call of the same overhead), and every host sync (``.item()``, ``.tolist()``,
``bool(tensor)``, a shape that depends on values) stalls the launch queue until the device
catches up. :func:`count_ops` counts both over a block of code, on any device (a CPU run counts
the syncs a GPU run would pay), so a test can bound them and a benchmark can report them.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result the host must wait for: a scalar read, or an output shape known only from values
SYNC_OPS = {
    "aten._local_scalar_dense.default": "item",
    "aten.nonzero.default": "nonzero",
    "aten.masked_select.default": "masked_select",
    "aten._unique2.default": "unique",
    "aten.unique_consecutive.default": "unique",
    "aten.repeat_interleave.Tensor": "repeat_interleave",
}


@dataclass
class OpCount:
    """What a counted block dispatched.

    Attributes:
        ops: aten ops dispatched (each one a kernel launch on a GPU).
        syncs: host syncs among them, plus every ``Tensor.tolist()`` / ``Tensor.numpy()`` /
            ``Tensor.cpu()`` call (a copy to the host waits for the device; on a CPU run it is a no-op
            that dispatches nothing, so it is counted where it is called).
        kinds: syncs by kind (``item``, ``tolist``, ``nonzero``, ``bool_index``...).
        modules: syncs by the innermost ``vlkv`` module that asked (``vlkv.runtime.cache``...), so a
            test can bound one component's share.
        sites: syncs by that module and its function (``vlkv.plugins.paged_probs:decode_route``): where
            to look when a count grows.
    """

    ops: int = 0
    syncs: int = 0
    kinds: Counter = field(default_factory=Counter)
    modules: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)

    def sync(self, kind: str) -> None:
        self.syncs += 1
        self.kinds[kind] += 1
        module, function = _asker()
        self.modules[module] += 1
        self.sites[f"{module}:{function}"] += 1

    def syncs_in(self, *modules: str) -> int:
        """Syncs asked by ``modules`` (full dotted names)."""
        return sum(self.modules[m] for m in modules)


# the scheduler's own modules (plan, run, commit): what they read back per decode step is reported
# apart, and must not grow with the layers
SCHEDULER_MODULES = (
    "vlkv.runtime.scheduler",
    "vlkv.runtime.step_plan",
    "vlkv.runtime.step_groups",
    "vlkv.runtime.step_reads",
    "vlkv.runtime.runner",
    "vlkv.runtime.link_stage",
)


def _asker() -> tuple[str, str]:
    """The innermost ``vlkv`` module on the stack outside this one and its function (``("?", "?")``
    when none is)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("vlkv.") and name != __name__:
            return name, frame.f_code.co_name
        frame = frame.f_back
    return "?", "?"


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count.ops += 1
        name = str(func)
        kind = SYNC_OPS.get(name)
        # a boolean index is a nonzero: its output length is known only from the values
        if kind is None and name == "aten.index.Tensor" and any(_is_mask(i) for i in args[1]):
            kind = "bool_index"
        if kind is not None:
            self.count.sync(kind)
        return func(*args, **(kwargs or {}))


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


@contextlib.contextmanager
def count_ops():
    """``with count_ops() as c: ...`` counts ops and host syncs of the block into ``c`` (:class:`OpCount`).

    ``Tensor.tolist`` and ``Tensor.numpy`` read values without dispatching an op, and ``Tensor.cpu``
    of a CPU tensor dispatches nothing (on a GPU it is a sync), so they are wrapped for the block's duration (not thread-safe: count one thread's work at a time).
    """
    count = OpCount()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def wrap(name, fn):
        def counted(self, *a, **k):
            count.sync(name)
            return fn(self, *a, **k)

        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        with _Counting(count):
            yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
