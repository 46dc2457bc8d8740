"""A few-row CPU GEMM that streams each weight once: ``y = x @ Wᵀ`` for a decode step's 1-8 rows (C++).

A decode step multiplies the batch's few rows by every weight matrix, so its GEMMs read each weight once and
do 2·rows flops per 4 bytes: they are bound by memory bandwidth, not arithmetic. MKL's ``F.linear`` and even
the ``(W @ xᵀ)ᵀ`` form of ``skinny_layer`` stream smollm2-llava's weights at ~9-15 GB/s at 4 rows where a
plain read of the same bytes runs at ~30-38 GB/s (2-core EPYC VM, 1 thread). This kernel reads ``W (N, K)``
row after row, contiguously — one weight row at a time for 1-4 rows, two side by side for 5-8 — and asks
for the lines 8 KiB ahead itself, into L2 (session 14, the VM on a Zen 4 host, 4 rows, from memory: 24-29
GB/s where session 8's form — two weight rows per block, lines into L1 — read 9-14; a decode step at 8k x 4
1.13-1.67x, paired: docs/benchmarks/2026-11-27-decode-bound-s14-cpu-x86_64/), and dots each with
all ``x`` rows at once (``x`` stays in L1/L2; the accumulators stay in registers), one weight byte loaded
once; every output is one vector accumulator over ``K`` in order, whatever the form (a row's result does
not depend on the rows beside it, nor on the thread count). Vectorised over ``K`` with the compiler's
vector extension (AVX-512 or AVX2 through ``-march=native``), threads over blocks of output rows with
``at::parallel_for`` (``torch.get_num_threads()``). fp32 only; it sums each dot product in another order
than ``F.linear`` (fp32 rounding, ~1e-6 relative), so it is tested against ``F.linear`` with explicit
tolerances and for equal greedy tokens. Built with the fused paged read's machinery
(``paged_cpu_kernel.load_extension``: cached per CPU kind; None with one warning without a compiler).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from vlkv.plugins import paged_cpu_kernel

__all__ = ["MAX_ROWS", "CPP_GEMM", "fits", "kernel", "linear", "warm_up"]

# the most rows (batch × new tokens) it takes: its accumulators are rows × NB registers
MAX_ROWS = 8
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")


def env_switch(name: str) -> bool:
    """An on/off environment switch (unset: on); any other value is one line naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw not in _OFF + _ON:
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw in _ON


# VLKV_CPU_GEMM=0: the skinny layers' GEMMs go back to torch's ``(W @ xᵀ)ᵀ`` / ``F.linear``
CPP_GEMM = env_switch("VLKV_CPU_GEMM")

# The few-row GEMMs' form (``set_gemm_form``, bit-equal) per CPU kind, each measured paired in decode steps
# at 8k x 4: on AMD family 25 (Zen 4, 32 KiB L1d) form 0, lines fetched into L2 one weight row at a time,
# read ~2x session 8's (session 14); on family 26 (Zen 5, 48 KiB L1d) session 8's form 2 made whole steps
# 1.06-1.17x faster in 29 of 30 pairs (docs/benchmarks/2026-11-28-decode-bound-quiet-cpu-x86_64/). Other
# CPUs (unmeasured) take form 0. VLKV_GEMM_FORM=0|1|2 overrides.
FORM_ENV = "VLKV_GEMM_FORM"
FORMS_BY_CPU = {("AuthenticAMD", 26): 2}


def default_form(cpuinfo: str | None = None) -> int:
    """The form a new extension starts with: ``VLKV_GEMM_FORM`` if set, else :data:`FORMS_BY_CPU`'s
    entry for this CPU's vendor and family (``cpuinfo``: ``/proc/cpuinfo``'s text; read when None), else 0."""
    raw = os.environ.get(FORM_ENV, "").strip()
    if raw:
        if raw not in ("0", "1", "2"):
            raise ValueError(f"{FORM_ENV} must be 0, 1 or 2, got {raw!r}")
        return int(raw)
    got = paged_cpu_kernel.cpuinfo_fields(("vendor_id", "cpu family"), cpuinfo)
    family = got.get("cpu family", "")
    return FORMS_BY_CPU.get((got.get("vendor_id"), int(family) if family.isdigit() else None), 0)


