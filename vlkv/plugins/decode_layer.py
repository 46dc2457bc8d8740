"""A decode layer's work outside attention as two C++ calls over its few fp32 rows (CPU).

With the few-row GEMMs streaming the weights (``skinny_gemm``), the norms and RoPE one call each
(``layer_glue``) and the cache append plus the paged read one call (``paged_append``), a decode step's
layer still dispatched ~27 aten ops outside attention — the q/k/v/o/gate/up/down GEMM calls, their
views, the head transposes, the attention output's reshape and copy, SiLU, the gate·up product, the
two residual adds — each a few µs of Python and dispatch for a few hundred floats (~8 µs at 1 thread:
~6-7 ms of a smollm2-llava step at batch 4, the same for every policy). Here they are two calls:

- :func:`pre`: input RMSNorm → q/k/v GEMMs (+ biases) → RoPE on q and k; returns q ``(B, Hq, S, D)``,
  k and v ``(B, Hk, S, D)`` as transposed views of row-major ``(B, S, H, D)`` buffers — the layouts the
  HF layer's transposes give and ``fused_append.fused_decode_row`` takes;
- :func:`post`: o GEMM + residual → post-attention RMSNorm → gate/up GEMMs → SiLU(gate)·up → down GEMM
  + residual; returns the next hidden ``(B, S, hidden)``.

Same code, same formulas: the GEMMs are ``skinny_gemm``'s kernels (every weight streamed once for all the
step's rows; with several threads the q/k/v products share one parallel region, the gate/up products another:
4 forks per layer instead of 7, each output still one thread's sum), the norms and RoPE ``layer_glue``'s loops
(their C++ text compiled into this extension: one build machinery, ``paged_cpu_kernel.load_extension``), SiLU
is ``at::silu_`` (torch's own kernel), the products and adds single fp32 operations. So a layer here equals
the skinny layer it replaces (``VLKV_CPU_LAYER=0``: the reference) to fp32 rounding — measured bit-equal on
this VM, tested at rtol = atol = 1e-5 — and decodes the same greedy tokens.

Taken for a decode step's rows (1 to ``MAX_ROWS``), fp32 CPU, no gradient wanted, a layer whose norms
are ``layer_glue.NORMS`` and whose activation is SiLU; the C++ side refuses (returns nothing: the
caller runs the reference path) weights that are not fp32 contiguous CPU tensors. Off with
``VLKV_CPU_LAYER=0`` or with the C++ GEMM (``VLKV_CPU_GEMM=0``); without a compiler: one warning.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vlkv.plugins import layer_glue, paged_cpu_kernel, skinny_gemm

__all__ = ["FUSED_LAYER", "MAX_ROWS", "fits", "kernel", "post", "pre", "set_gemm_form", "warm_up"]

# VLKV_CPU_LAYER=0: the skinny layer's separate calls (GEMMs, glue, views), the reference path
FUSED_LAYER = skinny_gemm.env_switch("VLKV_CPU_LAYER")
# the most rows (batch × new tokens) a call takes: the GEMM kernel's
MAX_ROWS = skinny_gemm.MAX_ROWS
# activation modules whose forward is F.silu
SILU = frozenset({"SiLU", "SiLUActivation"})

_ENTRY = r"""
#include <ATen/ATen.h>

// weights must be fp32 contiguous CPU tensors: anything else is refused (the caller's reference path)
static bool usable(const torch::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu() &&
         !(at::GradMode::is_enabled() && t.requires_grad());
}

static bool usable_bias(const c10::optional<torch::Tensor>& b, int64_t n) {
  return !b.has_value() || !b->defined() || (usable(*b) && b->dim() == 1 && b->size(0) == n);
}

static const float* bias_ptr(const c10::optional<torch::Tensor>& b) {
  return b.has_value() && b->defined() ? b->data_ptr<float>() : nullptr;
}

// a (B, H, S, D) view of a fresh row-major (B, S, H, D) buffer: the HF layer's transpose(1, 2)
static torch::Tensor heads_view(int64_t B, int64_t S, int64_t H, int64_t D, const torch::TensorOptions& o) {
  return at::empty_strided({B, H, S, D}, {S * H * D, D, H * D, 1}, o);
}

