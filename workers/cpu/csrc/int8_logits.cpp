// The greedy LM head's first pass (workers/model/greedy_lm_head.py): every logit estimated from an
// int8 copy of the head (W[n] ~ scales[n] * q[n], one scale per vocabulary row) with a bound on
// its error, and the 16-row panels whose rows can still hold the argmax (a panel: 16 vocabulary
// rows of the head's small-batch weight, a panel of panel_linear's or an n block of amx_linear's
// tiles).
//
// Why: a one-row decode step of the default model reads 269 MB of bf16 weights, 56.6 MB of them
// the LM head, and a greedy request reads only the argmax of its logits. This pass reads the
// int8 copy (half the bytes); only the panels with a row whose upper bound reaches the best
// lower bound (less a margin for the logits' own rounding) are then computed exactly, by the
// head's own kernel, called from here: one op a step (the exact pass in Python's small ops
// added ~0.25 ms a token to the int8 pass; Zen 4, 2026-12-06).
//
//   int8_logit_estimates(x, q, scales, slack) -> (estimates, bounds), both [M, N]
//   int8_greedy_tokens(x, q, scales, packed, slack, margin, limit)
//       -> each row's greedy token over the full head's small-batch weight `packed` (empty: more than
//          `limit` candidate panels, or a non-finite x; the caller runs the full head)
//
// Each int8 weight is widened to float32 exactly and multiplied by x in float32 (FMAs), one scale
// per row at the end. Bound:
// |x . W[n] - estimate[n]| <= scales[n] * slack * ||x||_1, slack = 1/2 for W's rounding to int8
// plus the float32 rounding of this sum and of the exact kernel's (the caller's). x stays float:
// rounding it to int8 as well, for AVX512-VNNI's integer dot products, made the bound useless on
// real hidden states (a few outlier dimensions set x's scale) and was no faster, since the pass is
// bound by memory (Zen 4, 2026-12-06: the default model's head from memory in 1.29 ms with
// vpdpbusd against 1.23 with FMAs).
//
// The int8 copy is laid out in groups of 64 rows, [ceil(N / 64), K, 64] (zero rows pad the last
// group): each step of k widens one 64-byte line into 64 outputs' products with the broadcast
// x[k], so a line costs 4 widenings and 4 FMAs and no output needs a horizontal sum. With the
// copy row by row ([N, K], a dot product per row, four chains and a reduction each) the pass
// was bound by its instructions, not memory: on the Zen 4 (2026-12-06, 2 threads, 28 MB from
// memory) 1.19 ms against 0.95 for the groups and 0.94-0.97 for a plain read of the same bytes.
//
// Groups in parallel (at::parallel_for). Each thread's groups are one sequential stream, which
// the hardware prefetcher follows: software prefetches 6-64 rows ahead made the row-by-row pass
// 10-16% slower.

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "vec.h"

namespace {

using namespace tpserve;

// The most rows of x one pass takes: past two, the widened weights' FMAs cost about as much as
// the full head's bf16 tiles, which share each weight among the rows (Zen 4, in an engine: 4
// rows took 1.07x the full head's step).
constexpr int64_t kMaxRows = 2;
// Output features per panel of panel_linear's layouts, and per n block of amx_linear's tiles.
constexpr int64_t kPanelRows = 16;
// Weight rows per group of the int8 copy, [ceil(N / 64), K, 64]: one step of k reads one 64-byte
// line of a group, the 64 rows' weights of that column.
constexpr int64_t kGroupRows = 64;

// One pass's inputs, checked.
struct Pass {
  at::Tensor x;                // float32 [M, K], contiguous
  int64_t M = 0, N = 0, K = 0;  // rows of x, vocabulary rows (scales), features
  float c[kMaxRows] = {0, 0};  // each row of x's bound per unit of scales[n]: slack * ||x[m]||_1
  bool finite = true;          // x has no NaN or infinity
};

Pass prepare(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales, double slack) {
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8 logits: scales [N] float32");
  const int64_t N = scales.size(0), groups = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) == groups &&
                  q.size(2) == kGroupRows,
              "int8 logits: q [ceil(N / ", kGroupRows, "), K, ", kGroupRows, "] int8 for the N rows of scales");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == q.size(1) && x_in.size(0) >= 1 && x_in.size(0) <= kMaxRows,
              "int8 logits: x [M, K] with 1 <= M <= ", kMaxRows, " and K = ", q.size(1));
  Pass p;
  p.x = x_in.to(at::kFloat).contiguous();
  p.M = p.x.size(0), p.N = N, p.K = q.size(1);
  const float* xp = p.x.data_ptr<float>();
  for (int64_t m = 0; m < p.M; ++m) {
    double l1 = 0.0;
    for (int64_t k = 0; k < p.K; ++k) l1 += std::fabs(xp[m * p.K + k]);
    p.finite &= std::isfinite(l1);
    p.c[m] = static_cast<float>(slack * l1);
  }
  return p;
}