# the few-row kernels (``gemm_rows``), without an entry point: ``decode_layer`` compiles them too;
# VLKV_MAX_ROWS is MAX_ROWS (every entry point's row check reads it: one source of truth)
_KERNELS = (
    f"#define VLKV_MAX_ROWS {MAX_ROWS}\n"
    + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <array>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// 16 floats; vu: the same with 4-byte alignment, so that a load through it is an unaligned load
typedef float v16 __attribute__((vector_size(64)));
typedef float vu __attribute__((vector_size(64), aligned(4)));

// a loaded vector kept in a register (one AVX-512 register holds a v16; elsewhere the compiler decides)
#ifdef __AVX512F__
#define PIN(v) asm("" : "+v"(v))
#else
#define PIN(v) (void)0
#endif

static inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// how far ahead of the weight rows being read the kernel asks for lines (floats: 8 KiB). The
// hardware prefetcher alone keeps too few lines in flight behind this much arithmetic (4 rows: ~17-22
// GB/s against the 38-42 GB/s a plain sum reads on the 2-core EPYC VM), so the line AHEAD floats past
// the block being read is asked for, NB lines per K step (the rate the block is consumed at). Measured
// there (session 8, Zen 5 host, 1 thread, huge-page weights, 4 rows, 2 weight rows per block): 8 KiB
// ahead 36-41 GB/s on smollm2-llava's 576-wide shapes, 2 KiB ~30, 32 KiB ~32.
constexpr int64_t AHEAD = 2048;

// where the asked-for lines go: L2 (prefetcht2), not L1 (prefetcht0). Session 14 (the VM on a Zen 4
// host, family 25: 32 KiB L1d where session 8's Zen 5 had 48): lines asked for into L1 held the
// session-8 form to 13-14 GB/s at 4 rows from memory (the output head, a plain sum 30-33), the same
// distance into L2 with one weight row at a time 26-30 GB/s (ring of huge-page copies, 1 thread). Session
// 8 measured L2 1-3 GB/s slower than L1 on the Zen 5 host (alone, 2 weight rows per block).
constexpr int PF_L1 = 3, PF_L2 = 1;

// the forms (set_gemm_form), bit-equal: 0 the current one (session 14); 1 session 7's (1-2 rows: one
// stream, no software prefetch; 3-4 rows: 4 weight rows per block, the next block prefetched; nothing asked
// for at a range's start); 2 session 8's (the current distances, lines into L1, 2 weight rows per block at
// 3-8 rows). Kept for benchmarks' before/after in one process.
static int g_form = 0;

// the first `n` floats at p asked for at once: a range's start, which no earlier block asked for
template <int LOC>
static void lead_lines(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, LOC);
}