// hidden (B, S, E) fp32 contiguous, 1 <= B * S <= VLKV_MAX_ROWS; norm_w (E,); wq (Hq * D, E), wk and wv (Hk * D, E)
// with optional biases; cos, sin (B, S, D). Returns [q (B, Hq, S, D), k (B, Hk, S, D), v (B, Hk, S, D)]:
// rms_norm → q/k/v GEMMs → RoPE on q and k; [] where a weight is refused.
std::vector<torch::Tensor> layer_pre(torch::Tensor hidden, torch::Tensor norm_w, double eps, torch::Tensor wq,
                                     c10::optional<torch::Tensor> bq, torch::Tensor wk,
                                     c10::optional<torch::Tensor> bk, torch::Tensor wv,
                                     c10::optional<torch::Tensor> bv, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.is_cpu(),
              "layer_pre: float32 contiguous CPU hidden (B, S, E)");
  const int64_t B = hidden.size(0), S = hidden.size(1), E = hidden.size(2), R = B * S;
  TORCH_CHECK(R >= 1 && R <= VLKV_MAX_ROWS, "layer_pre: 1 <= B * S <= ", VLKV_MAX_ROWS, " rows, got ", R);
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == B && cos.size(1) == S &&
                  cos.size(2) % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_cpu() && sin.is_cpu(),
              "layer_pre: float32 CPU cos and sin (B, S, D), D even");
  const int64_t D = cos.size(2);
  if (!usable(norm_w) || !usable(wq) || !usable(wk) || !usable(wv)) return {};
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == E && wq.dim() == 2 && wk.dim() == 2 && wv.dim() == 2 &&
                  wq.size(1) == E && wk.size(1) == E && wv.size(1) == E && wq.size(0) % D == 0 &&
                  wk.size(0) % D == 0 && wv.size(0) == wk.size(0),
              "layer_pre: norm (E,), q (Hq * D, E), k and v (Hk * D, E) weights");
  const int64_t NQ = wq.size(0), NK = wk.size(0);
  if (!usable_bias(bq, NQ) || !usable_bias(bk, NK) || !usable_bias(bv, NK)) return {};
  auto c = cos.contiguous(), s = sin.contiguous();
  auto o = hidden.options();
  auto q = heads_view(B, S, NQ / D, D, o), k = heads_view(B, S, NK / D, D, o), v = heads_view(B, S, NK / D, D, o);
  thread_local std::vector<float> h, ql, kl;
  h.resize(R * E);
  ql.resize(R * NQ);
  kl.resize(R * NK);
  rms_rows(hidden.data_ptr<float>(), norm_w.data_ptr<float>(), eps, h.data(), R, E);
  // the three products as one parallel region; v straight into its output
  gemm_rows_multi<3>(h.data(),
                     {Product{wq.data_ptr<float>(), bias_ptr(bq), ql.data(), NQ},
                      Product{wk.data_ptr<float>(), bias_ptr(bk), kl.data(), NK},
                      Product{wv.data_ptr<float>(), bias_ptr(bv), v.data_ptr<float>(), NK}},
                     R, E);
  rope_one(ql.data(), c.data_ptr<float>(), s.data_ptr<float>(), q.data_ptr<float>(), R, NQ / D, D);
  rope_one(kl.data(), c.data_ptr<float>(), s.data_ptr<float>(), k.data_ptr<float>(), R, NK / D, D);
  return {q, k, v};
}

