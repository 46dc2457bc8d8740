"""A decoder layer whose few-row GEMMs use the form MKL runs fastest: ``(W @ xᵀ)ᵀ``.

A decode step multiplies a few rows (the batch) by every weight matrix. On CPU those GEMMs are the
step's cost outside attention (a profiled smollm2-llava step at batch 4, one thread: ~49 of ~61 ms of
aten time in ``mm``), and MKL's ``F.linear`` (``x @ Wᵀ``) streams the weights at ~8-11 GB/s for 2-4
rows where ``sum`` reads 19-32 GB/s. The same product computed as ``(W @ xᵀ)ᵀ`` — the weight as the
tall left operand, ``xᵀ`` a transposed view of a row-major ``x`` — runs ~1.55× faster there (the 30
layers' GEMMs: 39 → 25 ms). It sums in another order than ``F.linear``: fp32 results differ by
rounding (~1e-6 relative), so it is tested against the HF layer with explicit tolerances and for equal
greedy tokens. Measured: 1 row even (both are GEMVs), 8 rows even, more rows slower, hence
``SKINNY_MAX_ROWS``; a contiguous ``(K, rows)`` right operand takes MKL's slow path (2× slower than
``F.linear``), so ``x`` is made row-major first.

Where it builds (a C++ compiler), ``vlkv/plugins/skinny_gemm.py`` computes these products instead, for
1-8 fp32 rows: one pass over each weight at near the machine's read bandwidth (4 rows: 28-46 GB/s where
``(W @ xᵀ)ᵀ`` reads 17-21 GB/s and ``F.linear`` 9-23 GB/s on the quiet 2-core EPYC VM, 1 thread;
docs/benchmarks/2026-11-26-decode-bound-s5-cpu-x86_64/). ``VLKV_CPU_GEMM=0`` keeps torch's forms. With it, the RMSNorms and the rotary embedding of a decode
step's few rows are one C++ call each (``vlkv/plugins/layer_glue.py``: the same formulas, ~40 fewer
aten ops per layer). For a decode step's rows the whole layer outside attention is two C++ calls
(``vlkv/plugins/decode_layer.py``: norm + q/k/v + RoPE, then o + residual + norm + MLP + residual;
the same kernels and formulas; ``VLKV_CPU_LAYER=0`` keeps the separate calls, the reference).

Fusing q/k/v into one GEMM and gate/up into another (weights concatenated) was measured too and not
kept: 0.98-1.02× the HF layers' step, ~3 % of the GEMMs' time in the skinny form
(docs/benchmarks/2026-11-26-glue-cpu-x86_64/).

Everything else is the HF layer's own code in the HF layer's order: its RMSNorm modules, its modeling
file's ``apply_rotary_pos_emb`` (1-D RoPE for Llama; Qwen2-VL's cos/sin already carry the M-RoPE
sections), its activation, the cache's ``update`` and the registered attention function, the residual
adds, its own weights. A decode step on fp32 CPU pools appends and attends in one C++ call instead of
``update`` + the attention function (``vlkv/runtime/fused_append.py``, ``vlkv/plugins/paged_append.py``;
``VLKV_CPU_APPEND=0`` keeps the two). Only the layer classes in ``SKINNY_LAYERS`` (whose forward this replays) run
here; any other layer runs the HF forward. ``VLKV_SKINNY_GEMM=0`` runs the HF layers (default on);
``FamilyAdapter.skinny`` switches it per adapter.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vlkv.plugins.decode_layer as decode_layer
from vlkv.plugins import layer_glue, skinny_gemm
from vlkv.plugins.ops import use_triton
from vlkv.runtime.fused_append import device_decode_append, fused_decode_row

# decoder layer classes whose forward is norm → attention(q/k/v, RoPE, cache, o) → residual → norm →
# mlp(down(act(gate) * up)) → residual, with attention kwargs limited to the cache and the mask
# (Mistral passes a sliding window to its attention: it runs the HF layer)
SKINNY_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen2VLDecoderLayer"})
# the most rows (batch × new tokens) the skinny form takes: 2-4 measured faster, 8 even
SKINNY_MAX_ROWS = 4
# the smallest weight (elements) it takes: its few extra ops (layout copies) outweigh the gain on small
# matrices (tiny-llava's 64-wide layers: 0.95× the HF layers' step); smollm2's smallest is 110,592
SKINNY_MIN_WEIGHT = 1 << 16


def skinny_from_env() -> bool:
    """``VLKV_SKINNY_GEMM`` (default on); ``0`` runs the HF layers unchanged."""
    return skinny_gemm.env_switch("VLKV_SKINNY_GEMM")


def supports(layer: nn.Module) -> bool:
    return type(layer).__name__ in SKINNY_LAYERS


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x (..., K)``, ``weight (N, K)``; on CPU with a weight of at
    least ``SKINNY_MIN_WEIGHT`` elements: 1 to ``skinny_gemm.MAX_ROWS`` fp32 rows by the C++ GEMM that
    streams the weight once (``vlkv/plugins/skinny_gemm.py``; ``VLKV_CPU_GEMM=0`` or no compiler: torch's
    products), else 2 to ``SKINNY_MAX_ROWS`` rows as ``(weight @ xᵀ)ᵀ``. Either way a row-major ``(..., N)``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # measured on CPU (MKL) only; cuBLAS picks its own kernels for skinny products
    if x.device.type != "cpu" or weight.numel() < SKINNY_MIN_WEIGHT:
        return F.linear(x, weight, bias)
    if skinny_gemm.fits(x, weight, rows, bias):
        return skinny_gemm.linear(x, weight, bias)
    if not 2 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    # x row-major, so that xᵀ is a transposed view: MKL's fast case (an elementwise product of
    # transposed outputs would otherwise hand it a contiguous (K, rows) operand: its slow case)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().t()).t()
    # row-major again (a rows × N copy): the ops after each GEMM see the layout F.linear gives
    out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _rotary(attn: nn.Module):
    """The attention module's own ``apply_rotary_pos_emb`` (its modeling file's function)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb")
    return fn


