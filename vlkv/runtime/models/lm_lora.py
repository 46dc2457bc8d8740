"""Low-rank adapters on the language model's projections: trained beside the projector, merged at build.

LLaVA's second stage tunes the language model so it *uses* the image tokens: with the LM frozen,
``smollm2-llava`` reads what each image token says (colour, shape) but not where it sits, so "What is
on the left?" names the other object about half the time (``docs/benchmarks/2026-11-26-vqa6-cpu-x86_64/``).
A rank-``r`` adapter ``W + B A`` on chosen projections of every decoder layer is the smallest change to
the LM that can learn that lookup; it trains with the projector (``scripts/train_projector.py
--lm-lora-rank``), and the shipped file stores ``A`` and ``B`` (scale folded into ``B``), which
:func:`merge` adds into the weights when the model is built. After the merge the model is a plain
``LlavaForConditionalGeneration``: every backend and export sees ordinary weights.

Keys: ``lm_lora.<layer>.<projection>.A`` ``(r, in_features)`` and ``...B`` ``(out_features, r)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

PREFIX = "lm_lora."
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _blocks(model) -> list[nn.Module]:
    return list(model.model.language_model.layers)


def _owner(layer: nn.Module, projection: str) -> nn.Module:
    return layer.self_attn if projection in TARGETS[:4] else layer.mlp


def parse_targets(spec: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` → ``("q_proj", "v_proj")``; unknown names raise one line naming them."""
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [n for n in names if n not in TARGETS]
    if not names or bad:
        raise ValueError(f"lm_lora targets must be among {', '.join(TARGETS)}, got {spec!r}")
    return names


class LoRALinear(nn.Module):
    """``base(x) + scale * (x A^T) B^T`` with ``base`` frozen; ``B`` starts at zero (the base model)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.scale = alpha / rank
        bound = 1.0 / math.sqrt(base.in_features)
        a = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        w = base.weight
        self.A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        self.enabled = True  # False: exactly the base projection (see :func:`disabled`)

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return self.base(x)
        return self.base(x) + (x @ self.A.t().to(x.dtype)) @ (self.B.t() * self.scale).to(x.dtype)


def attach(model, rank: int, targets: tuple[str, ...], alpha: float, seed: int) -> list[nn.Parameter]:
    """Wrap ``targets`` of every decoder layer of ``model``'s LM in :class:`LoRALinear`; returns the
    adapters' parameters (``A`` then ``B`` per module, layer-major), the only ones that train."""
    generator = torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    for layer in _blocks(model):
        for name in targets:
            owner = _owner(layer, name)
            base = getattr(owner, name)
            if isinstance(base, LoRALinear):
                raise ValueError(f"lm_lora: {name} already has an adapter")
            wrapped = LoRALinear(base, rank, alpha, generator)
            setattr(owner, name, wrapped)
            params += [wrapped.A, wrapped.B]
    return params


def adapters(model) -> dict[str, LoRALinear]:
    """``"<layer>.<projection>"`` → the attached adapter."""
    out = {}
    for i, layer in enumerate(_blocks(model)):
        for name in TARGETS:
            module = getattr(_owner(layer, name), name)
            if isinstance(module, LoRALinear):
                out[f"{i}.{name}"] = module
    return out


@contextmanager
def disabled(model) -> Iterator[None]:
    """Run ``model`` as its base LM: every attached adapter is skipped inside the block (the base
    projections' own outputs, bit for bit), re-enabled on exit even after an error. No weights are
    copied, so the adapted model's "before" costs one forward pass, not a second model in memory."""
    before = [(m, m.enabled) for m in adapters(model).values()]
    for m, _ in before:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in before:  # as they were, so blocks nest
            m.enabled = was


def raw_state(model) -> dict[str, Tensor]:
    """The adapters' ``A`` / ``B`` as trained (scale not folded), for checkpoints."""
    return {f"{k}.{p}": getattr(m, p).detach().clone() for k, m in adapters(model).items() for p in "AB"}


def load_raw_state(model, state: dict[str, Tensor]) -> None:
    """Copy a :func:`raw_state` into the attached adapters (same targets and rank, or one line why)."""
    mods = adapters(model)
    want = {f"{k}.{p}" for k in mods for p in "AB"}
    if set(state) != want:
        raise ValueError(
            f"lm_lora checkpoint holds {len(state)} tensors for other modules than the {len(want)} attached"
        )
    with torch.no_grad():
        for key, value in state.items():
            layer, name, part = key.rsplit(".", 2)
            getattr(mods[f"{layer}.{name}"], part).copy_(value)


def fold(raw: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A :func:`raw_state` → the shipped form: ``lm_lora.<layer>.<projection>.{A,B}``, float32, the
    scale folded into ``B`` (what :func:`merge` adds)."""
    out = {}
    for key, value in raw.items():
        value = value.detach().float()
        out[PREFIX + key] = (value * scale if key.endswith(".B") else value).contiguous()
    return out


def split(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A file's tensors → (projector's, adapters')."""
    lora = {k: v for k, v in state.items() if k.startswith(PREFIX)}
    return {k: v for k, v in state.items() if k not in lora}, lora


def merge(model, lora: dict[str, Tensor]) -> int:
    """Add every adapter's ``B A`` into its base weight; returns how many weights changed.

    New weight tensors are assigned (in ``model``'s dtype, summed in float32), never written in place:
    the current ones may be memory-mapped from the build cache. Raises one line naming a key that
    does not fit the model (unknown layer / projection, shapes, an ``A`` without its ``B``); every
    pair is checked (:func:`plan`) before any weight changes, so a bad file leaves the model as it was.
    """
    return apply(plan(model, lora))


def plan(model, lora: dict[str, Tensor]) -> list[tuple[nn.Linear, Tensor, Tensor]]:
    """Every adapter of ``lora`` checked against ``model``: ``(linear, A, B)`` on the weight's device,
    float32; nothing in ``model`` changes. Raises as :func:`merge` does."""
    blocks = _blocks(model)
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in lora.items():
        body = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        parts = body.split(".")
        if len(parts) != 3 or parts[2] not in "AB" or not parts[0].isdigit() or parts[1] not in TARGETS:
            raise ValueError(f"lm_lora: {key!r} is not lm_lora.<layer>.<projection>.<A|B>")
        pairs.setdefault(f"{parts[0]}.{parts[1]}", {})[parts[2]] = value
    checked = []
    for name, pair in pairs.items():
        layer, proj = name.split(".")
        if set(pair) != {"A", "B"} or int(layer) >= len(blocks):
            raise ValueError(f"lm_lora: {name} needs A and B of an existing layer (the LM has {len(blocks)})")
        linear = getattr(_owner(blocks[int(layer)], proj), proj)
        w = linear.weight
        a, b = pair["A"].to(w.device, torch.float32), pair["B"].to(w.device, torch.float32)
        if a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"lm_lora: {name} A {tuple(a.shape)} / B {tuple(b.shape)} do not fit weight {tuple(w.shape)}"
            )
        checked.append((linear, a, b))
    return checked


def apply(checked: list[tuple[nn.Linear, Tensor, Tensor]]) -> int:
    """Add a :func:`plan`'s adapters into their weights (new tensors assigned); returns how many."""
    for linear, a, b in checked:
        w = linear.weight
        merged = (w.detach().float() + b @ a).to(w.dtype)
        linear.weight = nn.Parameter(merged, requires_grad=w.requires_grad)
    return len(checked)
