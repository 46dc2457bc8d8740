"""A fused CPU decode-attention kernel over contiguous runs of the pool (C++, built on first use).

``paged_cpu`` reads a long request's K/V in place with ``bmm``; with one decode row the score matmul is
a ``(n, D) @ (D, G)`` GEMM with ``G`` = 3 columns for smollm2-llava, and MKL runs it (and ``P @ V``) at
25–30 % of the machine's read bandwidth; under a loaded machine its OpenMP threads also collapse at 2
threads (scripts/bench_attn_forms.py, docs/benchmarks/2026-11-26-decode-bound-cpu-x86_64). This kernel
reads each K row once, dots it with the ``G`` query rows, softmaxes each row's scores in a reused buffer
and accumulates ``P @ V`` reading each V row once: 2.45x the ``bmm`` read at 8k × 4 on the 2-core EPYC,
1 thread. Parallel over (segment, KV head) with ``at::parallel_for`` (torch's intra-op threads).

It returns each segment's output normalised within the segment and its log-sum-exp, so the caller merges
several segments (and gathered columns) of one request exactly. fp32 only, ``D`` ≤ ``MAX_DIM``,
``G`` ≤ ``MAX_ROWS``; :func:`kernel` is None where it cannot be built (no C++ compiler): the caller keeps
the ``bmm`` read. Building takes 0.5–2 min once per machine (torch's extension cache keeps it).
"""

from __future__ import annotations

import hashlib
import sys
import threading
import warnings
from pathlib import Path

from torch import Tensor

from vlkv.plugins import build_lock
from vlkv.plugins.paged_append_cpp import APPEND_SOURCE

__all__ = ["MAX_DIM", "MAX_ROWS", "kernel", "segments_attention", "table_attention", "table_attention_probs"]

# head sizes 64 and 128 are compiled unrolled; any other up to MAX_DIM runs a generic loop
MAX_DIM = 256
MAX_ROWS = 16

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Scattered rows (a per-head table's slots) defeat the hardware prefetcher, which follows only
// sequential lines: each row PF rows ahead is asked for explicitly, every 64-byte line of it. Contiguous
// runs too: behind the dot products the hardware prefetcher alone keeps too few lines in flight (one
// 8k-entry head, K then V: 34 -> 43 GB/s with it, a plain sum 46-49, on the 2-core EPYC VM).
constexpr int64_t PF = 16;
static inline void prefetch_row(const float* row, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i, 0, 3);
}

// One (segment, KV head): q (G, D) scaled; K, V rows of D floats: rows [0, T) of contiguous K, V when
// idx is null, else the rows idx[0..T) of the head's pool (a per-head slot row read in place). Writes o
// (G, D) normalised and lse (G,). The scores (G, T) live in sc. DT, GT: the head size and query rows
// known at compile time (unrolled: the accumulators stay in registers), or 0 for any D <= 256, G <= 16.
// pr (optional, with idx): the normalised softmax row of query g written at pr[g * pc + col[t]] (the
// table column of entry t): a statistics step's probabilities from the same single read of K.
template <int DT, int GT>
static void segment(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                    float* __restrict o, float* __restrict lse, int64_t t_len, int64_t g_len,
                    float* __restrict sc, int64_t d_rt, const int64_t* __restrict idx,
                    float* __restrict pr, int64_t pc, const int64_t* __restrict col) {
  const int64_t D = DT ? DT : d_rt;
  if (GT) g_len = GT;
  for (int64_t t = 0; t < t_len; ++t) {  // each K row read once, dotted with every query row
    if (t + PF < t_len) prefetch_row(k + (idx ? idx[t + PF] : t + PF) * D, D);
    const float* __restrict kr = k + (idx ? idx[t] : t) * D;
    for (int64_t g = 0; g < g_len; ++g) {
      const float* __restrict qr = q + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qr[d] * kr[d];
      sc[g * t_len + t] = acc;
    }
  }
  float inv[16];
  for (int64_t g = 0; g < g_len; ++g) {
    float* __restrict s = sc + g * t_len;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < t_len; ++t) mx = s[t] > mx ? s[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < t_len; ++t) {
      s[t] = expf(s[t] - mx);
      sum += s[t];
    }
    inv[g] = 1.f / sum;
    lse[g] = mx + logf(sum);
    if (pr) {
      float* __restrict p = pr + g * pc;
      const float ig = inv[g];
      for (int64_t t = 0; t < t_len; ++t) p[col[t]] = s[t] * ig;
    }
  }