// attn (B, S, H, D) fp32 (any strides), residual (B, S, E) fp32 contiguous, 1 <= B * S <= VLKV_MAX_ROWS; wo (E, H * D);
// norm_w (E,); wg and wu (I, E); wd (E, I); optional biases. Returns [next hidden (B, S, E)]:
// h = residual + o(attn); h + down(silu(gate(n)) * up(n)) with n = rms_norm(h); [] where a weight is refused.
std::vector<torch::Tensor> layer_post(torch::Tensor attn, torch::Tensor residual, torch::Tensor wo,
                                      c10::optional<torch::Tensor> bo, torch::Tensor norm_w, double eps,
                                      torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                                      c10::optional<torch::Tensor> bu, torch::Tensor wd,
                                      c10::optional<torch::Tensor> bd) {
  TORCH_CHECK(residual.dim() == 3 && residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                  residual.is_cpu(),
              "layer_post: float32 contiguous CPU residual (B, S, E)");
  const int64_t B = residual.size(0), S = residual.size(1), E = residual.size(2), R = B * S;
  TORCH_CHECK(R >= 1 && R <= VLKV_MAX_ROWS, "layer_post: 1 <= B * S <= ", VLKV_MAX_ROWS, " rows, got ", R);
  TORCH_CHECK(attn.dim() == 4 && attn.size(0) == B && attn.size(1) == S && attn.scalar_type() == at::kFloat &&
                  attn.is_cpu(),
              "layer_post: float32 CPU attention output (B, S, H, D)");
  const int64_t A = attn.size(2) * attn.size(3);
  if (!usable(wo) || !usable(norm_w) || !usable(wg) || !usable(wu) || !usable(wd)) return {};
  TORCH_CHECK(wo.dim() == 2 && wo.size(0) == E && wo.size(1) == A && norm_w.dim() == 1 && norm_w.size(0) == E &&
                  wg.dim() == 2 && wg.size(1) == E && wu.sizes() == wg.sizes() && wd.dim() == 2 &&
                  wd.size(0) == E && wd.size(1) == wg.size(0),
              "layer_post: o (E, H * D), norm (E,), gate and up (I, E), down (E, I) weights");
  const int64_t I = wg.size(0);
  if (!usable_bias(bo, E) || !usable_bias(bg, I) || !usable_bias(bu, I) || !usable_bias(bd, E)) return {};
  auto a = attn.contiguous();
  auto out = at::empty_like(residual);
  auto gate = at::empty({R, I}, residual.options());
  thread_local std::vector<float> t, n, up;
  t.resize(R * E);
  n.resize(R * E);
  up.resize(R * I);
  const float* res = residual.data_ptr<float>();
  float* hp = out.data_ptr<float>();
  // the attention block: h = residual + o(attn)
  gemm_rows(a.data_ptr<float>(), wo.data_ptr<float>(), bias_ptr(bo), t.data(), R, A, E);
  for (int64_t i = 0; i < R * E; ++i) hp[i] = res[i] + t[i];
  // the MLP block: h + down(silu(gate(n)) * up(n)), n = rms_norm(h); SiLU by torch's own kernel
  rms_rows(hp, norm_w.data_ptr<float>(), eps, n.data(), R, E);
  float* gp = gate.data_ptr<float>();
  gemm_rows_multi<2>(
      n.data(), {Product{wg.data_ptr<float>(), bias_ptr(bg), gp, I}, Product{wu.data_ptr<float>(), bias_ptr(bu), up.data(), I}},
      R, E);
  at::silu_(gate);
  for (int64_t i = 0; i < R * I; ++i) gp[i] = gp[i] * up[i];
  gemm_rows(gp, wd.data_ptr<float>(), bias_ptr(bd), t.data(), R, I, E);
  for (int64_t i = 0; i < R * E; ++i) hp[i] = hp[i] + t[i];
  return {out};
}
"""

# one extension: the GEMM kernels and the norm / RoPE loops as their modules compile them, plus the two
# entry points
_SOURCE = skinny_gemm._KERNELS + layer_glue._KERNELS + _ENTRY

_BUILT: list = []  # [module or None] once a build was tried


def kernel():
    """The compiled extension, built on the first call (None, with one warning, when it cannot be
    built here: the skinny layer's separate calls run)."""
    if _BUILT:
        return _BUILT[0]
    name = paged_cpu_kernel.build_name(_SOURCE, "vlkv_decode_layer")
    mod = paged_cpu_kernel.load_extension(
        _BUILT,
        name,
        _SOURCE,
        ["layer_pre", "layer_post", "set_gemm_form"],
        "CPU decode layer",
        "using the skinny layer's calls",
    )
    if mod is not None:
        mod.set_gemm_form(skinny_gemm.default_form())  # this CPU kind's faster form (bit-equal either way)
    return mod


def set_gemm_form(form: int) -> None:
    """The few-row GEMMs' form in both extensions that compile them (the benchmarks' befores; see
    ``skinny_gemm``'s source: 0 session 14's form, 1 session 7's, 2 session 8's; bit-equal). Each extension
    starts with ``skinny_gemm.default_form()`` (per CPU kind)."""
    for mod in (skinny_gemm.kernel(), kernel()):
        if mod is not None:
            mod.set_gemm_form(form)


def warm_up() -> bool:
    """Build (or load) the extension now (engine start, not a stall of the first decode step); True
    when it will run."""
    return FUSED_LAYER and skinny_gemm.CPP_GEMM and kernel() is not None


def _parts(layer: nn.Module) -> tuple[nn.Module, nn.Module, dict, dict]:
    """``layer``'s attention and MLP modules and their submodule dicts, read from the modules' own
    dicts: ``nn.Module.__getattr__`` costs ~1-3 µs a name, ~25 names per layer and step (the dicts are
    the modules' live state: a replaced submodule or parameter is seen)."""
    mods = layer._modules
    attn, mlp = mods["self_attn"], mods["mlp"]
    return attn, mlp, attn._modules, mlp._modules


def _wb(linear: nn.Module) -> tuple[Tensor | None, Tensor | None]:
    """A projection's weight and bias as registered (None where it keeps no ``weight`` parameter, e.g.
    a parametrized one: refused)."""
    params = linear._parameters
    return params.get("weight"), params.get("bias")


def fits(layer: nn.Module, hidden: Tensor, cos: Tensor) -> bool:
    """:func:`pre` / :func:`post` take ``layer`` over ``hidden (B, S, E)``: the switches on, the extension
    built, 1 to ``MAX_ROWS`` fp32 CPU rows with a CPU ``cos (B, S, D)``, no gradient wanted through
    ``hidden``, the layer's norms ``layer_glue.NORMS`` and its activation SiLU (the weights' own
    checks are the C++ side's)."""
    if not (
        FUSED_LAYER
        and skinny_gemm.CPP_GEMM
        and hidden.dim() == 3
        and 1 <= hidden.shape[0] * hidden.shape[1] <= MAX_ROWS
        and hidden.is_cpu
        and cos.is_cpu
        and hidden.dtype is cos.dtype is torch.float32
        and cos.dim() == 3
        and not (hidden.requires_grad and torch.is_grad_enabled())
        and (_BUILT[0] if _BUILT else kernel()) is not None
    ):
        return False
    mods = layer._modules
    norms = layer_glue.NORMS
    return (
        type(mods["input_layernorm"]).__name__ in norms
        and type(mods["post_attention_layernorm"]).__name__ in norms
        and type(mods["mlp"]._modules["act_fn"]).__name__ in SILU
    )


def pre(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """The layer's input RMSNorm, q/k/v projections and RoPE over ``hidden (B, S, E)`` with ``cos``/``sin
    (B, S, D)``: ``q (B, Hq, S, D)``, ``k``/``v (B, Hk, S, D)`` (the HF layer's post-transpose layouts),
    or None where a weight is refused (check :func:`fits` first)."""
    _, _, am, _ = _parts(layer)
    norm = layer._modules["input_layernorm"]
    (wq, bq), (wk, bk), (wv, bv) = _wb(am["q_proj"]), _wb(am["k_proj"]), _wb(am["v_proj"])
    wn = norm._parameters.get("weight")
    if wq is None or wk is None or wv is None or wn is None:
        return None
    x = hidden if hidden.is_contiguous() else hidden.contiguous()
    got = kernel().layer_pre(x, wn, norm.variance_epsilon, wq, bq, wk, bk, wv, bv, cos, sin)
    return tuple(got) if got else None


def post(layer: nn.Module, out: Tensor, residual: Tensor) -> Tensor | None:
    """The layer after attention: ``out (B, S, Hq, D)`` (the attention output, any strides) through the o
    projection onto ``residual (B, S, E)``, then the MLP block: the next hidden ``(B, S, E)``, or None
    where a weight is refused (check :func:`fits` first)."""
    _, _, am, mm = _parts(layer)
    norm = layer._modules["post_attention_layernorm"]
    (wo, bo), (wg, bg), (wu, bu), (wd, bd) = (
        _wb(am["o_proj"]),
        _wb(mm["gate_proj"]),
        _wb(mm["up_proj"]),
        _wb(mm["down_proj"]),
    )
    wn = norm._parameters.get("weight")
    if wo is None or wg is None or wu is None or wd is None or wn is None:
        return None
    r = residual if residual.is_contiguous() else residual.contiguous()
    got = kernel().layer_post(out, r, wo, bo, wn, norm.variance_epsilon, wg, bg, wu, bu, wd, bd)
    return got[0] if got else None
