"""A decoder layer for the Triton device path (CUDA, or ``VLKV_FORCE_TRITON=1``): fewer launches a layer.

A GPU decode step is host-bound: at 8k × 4 on LLaVA-1.5-7B's shape the device works ~14 ms of a 42-48 ms
step, the rest is the host dispatching ~12.5k ops (docs/benchmarks/2026-11-26-h200-run4/). On a GPU the
skinny layer (``skinny_layer.py``) runs the HF layer's ops one by one: two RMSNorms of 6 ops each, seven
projections of 4 (``F.linear`` on a 3-D input: ``t``, ``view``, ``mm``, ``_unsafe_view``), RoPE's 16, the
views and transposes between them. Here a decode step's few rows go through the layer as

    norm (1 launch) → q/k/v as one GEMM → RoPE of q and k in place (1 launch) → views → cache append and
    attention (the runtime's, unchanged) → o GEMM → residual add + norm (1 launch) → gate/up as one GEMM
    → SiLU × up (1 launch) → down GEMM → residual add

with the GEMMs on 2-D rows and weights transposed once: 19 ops around the attention instead of ~70.

The q/k/v weights (and biases) are concatenated once at engine start into one ``(N_q + 2·N_kv, K)`` matrix,
gate/up into one ``(2·I, K)``, and the projections' parameters are pointed at their rows of it (the same
values and ``Parameter`` objects: the HF layers, prefill and every other path read the same weights,
memory is not doubled). The products are the same sums: a fused GEMM may pick another kernel (a
different summation order) than three separate ones, so results match the HF layer to rounding, tested
with explicit tolerances (``tests/runtime/models/test_device_layer.py``) and for equal greedy tokens. The
glue kernels and their references are ``vlkv/plugins/triton_glue.py`` / ``glue_reference.py``.

Taken for the layer classes ``skinny_layer.SKINNY_LAYERS`` whose projections are plain ``nn.Linear`` of
one dtype, RMSNorms with ``variance_epsilon`` and a SiLU MLP, at most ``MAX_ROWS`` rows (a decode step;
prefill keeps the skinny / HF layer). ``VLKV_DEVICE_LAYER=0``: the skinny layer on the device too, and
the cache's own append (the reference path; ``fused_append.DEVICE_APPEND`` reads the same variable).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# VLKV_DEVICE_LAYER=0: every device step through the skinny / HF layer (the reference)
DEVICE_LAYER = os.environ.get("VLKV_DEVICE_LAYER", "1") != "0"
# the most rows (batch × new tokens) a step sends here: decode steps; prefill is compute-bound
MAX_ROWS = 64
# the MLP activations silu_mul computes (transformers' ACT2FN["silu"] and torch's)
SILU = frozenset({"SiLU", "SiLUActivation"})
# the attribute a prepared decoder layer carries its FusedLayer under
ATTR = "_vlkv_fused"


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights as the device layer reads them (built by :func:`fuse`).

    Attributes:
        qkv: ``(K, N_q + 2·N_kv)`` the q/k/v weights' transpose (a view of the one matrix they live in);
            ``qkv_bias`` its ``(N_q + 2·N_kv,)`` bias or None.
        o, gate_up, down: ``(H·D, K)``, ``(K, 2·I)``, ``(I, K)`` transposed weights; ``*_bias`` or None.
        norm1, norm2: the RMSNorm weights ``(K,)``; ``eps1``, ``eps2`` their epsilons.
        heads, kv_heads, head_dim: the attention's layout.
        modules: the projection modules this was built from (a layer whose modules were replaced
            since, e.g. wrapped by LoRA, is not taken).
        ptrs: their weights' data pointers at build time (weights moved since: not taken).
    """

    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    norm1: Tensor
    eps1: float
    norm2: Tensor
    eps2: float
    heads: int
    kv_heads: int
    head_dim: int
    modules: tuple
    ptrs: tuple

    def __post_init__(self) -> None:
        if self.heads % max(self.kv_heads, 1) or self.kv_heads < 1:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.qkv.shape[1] != (self.heads + 2 * self.kv_heads) * self.head_dim:
            raise ValueError(f"qkv: {self.qkv.shape[1]} columns for {self.heads}+2x{self.kv_heads} heads")

    def current(self, layer: nn.Module) -> bool:
        """The layer still holds the modules and weight storage this was built from."""
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        mods = _projections(attn, mlp)
        return all(a is b for a, b in zip(mods, self.modules)) and all(
            m.weight.data_ptr() == p for m, p in zip(mods, self.ptrs)
        )