#ifdef __AVX512F__
  // P.V with the G x D/16 accumulators held in registers (the array below round-trips them through
  // L1 for every V row: 3-7% of the read at head size 64, G = 3, measured standalone); only where the
  // G x C accumulators, the C loaded V vectors and one broadcast fit the 32 zmm registers (else spills)
  if constexpr (DT > 0 && DT % 16 == 0 && GT > 0 && GT * (DT / 16) + DT / 16 + 1 <= 32) {
    constexpr int C = DT / 16;
    __m512 a[GT][C];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < t_len; ++t) {  // each V row read once
      if (t + PF < t_len) prefetch_row(v + (idx ? idx[t + PF] : t + PF) * D, D);
      const float* __restrict vr = v + (idx ? idx[t] : t) * D;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int g = 0; g < GT; ++g) {
        const __m512 p = _mm512_set1_ps(sc[g * t_len + t]);
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      const __m512 ig = _mm512_set1_ps(inv[g]);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + g * D + 16 * c, _mm512_mul_ps(a[g][c], ig));
    }
    return;
  }
#endif
  alignas(64) float acc[16 * 256];
  for (int64_t i = 0; i < g_len * D; ++i) acc[i] = 0.f;
  for (int64_t t = 0; t < t_len; ++t) {  // each V row read once
    if (t + PF < t_len) prefetch_row(v + (idx ? idx[t + PF] : t + PF) * D, D);
    const float* __restrict vr = v + (idx ? idx[t] : t) * D;
    for (int64_t g = 0; g < g_len; ++g) {
      const float p = sc[g * t_len + t];
      float* __restrict a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
    }
  }
  for (int64_t g = 0; g < g_len; ++g)
    for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv[g];
}

// the GQA groups of common models unrolled (LLaVA-1.5 1, smollm2-llava 3, Qwen2-VL 7, ...)
template <int DT>
static void by_rows(const float* q, const float* k, const float* v, float* o, float* lse, int64_t t_len,
                    int64_t g_len, float* sc, int64_t d_rt, const int64_t* idx, float* pr, int64_t pc,
                    const int64_t* col) {
  switch (g_len) {
    case 1: return segment<DT, 1>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    case 2: return segment<DT, 2>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    case 3: return segment<DT, 3>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    case 4: return segment<DT, 4>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    case 7: return segment<DT, 7>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    case 8: return segment<DT, 8>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
    default: return segment<DT, 0>(q, k, v, o, lse, t_len, g_len, sc, d_rt, idx, pr, pc, col);
  }
}

static void dispatch(const float* q, const float* k, const float* v, float* o, float* lse, int64_t t_len,
                     int64_t g_len, float* sc, int64_t d, const int64_t* idx, float* pr = nullptr,
                     int64_t pc = 0, const int64_t* col = nullptr) {
  if (d == 64) by_rows<64>(q, k, v, o, lse, t_len, g_len, sc, d, idx, pr, pc, col);
  else if (d == 128) by_rows<128>(q, k, v, o, lse, t_len, g_len, sc, d, idx, pr, pc, col);
  else segment<0, 0>(q, k, v, o, lse, t_len, g_len, sc, d, idx, pr, pc, col);
}

