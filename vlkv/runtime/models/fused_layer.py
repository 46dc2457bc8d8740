"""One decoder layer with its projections fused: one GEMM for q/k/v, one for gate/up.

At decode a step multiplies a few rows (the batch) by every weight matrix, and each ``linear`` call
costs a fixed overhead on top of reading its weights; a Llama/Qwen2 layer makes seven of them. Here
q/k/v are one ``(Nq + 2·Nkv, hidden)`` matrix and gate/up one ``(2·I, hidden)`` matrix, their outputs
split by views, so a layer makes four. The HF modules' own weights are rebound as row views of the
fused matrices (no second copy: a 7B model would otherwise hold its attention and MLP weights twice),
so the unfused HF layer (``model.generate``, replay) keeps working on the same storage.

Everything else is the HF layer's own code, in the HF layer's order: its RMSNorm modules, its module's
``apply_rotary_pos_emb`` (1-D RoPE for Llama; Qwen2-VL's cos/sin already carry the M-RoPE sections),
its activation, the cache's ``update`` and the registered attention function, the residual adds.
Only the layer classes listed in ``FUSABLE`` are fused (their forward is what :func:`fused_forward`
replays); any other layer runs the HF forward.

At decode the GEMMs are the step's cost outside attention (a profiled smollm2-llava step at batch 4:
~80 of ~100 ms of aten time in ``mm``), and MKL's ``x @ Wᵀ`` for 2-4 rows streams the weights at
~8 GB/s on one core where ``sum`` reads 23-26 GB/s. The same product computed as ``(W @ xᵀ)ᵀ`` (the
weight as the tall left operand, ``xᵀ`` a transposed view) runs ~1.7× faster there (measured: 1 row
even, 8+ rows even or slower), so the ``skinny`` mode uses that form for 2..``SKINNY_MAX_ROWS`` rows.
It sums in a different order than ``F.linear``: fp32 results differ by rounding (~1e-6 relative).

Modes (``LAYER_MODES``): ``hf`` runs the HF layers; ``fused`` fuses the GEMMs, each still ``F.linear``
(the HF layer's products, so equal to it up to how MKL blocks a wider matrix); ``skinny`` (default)
also uses the skinny form. ``VLKV_FUSED_LAYER`` picks the mode (``0`` = ``hf``, ``1`` = ``skinny``);
``FamilyAdapter.fused`` switches it per adapter.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# decoder layer classes whose forward is norm → attention(q/k/v, RoPE, cache, o) → residual → norm →
# mlp(down(act(gate) * up)) → residual, with attention kwargs limited to the cache and the mask
FUSABLE = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen2VLDecoderLayer"})


LAYER_MODES = ("hf", "fused", "skinny")
_ALIASES = {
    "0": "hf",
    "off": "hf",
    "false": "hf",
    "1": "skinny",
    "on": "skinny",
    "true": "skinny",
    "": "skinny",
}
# the most rows (batch × new tokens) the skinny form takes: 2-4 measured faster, 8 even (see docstring)
SKINNY_MAX_ROWS = 4


def mode_from_env() -> str:
    """``VLKV_FUSED_LAYER``: one of ``LAYER_MODES`` (or ``0`` = ``hf``, ``1`` = ``skinny``, the default)."""
    raw = os.environ.get("VLKV_FUSED_LAYER", "").strip().lower()
    mode = _ALIASES.get(raw, raw)
    if mode not in LAYER_MODES:
        raise ValueError(f"VLKV_FUSED_LAYER must be one of {', '.join(LAYER_MODES)}, 0 or 1; got {raw!r}")
    return mode


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, skinny: bool) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x (..., K)``, ``weight (N, K)``; with ``skinny`` and 2 to
    ``SKINNY_MAX_ROWS`` rows, computed as ``(weight @ xᵀ)ᵀ``; either way a row-major ``(..., N)``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not skinny or not 2 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    # x row-major, so that xᵀ is a transposed view: MKL's fast case. A contiguous (K, rows) operand
    # takes its slow one (2× slower than F.linear, measured), and an elementwise product of
    # transposed outputs (act(gate) · up) would be exactly that.
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().t()).t()
    # row-major again (a rows × N copy): the ops after the layer's GEMMs see the layouts F.linear gives
    out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


@dataclass
class FusedWeights:
    """A layer's fused projections.

    qkv: ``(Nq + 2·Nkv, hidden)``; qkv_bias: ``(Nq + 2·Nkv,)`` or None (Qwen2 has q/k/v biases, Llama
    none); gate_up: ``(2·I, hidden)``; gate_up_bias: ``(2·I,)`` or None; splits: ``(Nq, Nkv, Nkv)``."""

    qkv: Tensor
    qkv_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    splits: tuple[int, int, int]
    inter: int

    def __post_init__(self):
        if self.qkv.shape[0] != sum(self.splits):
            raise ValueError(f"qkv has {self.qkv.shape[0]} rows, splits sum to {sum(self.splits)}")
        if self.gate_up.shape[0] != 2 * self.inter:
            raise ValueError(
                f"gate_up has {self.gate_up.shape[0]} rows, expected 2 × inter = {2 * self.inter}"
            )

    def current(self, layer: nn.Module) -> bool:
        """The HF modules still hold views of these tensors (a ``.to()``/new Parameter replaces them)."""
        attn, mlp = layer.self_attn, layer.mlp
        return (
            attn.q_proj.weight.data_ptr() == self.qkv.data_ptr()
            and mlp.gate_proj.weight.data_ptr() == self.gate_up.data_ptr()
            and attn.q_proj.weight.dtype == self.qkv.dtype
        )


def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """Concatenate ``linears``' weights (and biases) row-wise and rebind each module's to a view."""
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("fused projections must all have a bias or none")
        bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        row = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = weight[row : row + n]
            if bias is not None:
                lin.bias.data = bias[row : row + n]
            row += n
    return weight, bias


def fusable(layer: nn.Module) -> bool:
    return type(layer).__name__ in FUSABLE


def fused_weights(layer: nn.Module) -> FusedWeights:
    """The layer's fused projections, built (and its modules rebound to views) on first use."""
    got = getattr(layer, "_vlkv_fused", None)
    if got is not None and got.current(layer):
        return got
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    splits = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
    got = FusedWeights(qkv, qkv_bias, gate_up, gate_up_bias, splits, mlp.gate_proj.weight.shape[0])
    layer._vlkv_fused = got  # plain attribute: not a Parameter/buffer, so state_dict is unchanged
    return got


