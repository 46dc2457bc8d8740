"""The C++ source of the CPU decode eviction (``evict_rows``: ``drop_columns``, ``lowest_columns``,
``add_group_sums``, ``avl_text_step``, ``tables_apart``).

Kept apart from the Python module that builds and calls it (``evict_rows.kernel``), so each stays
short; the build is keyed by this text (``paged_cpu_kernel.build_name``).
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <utility>

// tables: L groups of T per-entry tables (layer l's are tables[l*T .. l*T + T), its slot table
// (int64) first), each (B, H, C, ...) on the CPU with contiguous columns (stride(2) = the product of
// the trailing sizes, those contiguous); cols (L, B, H) int64 contiguous: the one column each row
// drops, in [0, k]. Moves each row's columns (cols, k] one to the left (column k keeps its value) and
// returns the dropped slot ids (L, B, H) int64, read before the move.
torch::Tensor drop_columns(std::vector<torch::Tensor> tables, int64_t per_layer, torch::Tensor cols, int64_t k) {
  TORCH_CHECK(per_layer >= 1 && cols.device().is_cpu() && cols.dim() == 3 && cols.scalar_type() == at::kLong &&
                  cols.is_contiguous() &&
                  (int64_t)tables.size() == cols.size(0) * per_layer && k >= 0,
              "drop_columns: cols (L, B, H) int64 contiguous, per_layer tables per layer, k >= 0");
  const int64_t L = cols.size(0), B = cols.size(1), H = cols.size(2);
  struct Table { char* base; int64_t sb, sh, inner; };
  std::vector<Table> info(tables.size());
  for (size_t i = 0; i < tables.size(); ++i) {
    const auto& t = tables[i];
    TORCH_CHECK(t.device().is_cpu() && t.dim() >= 3 && t.size(0) == B && t.size(1) == H && t.size(2) > k,
                "drop_columns: every table (B, H, C > k, ...) on the CPU");
    int64_t inner = 1;
    for (int64_t d = t.dim() - 1; d >= 3; --d) {
      TORCH_CHECK(t.stride(d) == inner, "drop_columns: a table's trailing dimensions must be contiguous");
      inner *= t.size(d);
    }
    TORCH_CHECK(t.stride(2) == inner, "drop_columns: a table's columns must be contiguous");
    // rows must not overlap (a broadcast table would be moved once per row it is seen from)
    TORCH_CHECK((H == 1 || t.stride(1) >= t.size(2) * inner) && (B == 1 || t.stride(0) >= H * t.stride(1)),
                "drop_columns: a table's rows must not overlap");
    if (i % per_layer == 0)
      TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 3, "drop_columns: each layer's first table is its int64 slot table");
    const int64_t es = t.element_size();
    info[i] = {static_cast<char*>(t.data_ptr()), t.stride(0) * es, t.stride(1) * es, inner * es};
  }
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t r = 0; r < L * B * H; ++r)
    TORCH_CHECK(cp[r] >= 0 && cp[r] <= k, "drop_columns: a dropped column outside [0, k]");
  auto gone = torch::empty({L, B, H}, cols.options());
  int64_t* gp = gone.data_ptr<int64_t>();
  at::parallel_for(0, L * B * H, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t l = r / (B * H), b = (r / H) % B, h = r % H, c = cp[r];
      for (int64_t j = 0; j < per_layer; ++j) {
        const Table& t = info[l * per_layer + j];
        char* row = t.base + b * t.sb + h * t.sh;
        if (j == 0) gp[r] = reinterpret_cast<const int64_t*>(row)[c];
        if (c < k) std::memmove(row + c * t.inner, row + (c + 1) * t.inner, (k - c) * t.inner);
      }
    }
  });
  return gone;
}

// A total order key of a ranked score: invalid columns lowest (-inf), forced ones and NaN highest
// (+inf), else the float's own order (-0.0 as +0.0: they compare equal). Integer keys, so the
// build's -ffast-math cannot fold away the NaN and infinity cases.
static inline uint32_t rank_key(float v, bool valid, bool forced) {
  if (!valid) return 0x007FFFFFu;  // the key of -inf
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (forced || (bits & 0x7FFFFFFFu) > 0x7F800000u) return 0xFF800000u;  // the key of +inf
  if (bits == 0x80000000u) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// scores: G tensors (B, H, W) fp32 with unit column stride; valid, forced (B, 1 or H, W) bool (any
// strides; forced may be empty: none). Returns (G, B, H) int64: each row's lowest column (the
// highest column among equals), ranked as above.
torch::Tensor lowest_columns(std::vector<torch::Tensor> scores, torch::Tensor valid, torch::Tensor forced) {
  TORCH_CHECK(!scores.empty() && valid.device().is_cpu() && valid.dim() == 3 && valid.scalar_type() == at::kBool &&
                  (forced.numel() == 0 || forced.device().is_cpu()),
              "lowest_columns: one or more score tables, valid / forced (B, 1 or H, W) bool on the CPU");
  const int64_t B = scores[0].size(0), H = scores[0].size(1), W = scores[0].size(2);
  const bool any_forced = forced.numel() > 0;
  TORCH_CHECK(W >= 1 && valid.size(0) == B && (valid.size(1) == 1 || valid.size(1) == H) && valid.size(2) == W &&
                  (!any_forced || (forced.dim() == 3 && forced.scalar_type() == at::kBool && forced.size(0) == B &&
                                   (forced.size(1) == 1 || forced.size(1) == H) && forced.size(2) == W)),
              "lowest_columns: valid / forced (B, 1 or H, W) bool like the scores (B, H, W), W >= 1");
  for (const auto& t : scores)
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == B &&
                    t.size(1) == H && t.size(2) == W && t.stride(2) == 1,
                "lowest_columns: every score (B, H, W) fp32 on the CPU with unit column stride");
  const int64_t G = scores.size();
  auto out = torch::empty({G, B, H}, torch::dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  const bool* fp = any_forced ? forced.data_ptr<bool>() : nullptr;
  const int64_t vb = valid.stride(0), vh = valid.size(1) == 1 ? 0 : valid.stride(1), vw = valid.stride(2);
  const int64_t fb = any_forced ? forced.stride(0) : 0, fw = any_forced ? forced.stride(2) : 0;
  const int64_t fh = any_forced && forced.size(1) != 1 ? forced.stride(1) : 0;
  // each table's base and row strides read once, not per row inside the loop
  struct Table { const float* base; int64_t sb, sh; };
  std::vector<Table> info(G);
  for (int64_t g = 0; g < G; ++g) info[g] = {scores[g].data_ptr<float>(), scores[g].stride(0), scores[g].stride(1)};
  at::parallel_for(0, G * B * H, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t g = r / (B * H), b = (r / H) % B, h = r % H;
      const Table& t = info[g];
      const float* row = t.base + b * t.sb + h * t.sh;
      const bool* vr = vp + b * vb + h * vh;
      const bool* fr = fp ? fp + b * fb + h * fh : nullptr;
      uint32_t best = 0xFFFFFFFFu;
      int64_t at = 0;
      for (int64_t j = 0; j < W; ++j) {
        const uint32_t key = rank_key(row[j], vr[j * vw], fr && fr[j * fw]);
        if (key <= best) { best = key; at = j; }
      }
      op[r] = at;
    }
  });
  return out;
}

// The tables one call writes share no memory with each other or with the tables it reads: every
// layer's rows run in one parallel region, and the row loops take restrict pointers. Each written
// table's rows apart (row-major (B, H, C) views); byte ranges compared, reads may overlap reads.
// Returns what is wrong, or null.
static const char* apart_problem(const std::vector<torch::Tensor>& written, const std::vector<torch::Tensor>& read) {
  struct Span { uintptr_t lo, hi; bool write; };
  std::vector<Span> spans;
  spans.reserve(written.size() + read.size());
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& t : pass == 0 ? written : read) {
      if (t.numel() == 0) continue;
      if (pass == 0) {
        if (t.dim() != 3) return "a written table is not (B, H, C)";
        const int64_t B = t.size(0), H = t.size(1), C = t.size(2);
        if ((H > 1 && t.stride(1) < C) || (B > 1 && t.stride(0) < H * t.stride(1))) return "a table's rows must not overlap";
      }
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); ++d) {
        if (t.stride(d) < 0) return "negative strides";
        last += (t.size(d) - 1) * t.stride(d);
      }
      const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
      spans.push_back({lo, lo + (last + 1) * t.element_size(), pass == 0});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  uintptr_t reach = 0, reach_written = 0;  // the furthest end of any span / any written span so far
  for (const auto& sp : spans) {
    if (sp.lo < reach_written || (sp.write && sp.lo < reach)) return "two tables share memory";
    reach = std::max(reach, sp.hi);
    if (sp.write) reach_written = std::max(reach_written, sp.hi);
  }
  return nullptr;
}

static void check_apart(const std::vector<torch::Tensor>& written, const std::vector<torch::Tensor>& read,
                        const char* what) {
  const char* problem = apart_problem(written, read);
  TORCH_CHECK(problem == nullptr, what, ": ", problem ? problem : "");
}

// Whether the kernels below take these tables (``kv.score_ops`` asks before calling; torch otherwise).
bool tables_apart(std::vector<torch::Tensor> written, std::vector<torch::Tensor> read) {
  return apart_problem(written, read) == nullptr;
}

// Layer l's rows are [start[l], start[l + 1]) of one range over every layer (a parallel region for
// all of them, not one per layer: a decode step calls this with ~30 layers). Returns the layer of
// row r given the layer of an earlier row (or the first, by a search).
static inline int64_t layer_of(const std::vector<int64_t>& start, int64_t r, int64_t l) {
  while (r >= start[l + 1]) ++l;
  return l;
}

// A layer's tables as raw pointers and element strides, read once before the parallel region (not
// per row inside it): dst the score table, src its colsum (a KV head's group starting at row h * G),
// reg its region table (A-VL; null without).
struct Rows {
  float* dst;
  const float* src;
  const float* reg;
  int64_t H, db, dh, sb, sh, sg, rb, rh;
};

static std::vector<Rows> rows_of(const std::vector<torch::Tensor>& scores, const std::vector<torch::Tensor>& colsums,
                                 const std::vector<torch::Tensor>& regions, int64_t G) {
  std::vector<Rows> out(scores.size());
  for (size_t l = 0; l < scores.size(); ++l) {
    const auto &t = scores[l], &c = colsums[l];
    const bool r = !regions.empty();
    out[l] = {t.data_ptr<float>(), c.data_ptr<float>(), r ? regions[l].data_ptr<float>() : nullptr,
              t.size(1), t.stride(0), t.stride(1), c.stride(0), G * c.stride(1), c.stride(1),
              r ? regions[l].stride(0) : 0, r ? regions[l].stride(1) : 0};
  }
  return out;
}

// At least ~16k adds per task: a task per row is too small for rows of a few hundred columns.
static inline int64_t grain_for(int64_t rows, int64_t adds) {
  const int64_t per_row = rows ? std::max<int64_t>(1, adds / rows) : 1;
  return std::max<int64_t>(1, 16384 / per_row);
}

// One row's work, its pointers ``__restrict`` (a score row, its colsum group and its regions never
// share memory: the callers check the score tables apart), so the compiler need not reload through
// every store. (At 1 thread these loops' times move by 10-25 % with nothing but code placement: the
// old per-layer build, re-laid out, timed as this one; measure against a rebuilt baseline.)
static inline void group_row(float* __restrict dst, const float* __restrict src, int64_t sg, int64_t G, int64_t S) {
  for (int64_t j = 0; j < S; ++j) {
    float acc = src[j];
    for (int64_t g = 1; g < G; ++g) acc += src[g * sg + j];
    dst[j] += acc;
  }
}

// A-VL's text row: the group sums added where the region is text (0); returns the text columns
// before ``nb`` (the row's length).
static inline int64_t text_row(float* __restrict dst, const float* __restrict reg, const float* __restrict src,
                               int64_t sg, int64_t G, int64_t W, int64_t nb) {
  int64_t count = 0;
  for (int64_t j = 0; j < W; ++j) {
    if (reg[j] != 0.f) {
      // torch adds sum * 0 = +0.0 here (the sums are >= 0): a no-op but for a -0.0 score, which
      // becomes +0.0 (by its bits: -ffast-math folds float compares of signed zeros)
      uint32_t bits;
      std::memcpy(&bits, dst + j, 4);
      if (bits == 0x80000000u) dst[j] = 0.f;
      continue;
    }
    // a text column (A-VL's text is each row's tail: the colsums are read there only)
    float acc = src[j];
    for (int64_t g = 1; g < G; ++g) acc += src[g * sg + j];
    dst[j] += acc;
    count += j < nb;
  }
  return count;
}

// scores: L tables (B, H, C) fp32 with contiguous columns; colsums: L (B, H * G, S_l) fp32 with unit
// column stride, S_l <= C. Adds each KV head's group sum in place: scores[l][b, h, j] +=
// sum over g of colsums[l][b, h * G + g, j] for j < S_l, the group summed in order from g = 0
// (torch's ``view(B, H, G, S).sum(2)``, then ``add_``).
void add_group_sums(std::vector<torch::Tensor> scores, std::vector<torch::Tensor> colsums, int64_t G) {
  TORCH_CHECK(G >= 1 && scores.size() == colsums.size(), "add_group_sums: one colsum per score table, G >= 1");
  const size_t L = scores.size();
  std::vector<int64_t> start(L + 1, 0);
  int64_t adds = 0;
  for (size_t l = 0; l < L; ++l) {
    const auto& t = scores[l];
    const auto& c = colsums[l];
    TORCH_CHECK(t.device().is_cpu() && c.device().is_cpu() && t.scalar_type() == at::kFloat &&
                    c.scalar_type() == at::kFloat && t.dim() == 3 && c.dim() == 3 && t.stride(2) == 1 &&
                    c.stride(2) == 1 && c.size(0) == t.size(0) && c.size(1) == t.size(1) * G &&
                    c.size(2) <= t.size(2),
                "add_group_sums: scores (B, H, C) and colsums (B, H * G, S <= C) fp32 on the CPU, unit column stride");
    start[l + 1] = start[l] + t.size(0) * t.size(1);
    adds += t.size(0) * t.size(1) * c.size(2) * G;
  }
  check_apart(scores, colsums, "add_group_sums");
  const std::vector<Rows> info = rows_of(scores, colsums, {}, G);
  const int64_t rows = start[L];
  at::parallel_for(0, rows, grain_for(rows, adds), [&](int64_t lo, int64_t hi) {
    int64_t l = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (int64_t r = lo; r < hi; ++r) {
      l = layer_of(start, r, l);
      const Rows& t = info[l];
      const int64_t q = r - start[l], b = q / t.H, h = q % t.H;
      group_row(t.dst + b * t.db + h * t.dh, t.src + b * t.sb + h * t.sh, t.sg, G, colsums[l].size(2));
    }
  });
}

// A-VL's decode step over its text (region code 0), every layer: regions, scores L tables (B, H, C)
// fp32 with contiguous columns, colsums L (B, H * G, S_l) fp32 with unit column stride, widths[l]
// <= min(S_l, C) the columns each layer holds, lengths L (B,) int64. Adds scores[l][b, h, j] +=
// (group sum of colsum) * (regions[l][b, h, j] == 0) for j < widths[l] (the group summed in order;
// times 0 elsewhere, for attention sums >= 0 a +0.0), and returns (L, B) int64: per layer and sample
// the valid text columns of head 0 (j < lengths[b], region 0).
torch::Tensor avl_text_step(std::vector<torch::Tensor> regions, std::vector<torch::Tensor> scores,
                            std::vector<torch::Tensor> colsums, std::vector<int64_t> widths,
                            std::vector<torch::Tensor> lengths, int64_t G) {
  const size_t L = scores.size();
  TORCH_CHECK(G >= 1 && regions.size() == L && colsums.size() == L && widths.size() == L && lengths.size() == L,
              "avl_text_step: one region table, colsum, width and lengths per score table, G >= 1");
  const int64_t B = L ? scores[0].size(0) : 0;
  std::vector<int64_t> start(L + 1, 0);
  int64_t adds = 0;
  for (size_t l = 0; l < L; ++l) {
    const auto &t = scores[l], &r = regions[l], &c = colsums[l], &n = lengths[l];
    TORCH_CHECK(t.device().is_cpu() && r.device().is_cpu() && c.device().is_cpu() && n.device().is_cpu() &&
                    t.scalar_type() == at::kFloat && r.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat &&
                    n.scalar_type() == at::kLong && t.dim() == 3 && r.sizes() == t.sizes() && c.dim() == 3 &&
                    n.dim() == 1 && n.is_contiguous() && t.size(0) == B && n.size(0) == B && c.size(0) == B &&
                    c.size(1) == t.size(1) * G && t.stride(2) == 1 && r.stride(2) == 1 && c.stride(2) == 1 &&
                    widths[l] >= 0 && widths[l] <= c.size(2) && widths[l] <= t.size(2),
                "avl_text_step: regions / scores (B, H, C), colsums (B, H * G, S) fp32, lengths (B,) int64 "
                "on the CPU, unit column strides, widths within S and C");
    start[l + 1] = start[l] + B * t.size(1);
    adds += B * t.size(1) * widths[l] * G;
  }
  std::vector<torch::Tensor> read(regions);
  read.insert(read.end(), colsums.begin(), colsums.end());
  check_apart(scores, read, "avl_text_step");
  auto held = torch::zeros({(int64_t)L, B}, torch::dtype(torch::kLong));
  int64_t* hp = held.data_ptr<int64_t>();
  const std::vector<Rows> info = rows_of(scores, colsums, regions, G);
  std::vector<const int64_t*> np(L);
  for (size_t l = 0; l < L; ++l) np[l] = lengths[l].data_ptr<int64_t>();
  const int64_t rows = start[L];
  at::parallel_for(0, rows, grain_for(rows, adds), [&](int64_t lo, int64_t hi) {
    int64_t l = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (int64_t q = lo; q < hi; ++q) {
      l = layer_of(start, q, l);
      const Rows& t = info[l];
      const int64_t b = (q - start[l]) / t.H, h = (q - start[l]) % t.H;
      const int64_t count = text_row(t.dst + b * t.db + h * t.dh, t.reg + b * t.rb + h * t.rh,
                                     t.src + b * t.sb + h * t.sh, t.sg, G, widths[l], np[l][b]);
      if (h == 0) hp[l * B + b] = count;
    }
  });
  return held;
}
"""