// q (R, H, G, D) fp32 scaled; k, v (H, S, D) fp32 contiguous; seg_req, seg_start, seg_len (N,) int64.
// Returns out (N, H, G, D) and lse (N, H, G).
std::vector<torch::Tensor> segments(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    torch::Tensor seg_req, torch::Tensor seg_start, torch::Tensor seg_len) {
  const int64_t H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(1), N = seg_req.size(0);
  TORCH_CHECK(G <= 16 && D <= 256 && k.is_contiguous() && v.is_contiguous() && q.is_contiguous(),
              "fused decode kernel: G <= 16, D <= 256, contiguous q, k, v");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == H && k.size(2) == D &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  seg_start.size(0) == N && seg_len.size(0) == N && seg_req.scalar_type() == at::kLong &&
                  seg_start.scalar_type() == at::kLong && seg_len.scalar_type() == at::kLong,
              "fused decode kernel: float32 q (R, H, G, D), k and v (H, S, D); int64 segments of one length");
  auto out = torch::empty({N, H, G, D}, q.options());
  auto lse = torch::empty({N, H, G}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* req = seg_req.data_ptr<int64_t>();
  const int64_t* st = seg_start.data_ptr<int64_t>();
  const int64_t* len = seg_len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)  // every segment inside the pool and naming a query row
    TORCH_CHECK(req[n] >= 0 && req[n] < q.size(0) && st[n] >= 0 && len[n] >= 1 && st[n] + len[n] <= S,
                "fused decode kernel: segment ", n, " (request ", req[n], ", slots ", st[n], " + ", len[n],
                ") outside the pool's ", S, " slots or the ", q.size(0), " query rows");
  at::parallel_for(0, N * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sc;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t n = i / H, h = i % H, t_len = len[n];
      sc.resize(t_len * G);
      const float* qr = qp + (req[n] * H + h) * G * D;
      const float* kr = kp + (h * S + st[n]) * D;
      const float* vr = vp + (h * S + st[n]) * D;
      float* o = op + i * G * D;
      float* l = lp + i * G;
      dispatch(qr, kr, vr, o, l, t_len, G, sc.data(), D, nullptr);
    }
  });
  return {out, lse};
}

// q (R, H, G, D) fp32 scaled; k, v (H, S, D) fp32 contiguous; table (R, H, C) int64, lengths (R, H)
// int64: request r, head h reads the slots table[r, h, :lengths[r, h]] of its own pool row, in place,
// skipping negative slots (holes): each head its own entries and length, nothing gathered. Writes out
// (R, H, G, D) normalised (zeros for a row that holds nothing) and, when pp is not null, probs
// (R, H, G, C): each query row's softmax at the table column of each live entry, 0 elsewhere.
static void rows_impl(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table,
                      torch::Tensor lengths, torch::Tensor out, float* pp) {
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(1);
  const int64_t C = table.size(2);
  TORCH_CHECK(G <= 16 && D <= 256 && k.is_contiguous() && v.is_contiguous() && q.is_contiguous() &&
                  table.is_contiguous() && lengths.is_contiguous(),
              "fused decode kernel: G <= 16, D <= 256, contiguous q, k, v, table, lengths");
  // the pointers below are trusted for every index: shapes and dtypes that disagree are refused here
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == H && k.size(2) == D &&
                  table.dim() == 3 && table.size(0) == R && table.size(1) == H && lengths.dim() == 2 &&
                  lengths.size(0) == R && lengths.size(1) == H && out.sizes() == q.sizes(),
              "fused decode kernel: q (R, H, G, D), k and v (H, S, D), table (R, H, C), lengths (R, H)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "fused decode kernel: float32 q, k, v and int64 table, lengths");
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sc;
    std::vector<int64_t> live, col;
    float lse[16];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t h = i % H, n = std::min(std::max<int64_t>(lp[i], 0), C);
      const int64_t* row = tp + i * C;
      float* pr = pp ? pp + i * G * C : nullptr;
      if (pr)  // this row's own block, zeroed by the thread that fills it (no separate pass)
        for (int64_t j = 0; j < G * C; ++j) pr[j] = 0.f;
      live.clear();
      col.clear();
      bool run = true;  // every live slot the one after the previous
      for (int64_t c = 0; c < n; ++c)  // the head's own entries: holes skipped, slots bounds-checked
        if (row[c] >= 0) {
          TORCH_CHECK(row[c] < S, "fused decode kernel: slot ", row[c], " out of the pool's ", S);
          run = run && (live.empty() || row[c] == live.back() + 1);
          live.push_back(row[c]);
          if (pr) col.push_back(c);
        }
      float* o = op + i * G * D;
      if (live.empty()) {
        for (int64_t j = 0; j < G * D; ++j) o[j] = 0.f;
        continue;
      }
      const int64_t t_len = live.size();
      sc.resize(t_len * G);
      // live slots that are one run (a full cache, a compacted one): read as contiguous rows, no index
      // per row (the segment loop's sequential form); any other row through its slot list
      const int64_t base = run ? live.front() : 0;
      dispatch(qp + i * G * D, kp + (h * S + base) * D, vp + (h * S + base) * D, o, lse, t_len, G, sc.data(), D,
               run ? nullptr : live.data(), pr, C, pr ? col.data() : nullptr);
    }
  });
}