// x . q[n] in float32 for the 64 rows n of one group and the M rows of x: out[m * 64 + j]. Each
// step of k widens the group's 64 weights of column k (one cache line) and adds them times the
// broadcast x[m][k] to 64 accumulators per row of x: no horizontal sums, and every output adds its
// products in k order (the bound holds for any order).
template <int M>
inline void dot_group(const Pass& p, const int8_t* qg, float* out) {
  const int64_t K = p.K;
  const float* x = p.x.data_ptr<float>();
#if defined(__AVX512F__) || defined(TPSERVE_AVX2)
#if defined(__AVX512F__)
  using V = __m512;
  constexpr int64_t W = 16;  // lanes
  auto widen = [](const int8_t* ptr) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr))));
  };
  auto zero = [] { return _mm512_setzero_ps(); };
  auto broadcast = [](float v) { return _mm512_set1_ps(v); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto store = [](float* ptr, V v) { store16(ptr, v); };  // vec.h's
#else
  using V = __m256;
  constexpr int64_t W = 8;
  auto widen = [](const int8_t* ptr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ptr))));
  };
  auto zero = [] { return _mm256_setzero_ps(); };
  auto broadcast = [](float v) { return _mm256_set1_ps(v); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto store = [](float* ptr, V v) { store8(ptr, v); };  // vec.h's
#endif
  // Four registers per row of x a pass: one pass of 64 rows with 16 lanes; with 8 lanes two
  // passes of 32 (sixteen registers would hold the whole group's sums for two rows of x and leave
  // none for the weights), the second reading the group's lines from L2.
  for (int64_t pass = 0; pass < kGroupRows; pass += 4 * W) {
    V acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = zero();
    for (int64_t k = 0; k < K; ++k) {
      const int8_t* col = qg + k * kGroupRows + pass;
      const V w0 = widen(col), w1 = widen(col + W), w2 = widen(col + 2 * W), w3 = widen(col + 3 * W);
      for (int m = 0; m < M; ++m) {
        const V xb = broadcast(x[m * K + k]);
        acc[m][0] = fma(w0, xb, acc[m][0]);
        acc[m][1] = fma(w1, xb, acc[m][1]);
        acc[m][2] = fma(w2, xb, acc[m][2]);
        acc[m][3] = fma(w3, xb, acc[m][3]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) store(out + m * kGroupRows + pass + W * i, acc[m][i]);
  }
#else
  for (int m = 0; m < M; ++m) std::fill(out + m * kGroupRows, out + (m + 1) * kGroupRows, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* col = qg + k * kGroupRows;
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < kGroupRows; ++j) out[m * kGroupRows + j] += static_cast<float>(col[j]) * x[m * K + k];
  }
#endif
}

// estimates [M][N] and bounds [M][N] (or null) for the weight rows of groups [begin, end), and per
// row of x the largest estimate - bound among them (lower, [M]).
template <int M>
void estimate_groups(const Pass& p, const int8_t* q, const float* scales, float* estimates, float* bounds,
                     float* lower, int64_t begin, int64_t end) {
  const int64_t N = p.N, K = p.K;
  for (int m = 0; m < M; ++m) lower[m] = -INFINITY;
  alignas(64) float dots[kMaxRows * kGroupRows];
  for (int64_t g = begin; g < end; ++g) {
    dot_group<M>(p, q + g * K * kGroupRows, dots);
    const int64_t first = g * kGroupRows, rows = std::min(kGroupRows, N - first);  // the last group's padding: none
    for (int m = 0; m < M; ++m) {
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t n = first + j;
        const float e = dots[m * kGroupRows + j] * scales[n], bound = scales[n] * p.c[m];
        estimates[m * N + n] = e;
        if (bounds) bounds[m * N + n] = bound;
        lower[m] = std::max(lower[m], e - bound);
      }
    }
  }
}

// Every estimate (and bound, if asked), and per row of x the largest lower bound.
void estimate_all(const Pass& p, const at::Tensor& q, const at::Tensor& scales, float* estimates, float* bounds,
                  float* best_lower) {
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  // 4 groups a task: 256 weight rows, ~150 KB for the default model's K of 576.
  const int64_t grain = 4, groups = q.size(0), tasks = (groups + grain - 1) / grain;
  std::vector<float> lowers(tasks * kMaxRows, -INFINITY);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = t * grain, end = std::min(groups, begin + grain);
      float* lower = lowers.data() + t * kMaxRows;
      if (p.M == 1)
        estimate_groups<1>(p, qp, sp, estimates, bounds, lower, begin, end);
      else
        estimate_groups<2>(p, qp, sp, estimates, bounds, lower, begin, end);
    }
  });
  for (int64_t m = 0; m < p.M; ++m) {
    best_lower[m] = -INFINITY;
    for (int64_t t = 0; t < tasks; ++t) best_lower[m] = std::max(best_lower[m], lowers[t * kMaxRows + m]);
  }
}