// y[r, n] = x[r, :] . w[n, :] (+ b[n]) for n in [n0, n1): NB weight rows at a time, each weight
// element loaded once and multiplied into all R rows; the R * NB accumulators live in registers (the
// empty asm pins each loaded vector in one: GCC would otherwise fold R loads of it into the FMAs; the
// unroll pragmas keep GCC from leaving the accumulator array in memory, as it did for some clones:
// 0.8x). ahead: the prefetch distance in floats (0: none), LOC the prefetch's locality (PF_L1 / PF_L2).
// Every output is one vector accumulator over K in order, whatever NB, ahead and LOC: the forms are
// bit-equal.
template <int R, int NB, int LOC = PF_L1>
static void rows_block(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                       float* __restrict y, int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t ahead) {
  const int64_t K16 = K & ~int64_t(15);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    v16 acc[NB][R];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[j][r] = v16{};
    const float* wr = w + n * K;
    // the lines `ahead` floats on, where they lie inside the weight (a pointer past it is not formed)
    const bool pf = ahead && (n + NB) * K + ahead <= N * K;
    const float* at = wr + (pf ? ahead : 0);
    for (int64_t k = 0; k < K16; k += 16) {
      if (pf)
#pragma GCC unroll 16
        for (int j = 0; j < NB; ++j) __builtin_prefetch(at + k * NB + 16 * j, 0, LOC);
      v16 xv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        xv[r] = *(const vu*)(x + r * K + k);
        PIN(xv[r]);
      }
      v16 wv[NB];
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) {
        wv[j] = *(const vu*)(wr + j * K + k);
        PIN(wv[j]);
      }
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[j][r] += wv[j] * xv[r];
    }
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        float s = hsum(acc[j][r]);
        for (int64_t k = K16; k < K; ++k) s += wr[j * K + k] * x[r * K + k];
        y[r * N + n + j] = b ? s + b[n + j] : s;
      }
  }
  if (NB > 1 && n < n1) rows_block<R, 1, LOC>(x, w, b, y, n, n1, K, N, 0);
}

// session 7's 1-2 rows (kept for the benchmarks' before): the weight read as one stream, row after row,
// each weight row dotted with the R x rows before the next, no software prefetch — rows_block<R, 1> with
// ahead = 0, bit-equal. (Session 7 measured software prefetch slower here: that was a prefetch of the
// next block, not of the lines AHEAD floats on.)
template <int R>
static void rows_stream(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                        float* __restrict y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    v16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = v16{};
    for (int64_t k = 0; k < K16; k += 16) {
      v16 wv = *(const vu*)(wr + k);
      PIN(wv);
      for (int r = 0; r < R; ++r) acc[r] += wv * *(const vu*)(x + r * K + k);
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      for (int64_t k = K16; k < K; ++k) s += wr[k] * x[r * K + k];
      y[r * N + n] = b ? s + b[n] : s;
    }
  }
}

// 3-4 rows whose x exceeds X_BLOCK bytes keep session 7's 4 weight rows per block (each x load shared by
// 4): fewer rows per block load x from L2 more often (a Qwen2-VL-2B-sized down projection, K = 8,960,
// at 4 rows: one row at a time 12-13 GB/s, 2 per block ~19, 4 per block 23-26 on the 2-core EPYC VM)
constexpr int64_t X_BLOCK = 32 << 10;

// 1-4 rows: one weight row at a time (one stream, each x vector loaded once per weight vector), 5-8
// rows: 2 weight rows per block (x's loads shared by both); the lines AHEAD floats on asked for into L2
// (PF_L2), and a range's first AHEAD floats at its start. 3-4 rows whose x exceeds X_BLOCK: session 7's 4
// rows per block. Session 14, smollm2-llava at 4 rows (Zen 4 host, 1 thread, huge-page weights, ring
// of copies, medians): the head 17-29 GB/s (session 8's form 9-14), down 24-28 (12-13), gate/up 24-31
// (14-20); decode steps: docs/benchmarks/2026-11-27-decode-bound-s14-cpu-x86_64/ (1.13-1.67x). On the
// Zen 5 host session 8 found one row at a time (lines into L1) faster alone but slower inside a step
// (pre + post with a 3 MB read between: 15.5 ms against 13.8-14.4 with 2 rows per block): the step decides.
// g_form == 1: session 7's; 2: session 8's (2 weight rows per block at 3-8 rows, lines into L1).
// Bit-equal whatever the form.
template <int R>
static void by_block(const float* x, const float* w, const float* b, float* y, int64_t n0, int64_t n1,
                     int64_t K, int64_t N) {
  if (g_form == 1) {
    if constexpr (R <= 2) rows_stream<R>(x, w, b, y, n0, n1, K, N);
    else if constexpr (R <= 4) rows_block<R, 4>(x, w, b, y, n0, n1, K, N, 4 * K);
    else rows_block<R, 2>(x, w, b, y, n0, n1, K, N, 4 * K);
    return;
  }
  if (R >= 3 && R <= 4 && R * K * 4 > X_BLOCK) return rows_block<R, 4>(x, w, b, y, n0, n1, K, N, 4 * K);
  if (g_form == 2) {
    lead_lines<PF_L1>(w + n0 * K, std::min(AHEAD, (n1 - n0) * K));
    if constexpr (R <= 2) rows_block<R, 1>(x, w, b, y, n0, n1, K, N, AHEAD);
    else rows_block<R, 2>(x, w, b, y, n0, n1, K, N, AHEAD);
    return;
  }
  lead_lines<PF_L2>(w + n0 * K, std::min(AHEAD, (n1 - n0) * K));
  if constexpr (R <= 4) rows_block<R, 1, PF_L2>(x, w, b, y, n0, n1, K, N, AHEAD);
  else rows_block<R, 2, PF_L2>(x, w, b, y, n0, n1, K, N, AHEAD);
}