torch::Tensor table_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table,
                         torch::Tensor lengths) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  rows_impl(q, k, v, table, lengths, out, nullptr);
  return out;
}

// table_rows and each row's probabilities: {out (R, H, G, D), probs (R, H, G, C)} from one read of K, V.
std::vector<torch::Tensor> table_rows_probs(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                            torch::Tensor table, torch::Tensor lengths) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  auto probs = torch::empty({q.size(0), q.size(1), q.size(2), table.size(2)}, q.options());
  rows_impl(q, k, v, table, lengths, out, probs.data_ptr<float>());
  return {out, probs};
}
"""

# one extension: the read above and the decode append in front of it (``paged_append``): one build
_EXTENSION = _SOURCE + APPEND_SOURCE
_FUNCTIONS = ["segments", "table_rows", "table_rows_probs", "append_rows"]

_LOCK = threading.Lock()
_BUILT: list = []  # [module or None] once a build was tried


_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")


def cpuinfo_fields(keys: tuple[str, ...], text: str | None = None) -> dict[str, str]:
    """The first value of each of ``keys`` in ``/proc/cpuinfo`` (``text``: its content; read when None),
    stripped; a key it lacks (or no such file) is absent."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in keys and key not in out:
            out[key] = value.strip()
            if len(out) == len(keys):
                break
    return out


def cpu_flags() -> str:
    """What the built binary depends on besides its source: the machine, the CPU's model and its
    instruction-set flags (``-march=native`` compiles for them), from ``/proc/cpuinfo`` where it exists."""
    import platform

    got = cpuinfo_fields(("model name", "flags", "Features"))
    flags = " ".join(sorted((got.get("flags") or got.get("Features", "")).split()))
    return f"{platform.machine()}|{got.get('model name') or platform.processor()}|{flags}"


def build_name(source: str = _EXTENSION, prefix: str = "vlkv_paged_cpu_kernel") -> str:
    """An extension's name (and torch's build folder): keyed by its source, the compile flags and
    :func:`cpu_flags`, so a home shared by machines with other CPUs never loads a binary built for
    instructions this CPU lacks (each CPU kind builds and caches its own)."""
    key = hashlib.sha256("\0".join([source, *_CFLAGS, cpu_flags()]).encode()).hexdigest()[:16]
    return f"{prefix}_{key}"


def _build_dir(name: str) -> Path | None:
    """torch's build directory for the extension ``name`` (None where torch's private helper fails)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False))
    except Exception:  # noqa: BLE001 — a private helper of torch's
        return None


def _is_cached(name: str) -> bool:
    """Whether torch's extension cache already holds a built ``name`` (loading it takes well under a second)."""
    build = _build_dir(name)
    return build is not None and any(build.glob(f"{name}*.so"))  # unknown means "say it"


