"""The C++ source of the fused decode append (``paged_append.append_attend``'s ``append_rows``).

It is compiled with the paged read's source (``paged_cpu_kernel``: its ``dispatch`` / ``segment``
routines) into that one extension, so the read and the append in front of it are one build (about a
minute, once per CPU kind) and one binary. Kept apart from both Python modules: the kernel module
builds it, the append module calls it, neither imports the other's Python.
"""

APPEND_SOURCE = r"""
// A decode step of one layer: write each request's new K/V row into its pool slots and its tables' new
// column (cols[b]: slot ids[:, b], positions pos_new[b], modality mod_new[b], order ord_new[b], no hole,
// 0 in each running-score table: scores[j], float32 shaped like table score_of[j]'s slot table),
// then attend each (request, KV head)'s slot row. q (B, H, G, D) (any strides; scaled here), k_new / v_new (B, H, 1, D),
// k_pool / v_pool (H, S, D) fp32 contiguous, prerope (H, S) bool contiguous (cleared at the new slots),
// ids (H, B) int64 new slots (any strides), tables: per cache a (b_i, H, C_i) int64 slot table with unit
// column stride (the caches' own tables, Σ b_i = B), holes: per cache an empty tensor (no holes) or a
// (b_i, H, C_i) bool table like it (True: the column holds no entry for that head), lengths (B,) int64
// the entries each request holds after the append. Returns out (B, 1, H·G, D) fp32 and attended (B,)
// float64, the entries each request's row attended (mean over KV heads), and with want_probs
// probs (B, H, G, width): each query row's softmax at the table column of each live entry, 0 elsewhere,
// and held (B, H, width) bool: the live columns.
// the shortest leading run read as contiguous rows apart from the rest of a row's slots
constexpr int64_t PREFIX_MIN = 256;

std::vector<torch::Tensor> append_rows(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                                       torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor prerope,
                                       torch::Tensor ids, std::vector<torch::Tensor> tables,
                                       std::vector<torch::Tensor> holes, std::vector<torch::Tensor> positions,
                                       std::vector<torch::Tensor> modality, std::vector<torch::Tensor> order,
                                       std::vector<torch::Tensor> scores, std::vector<int64_t> score_of,
                                       torch::Tensor cols, torch::Tensor pos_new, torch::Tensor mod_new,
                                       torch::Tensor ord_new, torch::Tensor lengths, double scale,
                                       bool want_probs, int64_t width) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k_pool.size(1);
  TORCH_CHECK(q.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4 && k_pool.dim() == 3 &&
                  v_pool.sizes() == k_pool.sizes() && k_pool.size(0) == H && k_pool.size(2) == D &&
                  k_new.size(0) == B && k_new.size(1) == H && k_new.size(2) == 1 && k_new.size(3) == D &&
                  v_new.sizes() == k_new.sizes() && prerope.dim() == 2 && prerope.size(0) == H &&
                  prerope.size(1) == S && ids.dim() == 2 && ids.size(0) == H && ids.size(1) == B &&
                  lengths.dim() == 1 && lengths.size(0) == B && tables.size() == holes.size() &&
                  tables.size() == positions.size() && tables.size() == modality.size() &&
                  tables.size() == order.size() && cols.dim() == 1 && cols.size(0) == B && pos_new.dim() == 2 &&
                  pos_new.size(0) == B && mod_new.dim() == 1 && mod_new.size(0) == B && ord_new.dim() == 1 &&
                  ord_new.size(0) == B,
              "append_rows: q (B, H, G, D), k_new / v_new (B, H, 1, D), pools (H, S, D), prerope (H, S), "
              "ids (H, B), cols / mod_new / ord_new / lengths (B,), pos_new (B, P); holes, positions, "
              "modality, order: one entry per table");
  TORCH_CHECK(cols.scalar_type() == at::kLong && pos_new.scalar_type() == at::kLong &&
                  mod_new.scalar_type() == at::kChar && ord_new.scalar_type() == at::kLong,
              "append_rows: int64 cols, pos_new, ord_new; int8 mod_new");
  TORCH_CHECK(G <= 16 && D <= 256 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  prerope.is_contiguous() && lengths.is_contiguous() && cols.is_contiguous(),
              "append_rows: G <= 16, D <= 256, contiguous pools, prerope, lengths and cols");
  TORCH_CHECK(q.is_cpu() && k_new.is_cpu() && v_new.is_cpu() && k_pool.is_cpu() && v_pool.is_cpu() &&
                  prerope.is_cpu() && ids.is_cpu() && cols.is_cpu() && lengths.is_cpu() && pos_new.is_cpu() &&
                  mod_new.is_cpu() && ord_new.is_cpu(),
              "append_rows: every tensor on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat &&
                  v_new.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat && prerope.scalar_type() == at::kBool &&
                  ids.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "append_rows: float32 q, k, v, pools; bool prerope; int64 ids, lengths");
  // per request: its table's rows, column count and row stride, its holes' (or null)
  std::vector<const int64_t*> trow(B * H);
  std::vector<const bool*> hrow(B * H, nullptr);
  std::vector<int64_t> tcols(B), owner(B), orow(B);
  int64_t b0 = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto& tb = tables[t];
    TORCH_CHECK(tb.dim() == 3 && tb.size(1) == H && tb.stride(2) == 1 && tb.scalar_type() == at::kLong &&
                    b0 + tb.size(0) <= B,
                "append_rows: table ", t, " must be (b, H, C) int64 with unit column stride");
    const auto& hb = holes[t];
    const bool has_holes = hb.numel() > 0;
    TORCH_CHECK(!has_holes || (hb.sizes() == tb.sizes() && hb.scalar_type() == at::kBool && hb.stride(2) == 1),
                "append_rows: holes ", t, " must be empty or a bool table shaped like its slot table");
    const auto &pt = positions[t], &mt = modality[t], &ot = order[t];
    TORCH_CHECK(pt.dim() == 4 && pt.size(0) == tb.size(0) && pt.size(1) == H && pt.size(2) == tb.size(2) &&
                    pt.size(3) == pos_new.size(1) && pt.scalar_type() == at::kLong && mt.sizes() == tb.sizes() &&
                    mt.scalar_type() == at::kChar && ot.sizes() == tb.sizes() && ot.scalar_type() == at::kLong,
                "append_rows: positions ", t, " (b, H, C, P) int64, modality (b, H, C) int8, order (b, H, C) "
                "int64, shaped like its slot table");
    for (int64_t i = 0; i < tb.size(0); ++i) {
      tcols[b0 + i] = tb.size(2);
      owner[b0 + i] = t;
      orow[b0 + i] = i;
      for (int64_t h = 0; h < H; ++h) {
        trow[(b0 + i) * H + h] = tb.data_ptr<int64_t>() + i * tb.stride(0) + h * tb.stride(1);
        if (has_holes) hrow[(b0 + i) * H + h] = hb.data_ptr<bool>() + i * hb.stride(0) + h * hb.stride(1);
      }
    }
    b0 += tb.size(0);
  }
  TORCH_CHECK(b0 == B, "append_rows: the tables hold ", b0, " requests, q ", B);
  // per table its running-score tables (zeroed at the new column: the reservation left them)
  TORCH_CHECK(scores.size() == score_of.size(), "append_rows: one owning table per score table");
  for (size_t j = 0; j < scores.size(); ++j) {
    const int64_t t = score_of[j];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(tables.size()), "append_rows: score table ", j,
                " names table ", t, " of ", tables.size());
    const auto& st = scores[j];
    TORCH_CHECK(st.sizes() == tables[t].sizes() && st.scalar_type() == at::kFloat && st.stride(2) == 1 &&
                    st.is_cpu(),
                "append_rows: score table ", j, " must be float32 on the CPU, shaped like its slot table");
  }
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  bool* pre = prerope.data_ptr<bool>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  auto ia = ids.accessor<int64_t, 2>();
  auto ka = k_new.accessor<float, 4>();
  auto va = v_new.accessor<float, 4>();
  const int64_t* cl = cols.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // every new slot and column checked before anything is written
    TORCH_CHECK(cl[b] >= 0 && cl[b] < tcols[b], "append_rows: column ", cl[b], " outside request ", b, "'s ",
                tcols[b], " table columns");
    for (int64_t h = 0; h < H; ++h)
      TORCH_CHECK(ia[h][b] >= 0 && ia[h][b] < S, "append_rows: new slot ", ia[h][b], " out of the pool's ", S);
  }
  // the tables' new column: slot, positions, modality, order, not a hole (every head holds the entry)
  auto pa = pos_new.accessor<int64_t, 2>();
  auto ma = mod_new.accessor<int8_t, 1>();
  auto oa = ord_new.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = owner[b], i = orow[b], c = cl[b];
    auto& tb = tables[t];
    auto& pt = positions[t];
    auto& mt = modality[t];
    auto& ot = order[t];
    for (int64_t h = 0; h < H; ++h) {
      tb.data_ptr<int64_t>()[i * tb.stride(0) + h * tb.stride(1) + c] = ia[h][b];
      for (int64_t p = 0; p < pt.size(3); ++p)
        pt.data_ptr<int64_t>()[i * pt.stride(0) + h * pt.stride(1) + c * pt.stride(2) + p * pt.stride(3)] = pa[b][p];
      mt.data_ptr<int8_t>()[i * mt.stride(0) + h * mt.stride(1) + c * mt.stride(2)] = ma[b];
      ot.data_ptr<int64_t>()[i * ot.stride(0) + h * ot.stride(1) + c * ot.stride(2)] = oa[b];
      if (hrow[b * H + h]) const_cast<bool*>(hrow[b * H + h])[c] = false;
    }
    for (size_t j = 0; j < scores.size(); ++j) {
      if (score_of[j] != t) continue;
      const auto& st = scores[j];
      float* sp = st.data_ptr<float>();
      for (int64_t h = 0; h < H; ++h) sp[i * st.stride(0) + h * st.stride(1) + c] = 0.f;
    }
  }
  // the write: B·H rows of D floats (before any read: a request attends its own new entry)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t s = ia[h][b];
      float* kd = kp + (h * S + s) * D;
      float* vd = vp + (h * S + s) * D;
      for (int64_t d = 0; d < D; ++d) {
        kd[d] = ka[b][h][0][d];
        vd[d] = va[b][h][0][d];
      }
      pre[h * S + s] = false;
    }
  auto qa = q.accessor<float, 4>();
  auto out = torch::empty({B, 1, H * G, D}, q.options());
  std::vector<int64_t> counts(B * H);
  torch::Tensor probs, held;
  float* pp = nullptr;
  bool* hp = nullptr;
  if (want_probs) {
    TORCH_CHECK(width >= 0, "append_rows: width must be >= 0");
    probs = torch::empty({B, H, G, width}, q.options());
    held = torch::zeros({B, H, width}, prerope.options());
    pp = probs.data_ptr<float>();
    hp = held.data_ptr<bool>();
  }
  float* op = out.data_ptr<float>();
  int64_t* cp = counts.data();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sc;
    std::vector<int64_t> live, col;
    alignas(64) float qs[16 * 256];
    float lse[16];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H;
      const int64_t n = std::min(std::max<int64_t>(lp[b], 0), tcols[b]);
      const int64_t* row = trow[i];
      const bool* hole = hrow[i];
      float* pr = pp ? pp + i * G * width : nullptr;
      if (pr)
        for (int64_t j = 0; j < G * width; ++j) pr[j] = 0.f;
      live.clear();
      col.clear();
      bool run = true;
      for (int64_t c = 0; c < n; ++c) {
        if (hole && hole[c]) continue;
        const int64_t s = row[c];
        TORCH_CHECK(s >= 0 && s < S, "append_rows: slot ", s, " out of the pool's ", S);
        run = run && (live.empty() || s == live.back() + 1);
        live.push_back(s);
        if (pr) {
          TORCH_CHECK(c < width, "append_rows: column ", c, " past the probabilities' width ", width);
          col.push_back(c);
          hp[i * width + c] = true;
        }
      }
      cp[i] = live.size();
      float* o = op + i * G * D;  // (B, 1, H·G, D): request b, KV head h's G query rows
      if (live.empty()) {
        for (int64_t j = 0; j < G * D; ++j) o[j] = 0.f;
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = qa[b][h][g][d] * static_cast<float>(scale);
      const int64_t t_len = live.size();
      sc.resize(t_len * G);
      // a leading run of slots (a prompt) followed by scattered ones (decode appends): the run read as
      // contiguous rows (the hardware prefetcher streams it; ~15% faster than through its slot list at
      // 8k rows), the rest through their slots, the two softmaxes merged by their log-sum-exps
      int64_t m = 1;
      while (!run && m < t_len && live[m] == live[m - 1] + 1) ++m;
      if (run || m < PREFIX_MIN) {
        const int64_t base = run ? live.front() : 0;
        dispatch(qs, kp + (h * S + base) * D, vp + (h * S + base) * D, o, lse, t_len, G, sc.data(), D,
                 run ? nullptr : live.data(), pr, width, pr ? col.data() : nullptr);
        continue;
      }
      alignas(64) float o2[16 * 256];
      float lse2[16];
      const int64_t base = live.front();
      dispatch(qs, kp + (h * S + base) * D, vp + (h * S + base) * D, o, lse, m, G, sc.data(), D, nullptr, pr,
               width, pr ? col.data() : nullptr);
      dispatch(qs, kp + h * S * D, vp + h * S * D, o2, lse2, t_len - m, G, sc.data(), D, live.data() + m, pr,
               width, pr ? col.data() + m : nullptr);
      for (int64_t g = 0; g < G; ++g) {
        const float top = std::max(lse[g], lse2[g]);
        const float w1 = std::exp(lse[g] - top), w2 = std::exp(lse2[g] - top);
        const float a1 = w1 / (w1 + w2), a2 = w2 / (w1 + w2);
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = o[g * D + d] * a1 + o2[g * D + d] * a2;
        if (pr) {
          float* p = pr + g * width;
          for (int64_t t = 0; t < m; ++t) p[col[t]] *= a1;
          for (int64_t t = m; t < t_len; ++t) p[col[t]] *= a2;
        }
      }
    }
  });
  auto attended = torch::empty({B}, lengths.options().dtype(at::kDouble));
  double* ap = attended.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {  // live entries read, mean over KV heads (as the Python read counts)
    int64_t sum = 0;
    for (int64_t h = 0; h < H; ++h) sum += cp[b * H + h];
    ap[b] = static_cast<double>(sum) / H;
  }
  if (want_probs) return {out, attended, probs, held};
  return {out, attended};
}
"""