def _rotary(attn: nn.Module):
    """The attention module's own ``apply_rotary_pos_emb`` (its modeling file's function)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb")
    return fn


def fused_forward(
    layer: nn.Module, hidden: Tensor, ctx, cos_sin: tuple[Tensor, Tensor], skinny: bool = False
) -> Tensor:
    """The HF decoder layer's forward over ``hidden (B, q, hidden)`` with fused projections.

    ``ctx`` is the step's cache and mask (the runtime passes one object as both), ``cos_sin`` the
    ``(B, q, head_dim)`` rotary tables the layer's ``position_embeddings`` would be; ``skinny``: the
    GEMMs of few rows in the skinny form (:func:`linear`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fw = fused_weights(layer)
    attn, mlp = layer.self_attn, layer.mlp
    shape = hidden.shape[:-1]
    residual = hidden
    h = layer.input_layernorm(hidden)
    q, k, v = linear(h, fw.qkv, fw.qkv_bias, skinny).split(fw.splits, dim=-1)
    hd = attn.head_dim
    q = q.view(*shape, -1, hd).transpose(1, 2)
    k = k.view(*shape, -1, hd).transpose(1, 2)
    v = v.view(*shape, -1, hd).transpose(1, 2)
    cos, sin = cos_sin
    q, k = _rotary(attn)(q, k, cos, sin)
    if ctx is not None:
        k, v = ctx.update(k, v, attn.layer_idx, kwargs={})
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
    if attend is None:
        raise ValueError(f"no attention function registered as {attn.config._attn_implementation!r}")
    out, _ = attend(attn, q, k, v, ctx, dropout=0.0, scaling=attn.scaling)
    o = attn.o_proj
    out = linear(out.reshape(*shape, -1).contiguous(), o.weight, o.bias, skinny)
    hidden = residual + out
    residual = hidden
    h = layer.post_attention_layernorm(hidden)
    gate, up = linear(h, fw.gate_up, fw.gate_up_bias, skinny).split(fw.inter, dim=-1)
    down = mlp.down_proj
    return residual + linear(mlp.act_fn(gate) * up, down.weight, down.bias, skinny)