def load_extension(built: list, name: str, source: str, functions: list[str], what: str, fallback: str):
    """Build (once per process; torch's extension cache keeps the binary) the C++ ``source`` exporting
    ``functions`` as the extension ``name`` (:func:`build_name`) with this module's flags. ``built`` is
    the caller's ``[module or None]`` memo (empty: not tried yet). Returns the module, or None with one
    warning ``"<what> not built (<error>): <fallback>"`` where it cannot be built (no compiler)."""
    if not built:
        with _LOCK:
            if not built:
                try:
                    from torch.utils.cpp_extension import load_inline

                    if not _is_cached(name):  # a ~minute-long stall deserves a line
                        print(
                            f"vlkv: building the {what} for this CPU (once; about a minute)",
                            file=sys.stderr,
                            flush=True,
                        )
                    with build_lock.held(_build_dir(name)):  # a dead builder's lock file would hang us
                        mod = load_inline(
                            name,
                            cpp_sources=source,
                            functions=functions,
                            extra_cflags=list(_CFLAGS),
                            extra_ldflags=["-fopenmp"],
                        )
                except Exception as err:  # noqa: BLE001 — no compiler / headers: the caller keeps its fallback
                    warnings.warn(f"{what} not built ({type(err).__name__}): {fallback}", stacklevel=3)
                    mod = None
                built.append(mod)
    return built[0]


def kernel():
    """The compiled extension module (the read's entry points and the decode append's ``append_rows``),
    built on the first call (None, with one warning, when it cannot be built here: the caller keeps the
    matmul read, and the Python append)."""
    if _BUILT:  # every decode read asks: no hashing, no /proc/cpuinfo read after the first
        return _BUILT[0]
    return load_extension(
        _BUILT, build_name(), _EXTENSION, _FUNCTIONS, "fused CPU decode kernel", "using matmuls"
    )


def segments_attention(
    qs: Tensor, k_pool: Tensor, v_pool: Tensor, req: Tensor, start: Tensor, length: Tensor
) -> tuple[Tensor, Tensor]:
    """Attention of ``qs (R, H_kv, G, D)`` (fp32, scale applied) over ``N`` segments of contiguous slots:
    segment ``i`` is request ``req[i]``'s slots ``[start[i], start[i] + length[i])`` of every head of
    ``k_pool`` / ``v_pool (H_kv, S, D)`` (fp32, contiguous; ``length`` ≥ 1). Returns ``out (N, H_kv, G, D)``
    normalised within each segment and ``lse (N, H_kv, G)``, its log-sum-exp (to merge segments)."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the fused CPU kernel could not be built here (no C++ compiler?)")
    out, lse = mod.segments(qs.contiguous(), k_pool, v_pool, req, start, length)
    return out, lse


def table_attention(qs: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor) -> Tensor:
    """Attention of ``qs (R, H_kv, G, D)`` (fp32, scale applied) over each (request, KV head)'s own slot
    row: ``table (R, H_kv, C)`` int64 slots of ``k_pool`` / ``v_pool (H_kv, S, D)`` (fp32, contiguous),
    the first ``lengths (R, H_kv)`` columns of a row, negative slots (holes) skipped. Every head reads
    only its live entries, in place (per-head tables, holes, ragged lengths: nothing gathered). Returns
    ``(R, H_kv, G, D)`` fp32; a row that holds nothing gives zeros."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the fused CPU kernel could not be built here (no C++ compiler?)")
    return mod.table_rows(
        qs.contiguous(), k_pool, v_pool, table.long().contiguous(), lengths.long().contiguous()
    )


def table_attention_probs(
    qs: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`table_attention` and its probabilities from the same single read of K and V: returns
    ``out (R, H_kv, G, D)`` and ``probs (R, H_kv, G, C)`` fp32, each query row's normalised softmax at the
    table column of each live entry, 0 at holes, past a row's length and in a row that holds nothing
    (a statistics step's per-column probabilities: nothing gathered, no second pass over K)."""
    mod = kernel()
    if mod is None:
        raise RuntimeError("the fused CPU kernel could not be built here (no C++ compiler?)")
    out, probs = mod.table_rows_probs(
        qs.contiguous(), k_pool, v_pool, table.long().contiguous(), lengths.long().contiguous()
    )
    return out, probs