static_assert(VLKV_MAX_ROWS == 8, "rows_range dispatches 1..8 rows: extend it with MAX_ROWS");

// y[:, n0:n1] of y (R, N) = x (R, K) @ w (N, K)^T (+ b), 1 <= R <= 8: the register blocking for R rows
static void rows_range(const float* xp, const float* wp, const float* bp, float* yp, int64_t n0, int64_t n1,
                       int64_t R, int64_t K, int64_t N) {
  switch (R) {
    case 1: return by_block<1>(xp, wp, bp, yp, n0, n1, K, N);
    case 2: return by_block<2>(xp, wp, bp, yp, n0, n1, K, N);
    case 3: return by_block<3>(xp, wp, bp, yp, n0, n1, K, N);
    case 4: return by_block<4>(xp, wp, bp, yp, n0, n1, K, N);
    case 5: return by_block<5>(xp, wp, bp, yp, n0, n1, K, N);
    case 6: return by_block<6>(xp, wp, bp, yp, n0, n1, K, N);
    case 7: return by_block<7>(xp, wp, bp, yp, n0, n1, K, N);
    default: return by_block<8>(xp, wp, bp, yp, n0, n1, K, N);
  }
}

// a thread's share is at least ~256 KB of weights (fewer: the fork costs more than it saves)
static int64_t rows_grain(int64_t K) {
  return std::max<int64_t>(16, ((int64_t(1) << 16) / std::max<int64_t>(K, 1) + 15) & ~int64_t(15));
}

// 0: the kernel's form; 1: session 7's, 2: session 8's (the benchmarks' befores, bit-equal). Per
// extension: each extension compiling these kernels holds its own flag.
void set_gemm_form(int64_t form) {
  TORCH_CHECK(form >= 0 && form <= 2,
              "set_gemm_form: 0 (current), 1 (session 7's blocks) or 2 (session 8's), got ", form);
  g_form = int(form);
}

// y (R, N) = x (R, K) @ w (N, K)^T (+ b) for 1 <= R <= 8 rows, raw fp32 row-major buffers: the output
// rows split over torch's threads (the entry point below and the fused decode layer call this). Each
// output is one thread's, summed in one order: the result does not depend on the thread count.
static void gemm_rows(const float* xp, const float* wp, const float* bp, float* yp, int64_t R, int64_t K,
                      int64_t N) {
  at::parallel_for(0, N, rows_grain(K), [&](int64_t lo, int64_t hi) { rows_range(xp, wp, bp, yp, lo, hi, R, K, N); });
}

// one of several products over the same x rows: y (R, N) = x @ w (N, K)^T (+ b)
struct Product {
  const float* w;
  const float* b;
  float* y;
  int64_t N;
};