std::tuple<at::Tensor, at::Tensor> int8_logit_estimates(const at::Tensor& x, const at::Tensor& q,
                                                        const at::Tensor& scales, double slack) {
  const Pass p = prepare(x, q, scales, slack);
  TORCH_CHECK(p.finite, "int8_logit_estimates: x must be finite");
  at::Tensor estimates = at::empty({p.M, p.N}, p.x.options()), bounds = at::empty({p.M, p.N}, p.x.options());
  float best_lower[kMaxRows];
  estimate_all(p, q, scales, estimates.data_ptr<float>(), bounds.data_ptr<float>(), best_lower);
  return {estimates, bounds};
}

// The panels (ascending) holding a row n whose upper bound, estimate + bound, reaches for some row
// m of x reach[m] = best_lower[m] - margin * (|best_lower[m]| + the largest bound); empty when
// there are more than `limit` such panels or x is not finite (the caller then runs the full head).
std::vector<int64_t> candidate_panels(const Pass& p, const at::Tensor& q, const at::Tensor& scales, double margin,
                                      int64_t limit) {
  if (!p.finite) return {};
  const int64_t M = p.M, N = p.N;
  const float* sp = scales.data_ptr<float>();
  std::vector<float> estimates(M * N);
  float best_lower[kMaxRows], reach[kMaxRows];
  estimate_all(p, q, scales, estimates.data(), nullptr, best_lower);
  const float widest_scale = N > 0 ? *std::max_element(sp, sp + N) : 0.f;
  for (int64_t m = 0; m < M; ++m) {
    reach[m] = best_lower[m] - static_cast<float>(margin) * (std::fabs(best_lower[m]) + p.c[m] * widest_scale);
    if (!std::isfinite(reach[m])) return {};
  }
  std::vector<int64_t> panels;
  for (int64_t n = 0; n < N; ++n) {
    bool candidate = false;
    for (int64_t m = 0; m < M; ++m) candidate |= estimates[m * N + n] + sp[n] * p.c[m] >= reach[m];
    if (!candidate) continue;
    const int64_t panel = n / kPanelRows;
    if (static_cast<int64_t>(panels.size()) == limit) return {};
    panels.push_back(panel);
    n = (panel + 1) * kPanelRows - 1;  // the rest of this panel is in already
  }
  return panels;
}

// Each row of x's greedy token over the full head `packed` (its small-batch weight: panel_linear's
// panels [N/16, K, 16] or k-pairs [N/16, K/2, 32], or amx_linear's tiles [N/16, K/32, 16, 32];
// its first N rows are the vocabulary, the rest padding): the candidate panels' logits computed
// exactly by the head's own kernel (small_batch_linear, which picks it by that layout) on a copy
// of those panels. Each output depends only on its row of weights and x, in an order that does
// not depend on which other panels are there, so the values are the full head's, bit for bit.
// Then their argmax in vocabulary order with torch's rule (the first maximum; a NaN beats every
// number). Empty where the int8 pass does not answer: the caller runs the full head.
at::Tensor int8_greedy_tokens(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                              const at::Tensor& packed, double slack, double margin, int64_t limit) {
  const Pass p = prepare(x, q, scales, slack);
  TORCH_CHECK((packed.dim() == 3 || packed.dim() == 4) && packed.size(0) * kPanelRows >= p.N,
              "int8_greedy_tokens: packed must be the head's small-batch weight in 16-row panels or AMX tiles, "
              "at least N rows");
  const std::vector<int64_t> panels = candidate_panels(p, q, scales, margin, limit);
  if (panels.empty()) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  static const auto small_batch_linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::small_batch_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  const int64_t count = static_cast<int64_t>(panels.size());
  at::Tensor ids = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  std::copy(panels.begin(), panels.end(), ids.data_ptr<int64_t>());
  const at::Tensor exact =
      small_batch_linear.call(x.contiguous(), packed.index_select(0, ids), std::nullopt).to(at::kFloat).contiguous();
  const float* logits = exact.data_ptr<float>();
  const int64_t width = count * kPanelRows;
  at::Tensor tokens = at::empty({p.M}, at::TensorOptions().dtype(at::kLong));
  for (int64_t m = 0; m < p.M; ++m) {
    int64_t best = -1;
    float best_value = 0.f;
    for (int64_t i = 0; i < width; ++i) {
      const int64_t column = panels[i / kPanelRows] * kPanelRows + i % kPanelRows;
      if (column >= p.N) break;  // padding rows close the last panel
      const float v = logits[m * width + i];
      if (best < 0 || v > best_value || (std::isnan(v) && !std::isnan(best_value))) best = column, best_value = v;
    }
    tokens.data_ptr<int64_t>()[m] = best;
  }
  return tokens;
}

int64_t int8_logits_max_rows() { return kMaxRows; }
int64_t int8_logits_group_rows() { return kGroupRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("int8_logit_estimates(Tensor x, Tensor q, Tensor scales, float slack) -> (Tensor, Tensor)",
        &int8_logit_estimates);
  m.def("int8_greedy_tokens(Tensor x, Tensor q, Tensor scales, Tensor packed, float slack, float margin, "
        "int limit) -> Tensor",
        &int8_greedy_tokens);
  m.def("int8_logits_max_rows() -> int", &int8_logits_max_rows);
  m.def("int8_logits_group_rows() -> int", &int8_logits_group_rows);
}
