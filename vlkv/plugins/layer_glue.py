"""A decode layer's RMSNorm and RoPE as one C++ call each over its few fp32 rows (CPU).

Once the few-row GEMMs stream the weights (``skinny_gemm``), a decode step's remaining cost outside
attention is op count: the HF RMSNorm is 7 aten ops (``to``, ``pow``, ``mean``, ``add``, ``rsqrt``,
``mul``, ``mul``) and ``apply_rotary_pos_emb`` ~16 (``unsqueeze``, 4 slices, 2 ``neg``, 2 ``cat``,
4 ``mul``, 2 ``add``), each a few µs of dispatch for a few hundred floats: ~40 ops per layer, ~1,200
per smollm2-llava step. Here each is one call computing the same formulas:
``weight * (x * rsqrt(mean(x²) + eps))`` per row, and ``x * cos + rotate_half(x) * sin`` for q and k
together. The sums run in another order (and the compiler may fuse a multiply-add): fp32 rounding
only, tested against the HF modules with explicit tolerances and for equal greedy tokens.

Built like the other CPU kernels (``paged_cpu_kernel.load_extension``; None with one warning where it
cannot be built); switched with the few-row GEMM (``skinny_gemm.CPP_GEMM``, ``VLKV_CPU_GEMM=0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlkv.plugins import paged_cpu_kernel, skinny_gemm

__all__ = ["NORMS", "kernel", "norm_fits", "rms_norm", "rope", "rope_fits"]

# RMSNorm classes whose forward is exactly weight * (x * rsqrt(mean(x²) + variance_epsilon))
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm"})
# the most rows a call takes: decode rows and prefill chunks of up to 64 tokens (whose GEMMs, above
# skinny_gemm.MAX_ROWS rows, are torch's); longer chunks keep the HF modules
MAX_ROWS = 64

# the row loops (``rms_rows``, ``rope_one``), without entry points: ``decode_layer`` compiles them too
_KERNELS = r"""
#include <torch/extension.h>
#include <cmath>

// y[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for R rows of K floats (raw row-major buffers)
static void rms_rows(const float* xp, const float* wp, double eps, float* yp, int64_t R, int64_t K) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = xp + r * K;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += xr[k] * xr[k];
    const float inv = 1.f / std::sqrt(s / float(K) + float(eps));
    float* yr = yp + r * K;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) yr[k] = wp[k] * (xr[k] * inv);
  }
}

// x (BS, H, D) rows with cos, sin (BS, D): o = x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x[D/2:], x[:D/2]) (raw row-major buffers)
static void rope_one(const float* x, const float* c, const float* s, float* o, int64_t BS, int64_t H,
                     int64_t D) {
  const int64_t h2 = D / 2;
  for (int64_t i = 0; i < BS; ++i) {
    const float* ci = c + i * D;
    const float* si = s + i * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = x + (i * H + h) * D;
      float* orow = o + (i * H + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < h2; ++d) orow[d] = xr[d] * ci[d] + (-xr[d + h2]) * si[d];
#pragma omp simd
      for (int64_t d = h2; d < D; ++d) orow[d] = xr[d] * ci[d] + xr[d - h2] * si[d];
    }
  }
}
"""

_ENTRY = r"""
// x (..., K) fp32 contiguous, w (K,) fp32: y[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) per row r
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && x.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kFloat && x.is_contiguous() && w.is_contiguous(),
              "rms_norm: float32 contiguous x (..., K) and weight (K,)");
  const int64_t K = x.size(-1), R = K ? x.numel() / K : 0;
  auto y = torch::empty_like(x);
  rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), eps, y.data_ptr<float>(), R, K);
  return y;
}