def device_path(device: torch.device) -> bool:
    """Whether a model on ``device`` runs the Triton path (``ops.use_triton``'s rule: CUDA with triton
    installed, or ``VLKV_FORCE_TRITON=1``): the device layer's precondition."""
    from vlkv.plugins.ops import FORCE_TRITON_ENV, triton_available

    if os.environ.get(FORCE_TRITON_ENV) == "1":
        return True
    return torch.device(device).type == "cuda" and triton_available()


def _projections(attn: nn.Module, mlp: nn.Module) -> tuple:
    a, m = attn._modules, mlp._modules
    return (a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], m["gate_proj"], m["up_proj"], m["down_proj"])


def _fusable(layer: nn.Module) -> bool:
    from vlkv.runtime.models.skinny_layer import supports

    if not supports(layer):
        return False
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    if attn is None or mlp is None or not {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(attn._modules):
        return False
    if not {"gate_proj", "up_proj", "down_proj"} <= set(mlp._modules):
        return False
    mods = _projections(attn, mlp)
    if any(type(m) is not nn.Linear for m in mods):
        return False
    norms = (layer._modules.get("input_layernorm"), layer._modules.get("post_attention_layernorm"))
    if any(
        n is None or not hasattr(n, "variance_epsilon") or "RMSNorm" not in type(n).__name__ for n in norms
    ):
        return False
    if type(getattr(mlp, "act_fn", None)).__name__ not in SILU:
        return False
    dtypes = {p.dtype for m in (*mods, *norms) for p in m.parameters()}
    devices = {p.device for m in (*mods, *norms) for p in m.parameters()}
    return len(dtypes) == 1 and len(devices) == 1


def _concat(mods: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The modules' weights in one ``(ΣN, K)`` matrix (and biases in one vector, where every module has
    one), each module's parameters pointed at its rows: the same values, one storage."""
    weight = torch.cat([m.weight.data for m in mods])
    has_bias = [m.bias is not None for m in mods]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused projections must all have a bias or none")
    bias = torch.cat([m.bias.data for m in mods]) if all(has_bias) else None
    at = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = weight[at : at + n]
        if bias is not None:
            m.bias.data = bias[at : at + n]
        at += n
    return weight, bias


def fuse(layer: nn.Module) -> FusedLayer | None:
    """The layer's :class:`FusedLayer`, built once (kept on the layer; several engines over one model
    share it); None where the layer does not qualify (see the module docstring)."""
    got = layer.__dict__.get(ATTR)
    if got is not None and got.current(layer):
        return got
    if not _fusable(layer):
        return None
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    q, k, v, o, gate, up, down = mods = _projections(attn, mlp)
    head_dim = attn.head_dim
    heads, kv_heads = q.weight.shape[0] // head_dim, k.weight.shape[0] // head_dim
    qkv, qkv_bias = _concat([q, k, v])
    gate_up, gate_up_bias = _concat([gate, up])
    n1, n2 = layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"]
    fused = FusedLayer(
        qkv=qkv.t(),
        qkv_bias=qkv_bias,
        o=o.weight.data.t(),
        o_bias=None if o.bias is None else o.bias.data,
        gate_up=gate_up.t(),
        gate_up_bias=gate_up_bias,
        down=down.weight.data.t(),
        down_bias=None if down.bias is None else down.bias.data,
        norm1=n1.weight.data,
        eps1=float(n1.variance_epsilon),
        norm2=n2.weight.data,
        eps2=float(n2.variance_epsilon),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        modules=mods,
        ptrs=tuple(m.weight.data_ptr() for m in mods),
    )
    layer.__dict__[ATTR] = fused
    return fused


def prepare(layers, device: torch.device) -> bool:
    """At engine start: fuse every qualifying decoder layer of a model on a device that runs the Triton
    path (unless ``VLKV_DEVICE_LAYER=0``). Returns whether any layer was prepared."""
    if not DEVICE_LAYER or not device_path(device):
        return False
    with torch.no_grad():
        return sum(fuse(layer) is not None for layer in layers) > 0


def prepared(layer: nn.Module, hidden: Tensor, cos: Tensor) -> FusedLayer | None:
    """The layer's :class:`FusedLayer` where this step can take the device layer: prepared and current,
    ``hidden (B, q, K)`` of at most ``MAX_ROWS`` rows in the weights' dtype and on their device, and
    ``cos (B, q, D)`` in that dtype; else None (the caller runs the skinny / HF layer)."""
    fused = layer.__dict__.get(ATTR)
    if fused is None or not DEVICE_LAYER:
        return None
    rows = hidden.shape[0] * hidden.shape[1]
    w = fused.norm1
    if rows > MAX_ROWS or hidden.dtype != w.dtype or hidden.device != w.device or cos.dtype != w.dtype:
        return None
    if cos.shape[-1] != fused.head_dim or cos.stride(-1) != 1 or not hidden.is_contiguous():
        return None
    return fused if fused.current(layer) else None


# (thread, device, dtype, rows, width, intermediate) → the layer's three scratch buffers (below)
_WORK: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
_MAX_WORK = 8


def _workspace(rows: int, width: int, inter: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The normed rows ``(R, K)`` (norm 1's, then norm 2's), the residual stream after attention
    ``(R, K)`` and the activation ``(R, I)``: each read by the next GEMM or add of the same layer, so every
    layer (and step) of one thread reuses them: 4 allocations a layer fewer. Per thread: two threads'
    steps never share one."""
    key = (threading.get_ident(), like.device, like.dtype, rows, width, inter)
    got = _WORK.get(key)
    if got is None:
        if len(_WORK) >= _MAX_WORK:
            _WORK.clear()
        new = [torch.empty(rows, n, dtype=like.dtype, device=like.device) for n in (width, width, inter)]
        got = _WORK[key] = tuple(new)
    return got


def _mm(x: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` of 2-D rows by a pre-transposed weight: the same ``mm`` / ``addmm`` it dispatches."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def forward(
    fused: FusedLayer,
    layer: nn.Module,
    hidden: Tensor,
    ctx,
    cos_sin: tuple[Tensor, Tensor],
    attend_fn=None,
) -> Tensor:
    """The decoder layer over ``hidden (B, q, K)`` (see the module docstring); ``ctx`` the step's cache
    and mask, ``cos_sin`` the ``(B, q, D)`` rotary tables. Returns ``(B, q, K)``.

    ``attend_fn(attn, q, k, v) -> (B, q, H, D)``: the cache append and attention in place of the step
    context's (the static decode step's, ``runtime/static_step.py``, which reads only fixed buffers)."""
    from vlkv.plugins import triton_glue
    from vlkv.runtime.models.skinny_layer import attend

    b, nq, width = hidden.shape
    heads, kv, d = fused.heads, fused.kv_heads, fused.head_dim
    x = hidden.view(b * nq, width)
    normed, residual, act = _workspace(b * nq, width, fused.down.shape[0], hidden)
    h = triton_glue.rms_norm(x, fused.norm1, fused.eps1, out=normed)
    qkv = _mm(h, fused.qkv, fused.qkv_bias)
    cos, sin = cos_sin
    triton_glue.rope_(qkv.view(b * nq, heads + 2 * kv, d), cos, sin, heads + kv)
    # (B, H + 2·H_kv, q, D): one query row needs no transpose
    rows = (
        qkv.view(b, heads + 2 * kv, 1, d) if nq == 1 else qkv.view(b, nq, heads + 2 * kv, d).transpose(1, 2)
    )
    q, k, v = rows.split([heads, kv, kv], dim=1)
    attn = layer._modules["self_attn"]
    out = attend(attn, ctx, q, k, v) if attend_fn is None else attend_fn(attn, q, k, v)  # (B, q, H, D)
    o = _mm(out.reshape(b * nq, heads * d), fused.o, fused.o_bias)
    total, h = triton_glue.add_rms_norm(o, x, fused.norm2, fused.eps2, total=residual, out=normed)
    act = triton_glue.silu_mul(_mm(h, fused.gate_up, fused.gate_up_bias), out=act)
    return (total + _mm(act, fused.down, fused.down_bias)).view(b, nq, width)