def _proj(module: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, module.weight, module.bias)


def _norm(module: nn.Module, x: Tensor, glue: bool) -> Tensor:
    """The layer's RMSNorm: with ``glue``, one C++ call for a decode step's rows (``layer_glue``), else
    the module."""
    return layer_glue.rms_norm(module, x) if glue and layer_glue.norm_fits(module, x) else module(x)


def attend(attn: nn.Module, ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The attention module ``attn``'s cache append and attention: ``q (B, H, q, D)`` post-RoPE,
    ``k, v (B, H_kv, q, D)`` the new entries → ``(B, q, H, D)``."""
    # a decode step's append and paged read as one C++ call where the step allows it (fp32 CPU pool,
    # one new row per request, no pre-RoPE or low-rank entries; statistics come from the same read);
    # else the cache's update and the registered attention function
    # (the Triton path, CUDA or forced, never takes the CPU call: it runs what a device runs)
    triton = use_triton(q)
    out = (
        None
        if ctx is None or not hasattr(ctx, "one_row") or triton
        else fused_decode_row(ctx, attn.layer_idx, q, k, v, attn.scaling)
    )
    if out is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # here: not a decode step's cost

        if ctx is not None:
            # the Triton path's decode append (a launch for the pool write, no per-layer copy to the
            # device), else the cache's update
            pools = device_decode_append(ctx, attn.layer_idx, k, v) if triton else None
            k, v = ctx.update(k, v, attn.layer_idx, kwargs={}) if pools is None else pools
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
        if fn is None:
            raise ValueError(f"no attention function registered as {attn.config._attn_implementation!r}")
        out, _ = fn(attn, q, k, v, ctx, dropout=0.0, scaling=attn.scaling)
    return out


def layer_forward(layer: nn.Module, hidden: Tensor, ctx, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
    """The HF decoder layer's forward over ``hidden (B, q, hidden)`` with skinny GEMMs.

    ``ctx`` is the step's cache and mask (the runtime passes one object as both; None: no cache, the
    attention function's own causal mask), ``cos_sin`` the ``(B, q, head_dim)`` rotary tables the
    layer's ``position_embeddings`` would be."""
    # submodules from the modules' own dicts: nn.Module.__getattr__ costs ~1-3 µs a name, per layer
    # and step (decode_layer reads its weights the same way)
    attn = layer._modules["self_attn"]
    shape = hidden.shape[:-1]
    hd = attn.head_dim
    residual = hidden
    # the C++ norms / RoPE above the C++ GEMM's weight floor (a tiny test model's layers keep the HF
    # ops bit for bit); they take up to layer_glue.MAX_ROWS rows, the GEMM up to skinny_gemm.MAX_ROWS
    q_proj = attn._modules["q_proj"]
    q_weight = q_proj._parameters.get("weight")
    glue = (q_proj.weight if q_weight is None else q_weight).numel() >= SKINNY_MIN_WEIGHT
    cos, sin = cos_sin
    # a decode step's few rows: the norm, q/k/v GEMMs and RoPE as one C++ call, and everything after
    # attention as another (decode_layer; VLKV_CPU_LAYER=0 or a refused weight: the calls below)
    whole = glue and decode_layer.fits(layer, hidden, cos)
    qkv = decode_layer.pre(layer, hidden, cos, sin) if whole else None
    if qkv is not None:
        q, k, v = qkv
    else:
        h = _norm(layer.input_layernorm, hidden, glue)
        q = _proj(attn.q_proj, h).view(*shape, -1, hd)
        k = _proj(attn.k_proj, h).view(*shape, -1, hd)
        v = _proj(attn.v_proj, h).view(*shape, -1, hd).transpose(1, 2)
        if glue and layer_glue.rope_fits(q, k, cos, sin):  # one call for the ~16 ops of apply_rotary_pos_emb
            q, k = layer_glue.rope(q, k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = _rotary(attn)(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    out = attend(attn, ctx, q, k, v)
    nxt = decode_layer.post(layer, out, residual) if whole else None
    if nxt is not None:
        return nxt
    hidden = residual + _proj(attn.o_proj, out.reshape(*shape, -1).contiguous())
    residual = hidden
    h = _norm(layer.post_attention_layernorm, hidden, glue)
    mlp = layer.mlp
    return residual + _proj(mlp.down_proj, mlp.act_fn(_proj(mlp.gate_proj, h)) * _proj(mlp.up_proj, h))