// q (B, S, Hq, D), k (B, S, Hk, D) fp32 contiguous; cos, sin (B, S, D) fp32 contiguous. Returns
// x * cos + rotate_half(x) * sin for each.
std::vector<torch::Tensor> rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() &&
                  q.size(0) == cos.size(0) && q.size(1) == cos.size(1) && k.size(0) == q.size(0) &&
                  k.size(1) == q.size(1) && q.size(3) == cos.size(2) && k.size(3) == cos.size(2) &&
                  cos.size(2) % 2 == 0,
              "rope: q (B, S, Hq, D), k (B, S, Hk, D), cos and sin (B, S, D), D even");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && q.is_contiguous() && k.is_contiguous() &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope: float32 contiguous q, k, cos, sin");
  const int64_t BS = q.size(0) * q.size(1), D = q.size(3);
  auto qo = torch::empty_like(q);
  auto ko = torch::empty_like(k);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  rope_one(q.data_ptr<float>(), cp, sp, qo.data_ptr<float>(), BS, q.size(2), D);
  rope_one(k.data_ptr<float>(), cp, sp, ko.data_ptr<float>(), BS, k.size(2), D);
  return {qo, ko};
}
"""

# the whole extension: the row loops (shared with ``decode_layer``) and this module's entry points
_SOURCE = _KERNELS + _ENTRY

_BUILT: list = []  # [module or None] once a build was tried


def kernel():
    """The compiled extension, built on the first call (None, with one warning, when it cannot be
    built here: the HF modules run)."""
    if _BUILT:
        return _BUILT[0]
    name = paged_cpu_kernel.build_name(_SOURCE, "vlkv_layer_glue")
    return paged_cpu_kernel.load_extension(
        _BUILT, name, _SOURCE, ["rms_norm", "rope"], "CPU layer glue (RMSNorm, RoPE)", "using the HF modules"
    )


# the checks run before each of a step's ~90 calls: plain attribute reads (is_cpu, not .device.type)
def _cpu_fp32(*ts: Tensor) -> bool:
    return all(t.is_cpu and t.dtype is torch.float32 for t in ts)


def _no_grad(*ts: Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def _built() -> bool:
    return (_BUILT[0] if _BUILT else kernel()) is not None


def norm_fits(module, x: Tensor) -> bool:
    """``module(x)`` is one of ``NORMS`` over at most ``MAX_ROWS`` fp32 CPU rows, no gradient wanted,
    the switch on and the extension built."""
    if not (skinny_gemm.CPP_GEMM and type(module).__name__ in NORMS):
        return False
    w = module.weight  # an nn.Module attribute lookup: once
    return (
        x.numel() <= MAX_ROWS * x.shape[-1]
        and _cpu_fp32(x, w)
        and w.is_contiguous()
        and _no_grad(x, w)
        and _built()
    )


def rms_norm(module, x: Tensor) -> Tensor:
    """The RMSNorm ``module`` (one of ``NORMS``) over ``x (..., K)`` fp32: ``(..., K)`` (check
    :func:`norm_fits` first)."""
    k = x.shape[-1]
    out = kernel().rms_norm(
        x.reshape(-1, k).contiguous(), module.weight.contiguous(), module.variance_epsilon
    )
    return out.view(x.shape)


def rope_fits(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """:func:`rope` takes these: ``q (B, S, Hq, D)``, ``k (B, S, Hk, D)``, ``cos``/``sin (B, S, D)``, fp32
    CPU, at most ``MAX_ROWS`` positions, no gradient wanted, the switch on and the extension built."""
    return (
        skinny_gemm.CPP_GEMM
        and q.dim() == 4
        and k.dim() == 4
        and k.shape[:2] == q.shape[:2]
        and k.shape[3] == q.shape[3]
        and q.shape[3] % 2 == 0
        and cos.dim() == 3
        and cos.shape == sin.shape == (q.shape[0], q.shape[1], q.shape[3])
        and q.shape[0] * q.shape[1] <= MAX_ROWS
        and _cpu_fp32(q, k, cos, sin)
        and _no_grad(q, k)
        and _built()
    )


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_pos_emb`` before the heads are transposed: ``q (B, S, Hq, D)``, ``k (B, S, Hk, D)``
    with ``cos``/``sin (B, S, D)`` → rotated ``(B, S, Hq, D)``, ``(B, S, Hk, D)`` fp32 (check
    :func:`rope_fits` first)."""
    q, k, cos, sin = (t if t.is_contiguous() else t.contiguous() for t in (q, k, cos, sin))
    qo, ko = kernel().rope(q, k, cos, sin)
    return qo, ko