// several products over the same x (R, K) rows as one parallel region: their output rows, end to end,
// split over torch's threads together (one fork and join instead of one per product, and a small
// weight's rows shared out with the others'); each output as gemm_rows computes it
template <size_t G>
static void gemm_rows_multi(const float* xp, const std::array<Product, G>& ps, int64_t R, int64_t K) {
  int64_t total = 0;
  for (const auto& p : ps) total += p.N;
  at::parallel_for(0, total, rows_grain(K), [&](int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (const auto& p : ps) {
      const int64_t a = std::max(lo, base), b = std::min(hi, base + p.N);
      if (a < b) rows_range(xp, p.w, p.b, p.y, a - base, b - base, R, K, p.N);
      base += p.N;
    }
  });
}
"""
)

_ENTRY = r"""
// x (..., K) fp32 contiguous with R <= VLKV_MAX_ROWS rows in all; w (N, K) fp32 contiguous; bias (N,) fp32 or None.
// Returns y (..., N) = x @ w^T (+ bias): the caller's shape, no reshapes around the call.
torch::Tensor gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1), "skinny gemm: x (..., K) and w (N, K)");
  const int64_t K = w.size(1), N = w.size(0), R = K ? x.numel() / K : 0;
  TORCH_CHECK(R >= 1 && R <= VLKV_MAX_ROWS, "skinny gemm: 1 <= R <= ", VLKV_MAX_ROWS, " rows of x (..., K), got ", R);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
                  w.is_contiguous() && !x.is_cuda() && !w.is_cuda(),
              "skinny gemm: float32 contiguous CPU x and w");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "skinny gemm: float32 contiguous bias (N,)");
    bp = bias->data_ptr<float>();
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  gemm_rows(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), R, K, N);
  return y;
}
"""

# the whole extension: the kernels (shared with ``decode_layer``) and this module's entry point
_SOURCE = _KERNELS + _ENTRY

_BUILT: list = []  # [module or None] once a build was tried


def kernel():
    """The compiled extension, built on the first call (None, with one warning, when it cannot be
    built here: the skinny layers keep torch's products)."""
    if _BUILT:  # every few-row product asks: no hashing, no /proc/cpuinfo read after the first
        return _BUILT[0]
    name = paged_cpu_kernel.build_name(_SOURCE, "vlkv_skinny_gemm")
    mod = paged_cpu_kernel.load_extension(
        _BUILT, name, _SOURCE, ["gemm", "set_gemm_form"], "skinny CPU GEMM", "using torch's matmuls"
    )
    if mod is not None:
        mod.set_gemm_form(default_form())  # this CPU kind's faster form (bit-equal either way)
    return mod


def warm_up(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Build (or load) the kernel now, where a CPU fp32 model will decode with it (engine start, not a
    stall of the first decode step). True when it will run this model's few-row GEMMs (the fused decode
    layer, which compiles these kernels into its own build, is warmed by ``paged_cpu.warm_up``)."""
    if not CPP_GEMM or torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    return kernel() is not None


def fits(x: Tensor, weight: Tensor, rows: int, bias: Tensor | None = None) -> bool:
    """The kernel computes ``F.linear(x, weight, bias)`` for these: on, built, CPU fp32, ``1 ≤ rows ≤
    MAX_ROWS``, a contiguous weight (and bias), and no gradient wanted (it has no backward)."""
    # asked before each of a step's ~210 products: cheap attributes first (is_cpu, not .device.type)
    f32 = torch.float32
    return (
        CPP_GEMM
        and 1 <= rows <= MAX_ROWS
        and x.is_cpu
        and x.dtype is f32
        and weight.dtype is f32
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is f32 and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and (_BUILT[0] if _BUILT else kernel()) is not None
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x (..., K)`` fp32 of at most ``MAX_ROWS`` rows, ``weight
    (N, K)`` fp32 contiguous, ``bias (N,)`` fp32 or None: a row-major ``(..., N)``. Callers check
    :func:`fits` first (a non-row-major ``x`` is copied: a few rows)."""
    return kernel().gemm(x if x.is_contiguous() else x.contiguous(), weight, bias)
