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
//   int8_logit_estimates(x, q, scales, l1, slack) -> (estimates, bounds), both [M, N]
//   int8_greedy_tokens(x, q, scales, l1, packed, slack, margin, limit)
//       -> each row's greedy token over the full head's small-batch weight `packed` (empty: more than
//          `limit` candidate panels, or a non-finite x; the caller runs the full head)
//
// x is rounded to int16 at one scale per row (s = max |x[m]| / 16383) and each pair of columns
// multiplied by the int8 weights with 16-bit multiplies summed in int32 (vpmaddwd), exactly; the
// sums are carried to float32 every kPairsPerBlock pairs, before an int32 could overflow. Bound,
// with l1[n] = sum_k |q[n][k]|:
//   |x . W[n] - estimate[n]| <= scales[n] * (slack * ||x||_1 + 0.51 s * l1[n] + this sum's rounding)
// slack: the caller's, 1/2 for W's rounding to int8 plus the exact kernel's float32 rounding;
// 0.51 s * l1[n]: x's rounding to int16; the rounding: the float32 conversions and products here.
//
// Why int16: the pass reads 64 weights a step. Widening each int8 to float32 for an FMA (the form
// before) took 3 instructions per 16 weights and was bound by them: on the Zen 4 (2026-12-07, 2
// threads, the default model's 28.5 MB copy, called in a loop) it read 44 GB/s where the bf16
// head's panels read 56-60. Pairs of int16 products take 3 instructions per 32 weights (0.65-0.68
// -> 0.41-0.45 ms a pass there). Rounding x to int8 instead (vpdpbusd) made the bound useless on
// real hidden states (a few outlier dimensions set x's scale); at int16, x's rounding adds a few
// percent to the bound (SmolLM2's greedy replies: candidate rows 3 / 48 / 104 at the median / p99
// / most, against 3 / 46 / 103 with x in float32). (The row-by-row layout before the groups, [N, K]
// with a dot product per row, was slower still: 1.19 ms against 0.95 for the groups.)
//
// The int8 copy is laid out in groups of 64 rows by pairs of columns, [ceil(N / 64), ceil(K / 2),
// 64, 2] (zero rows pad the last group, a zero column an odd K): each step reads the 64 rows'
// weights of two columns, 128 bytes, into 64 outputs with no horizontal sums.
//
// Groups in parallel (at::parallel_for). Each thread's groups are one sequential stream, which
// the hardware prefetcher follows: software prefetches 6-64 rows ahead made the row-by-row pass
// 10-16% slower.

#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>
#include <optional>

#include "vec.h"

namespace {

using namespace tpserve;

// The most rows of x one pass takes: past two, the widened weights' FMAs cost about as much as
// the full head's bf16 tiles, which share each weight among the rows (Zen 4, in an engine: 4
// rows took 1.07x the full head's step; measured with the float32 form before the int16 one).
constexpr int64_t kMaxRows = 2;
// Output features per panel of panel_linear's layouts, and per n block of amx_linear's tiles.
constexpr int64_t kPanelRows = 16;
// Weight rows per group of the int8 copy: one step reads these rows' weights of two columns, one
// 64-byte line on AVX2 (32 rows) and two on AVX-512 (64 rows, four 16-lane registers per row of x;
// the portable loops take 64 too). Python lays the copy out by this build's count
// (int8_logits_group_rows). AVX2 groups of 64 rows, walked in two passes of 32 rows, read every
// other line from memory in the first pass: 1.19-1.64 ms a pass from memory on the Zen 4 against
// 0.97-1.28 for the float32 form before (its lines held one column each).
#if defined(__AVX512BW__) || !defined(TPSERVE_AVX2)
constexpr int64_t kGroupRows = 64;
#else
constexpr int64_t kGroupRows = 32;
#endif
// The largest |x| after rounding to int16: a pair's products sum to at most 2 * 16383 * 127 =
// 4,161,282, so kPairsPerBlock of them (2.13e9) fit an int32.
constexpr int32_t kMaxX = 16383;
constexpr int64_t kPairsPerBlock = 512;
// |x[k] - sx * xq[k]| <= kXRounding * sx (prepare's derivation).
constexpr float kXRounding = 0.51f;

// One pass's inputs, checked.
struct Pass {
  std::vector<int16_t> xq;     // x rounded to int16, [M, 2 * pairs] (a zero column pads an odd K)
  int64_t M = 0, N = 0, K = 0;  // rows of x, vocabulary rows (scales), features
  int64_t pairs = 0;           // column pairs of the copy, ceil(K / 2)
  float sx[kMaxRows] = {0, 0};  // each row of x's int16 scale: x[m][k] ~ sx[m] * xq[m][k]
  float c[kMaxRows] = {0, 0};  // each row's bound per unit of scales[n]: slack * ||x||_1 + rounding
  float d[kMaxRows] = {0, 0};  // ... and per unit of scales[n] * l1[n]: x's rounding, kXRounding * sx
  bool finite = true;          // x has no NaN or infinity, nor a row too small for its int16 scale
};

Pass prepare(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& l1,
             double slack) {
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8 logits: scales [N] float32");
  TORCH_CHECK(l1.dim() == 1 && l1.scalar_type() == at::kFloat && l1.is_contiguous() && l1.size(0) == scales.size(0),
              "int8 logits: l1 [N] float32, as many rows as scales");
  const int64_t N = scales.size(0), groups = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) == groups &&
                  q.size(2) == kGroupRows && q.size(3) == 2,
              "int8 logits: q [ceil(N / ", kGroupRows, "), ceil(K / 2), ", kGroupRows,
              ", 2] int8 for the N rows of scales");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) + 1) / 2 == q.size(1) && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "int8 logits: x [M, K] with 1 <= M <= ", kMaxRows, " and K = ", 2 * q.size(1), " or ",
              2 * q.size(1) - 1);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8 logits: x float32 or bf16");
  Pass p;
  p.M = x.size(0), p.N = N, p.K = x.size(1), p.pairs = q.size(1);
  p.xq.assign(p.M * 2 * p.pairs, 0);
  const int64_t blocks = (p.pairs + kPairsPerBlock - 1) / kPairsPerBlock;
  TPSERVE_DISPATCH(x.scalar_type(), "int8_logits_prepare", [&] {
    for (int64_t m = 0; m < p.M; ++m) {
      const scalar_t* row = x.data_ptr<scalar_t>() + m * x.stride(0);
      auto at = [&](int64_t k) { return to_f(row[k * x.stride(1)]); };
      double l1_x = 0.0;
      float largest = 0.f;
      for (int64_t k = 0; k < p.K; ++k) {
        l1_x += std::fabs(at(k));
        largest = std::max(largest, std::fabs(at(k)));
      }
      // A row so small that its scale would be a subnormal float (|x| < 16383 * FLT_MIN, ~2e-34;
      // hidden states never are) is declined as a non-finite one is: the caller runs the full head.
      p.finite &= std::isfinite(l1_x) && (largest == 0.f || largest >= kMaxX * std::numeric_limits<float>::min());
      if (!p.finite || largest == 0.f) continue;  // a zero row: every estimate 0, every bound 0
      const float sx = largest / kMaxX, inv = kMaxX / largest;
      for (int64_t k = 0; k < p.K; ++k) {
        const float v = std::nearbyint(at(k) * inv);
        p.xq[m * 2 * p.pairs + k] = static_cast<int16_t>(std::max<float>(-kMaxX, std::min<float>(kMaxX, v)));
      }
      p.sx[m] = sx;
      // |x - sx * xq| <= sx / 2 per column, plus the float32 roundings of inv, x * inv and sx
      // (each 2^-24 relative, of values up to 16383: together under 0.004 sx).
      p.d[m] = kXRounding * sx;
      // The estimate's own rounding: each block's exact int32 sum converted to float32 (blocks
      // roundings), the blocks added (blocks - 1), then the products by sx and scales[n] (2): at
      // most (2 blocks + 1) * 2^-24 of sx * sum_k |xq[k] q[n][k]|, to first order, counted as
      // 2 blocks + 2; that sum is at most 127 * (||x||_1 + K * d) per unit of scales[n].
      const double rounding = (2 * blocks + 2) * std::ldexp(1.0, -24) * 127.0 * (l1_x + p.K * p.d[m]);
      p.c[m] = static_cast<float>(slack * l1_x + rounding);
    }
  });
  return p;
}

// Row n's bound for row m of x: |x[m] . W[n] - estimate| <= this (the header's formula).
inline float bound_of(const Pass& p, int m, float scale, float l1) { return scale * (p.c[m] + p.d[m] * l1); }

// sum_k xq[m][k] * q[n][k] for the kGroupRows rows n of one group and the M rows of x, exactly:
// out[m * kGroupRows + j] (in float32, each block's int32 sum converted once).
template <int M>
inline void dot_group(const Pass& p, const int8_t* qg, float* out) {
  const int64_t pairs = p.pairs;
  // Row m's column pair k2 as one int32 (low half: column 2 k2), as the multiplies broadcast it.
  const auto* xpairs = reinterpret_cast<const int32_t*>(p.xq.data());
  for (int m = 0; m < M; ++m) std::fill(out + m * kGroupRows, out + (m + 1) * kGroupRows, 0.f);
#if defined(__AVX512BW__) || defined(TPSERVE_AVX2)
#if defined(__AVX512BW__)
  using V = __m512i;
  constexpr int64_t W = 16;  // int32 lanes: rows of the group per vector
  // 16 rows x 2 columns of int8 (32 bytes) widened to int16 pairs.
  auto widen = [](const int8_t* ptr) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr))); };
  auto zero = [] { return _mm512_setzero_si512(); };
  auto broadcast = [](int32_t v) { return _mm512_set1_epi32(v); };
  // (AVX512-VNNI's vpdpwssd fuses the two: 2-3% faster on the Zen 4 from L3, within the noise
  // from memory, not worth a build flag.)
  auto dot_add = [](V acc, V w, V x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); };
  auto add_to = [](float* ptr, V v) { _mm512_storeu_ps(ptr, _mm512_add_ps(_mm512_loadu_ps(ptr), _mm512_cvtepi32_ps(v))); };
#else
  using V = __m256i;
  constexpr int64_t W = 8;
  auto widen = [](const int8_t* ptr) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr))); };
  auto zero = [] { return _mm256_setzero_si256(); };
  auto broadcast = [](int32_t v) { return _mm256_set1_epi32(v); };
  auto dot_add = [](V acc, V w, V x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); };
  auto add_to = [](float* ptr, V v) { _mm256_storeu_ps(ptr, _mm256_add_ps(_mm256_loadu_ps(ptr), _mm256_cvtepi32_ps(v))); };
#endif
  static_assert(kGroupRows == 4 * W, "four registers per row of x hold a group's sums");
  for (int64_t b0 = 0; b0 < pairs; b0 += kPairsPerBlock) {
    const int64_t b1 = std::min(pairs, b0 + kPairsPerBlock);
    V acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = zero();
    for (int64_t k2 = b0; k2 < b1; ++k2) {
      const int8_t* col = qg + k2 * kGroupRows * 2;
      const V w0 = widen(col), w1 = widen(col + 2 * W), w2 = widen(col + 4 * W), w3 = widen(col + 6 * W);
      for (int m = 0; m < M; ++m) {
        const V xb = broadcast(xpairs[m * pairs + k2]);
        acc[m][0] = dot_add(acc[m][0], w0, xb);
        acc[m][1] = dot_add(acc[m][1], w1, xb);
        acc[m][2] = dot_add(acc[m][2], w2, xb);
        acc[m][3] = dot_add(acc[m][3], w3, xb);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) add_to(out + m * kGroupRows + W * i, acc[m][i]);
  }
#else
  const int16_t* xq = p.xq.data();
  for (int64_t b0 = 0; b0 < pairs; b0 += kPairsPerBlock) {
    const int64_t b1 = std::min(pairs, b0 + kPairsPerBlock);
    for (int m = 0; m < M; ++m) {
      int32_t acc[kGroupRows] = {};
      for (int64_t k2 = b0; k2 < b1; ++k2) {
        const int8_t* col = qg + k2 * kGroupRows * 2;
        const int32_t x0 = xq[m * 2 * pairs + 2 * k2], x1 = xq[m * 2 * pairs + 2 * k2 + 1];
        for (int64_t j = 0; j < kGroupRows; ++j) acc[j] += col[2 * j] * x0 + col[2 * j + 1] * x1;
      }
      for (int64_t j = 0; j < kGroupRows; ++j) out[m * kGroupRows + j] += static_cast<float>(acc[j]);
    }
  }
#endif
}

// Per row of x, over some weight rows: the largest estimate - bound, and the largest bound.
struct Extremes {
  float lower[kMaxRows] = {-INFINITY, -INFINITY};
  float widest[kMaxRows] = {0.f, 0.f};
};

// estimates [M][N] and bounds [M][N] (or null) for the weight rows of groups [begin, end), their
// extremes, and per group and row of x the largest estimate + bound of its rows (upper,
// [groups][kMaxRows], or null).
template <int M>
void estimate_groups(const Pass& p, const int8_t* q, const float* scales, const float* l1, float* estimates,
                     float* bounds, Extremes& extremes, float* upper, int64_t begin, int64_t end) {
  const int64_t N = p.N;
  alignas(64) float dots[kMaxRows * kGroupRows];
  for (int64_t g = begin; g < end; ++g) {
    dot_group<M>(p, q + g * p.pairs * kGroupRows * 2, dots);
    const int64_t first = g * kGroupRows, rows = std::min(kGroupRows, N - first);  // the last group's padding: none
    for (int m = 0; m < M; ++m) {
      float group_upper = -INFINITY;
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t n = first + j;
        const float e = dots[m * kGroupRows + j] * p.sx[m] * scales[n];
        const float bound = bound_of(p, m, scales[n], l1[n]);
        estimates[m * N + n] = e;
        if (bounds) bounds[m * N + n] = bound;
        extremes.lower[m] = std::max(extremes.lower[m], e - bound);
        extremes.widest[m] = std::max(extremes.widest[m], bound);
        group_upper = std::max(group_upper, e + bound);
      }
      if (upper) upper[g * kMaxRows + m] = group_upper;
    }
  }
}

// Every estimate (and bound, if asked), their extremes over all rows, and per group and row of x
// the largest upper bound (if asked).
Extremes estimate_all(const Pass& p, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& l1,
                      float* estimates, float* bounds, float* upper) {
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* lp = l1.data_ptr<float>();
  // 256 weight rows a task, ~150 KB for the default model's K of 576.
  const int64_t grain = 256 / kGroupRows, groups = q.size(0), tasks = (groups + grain - 1) / grain;
  std::vector<Extremes> of_task(tasks);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = t * grain, end = std::min(groups, begin + grain);
      if (p.M == 1)
        estimate_groups<1>(p, qp, sp, lp, estimates, bounds, of_task[t], upper, begin, end);
      else
        estimate_groups<2>(p, qp, sp, lp, estimates, bounds, of_task[t], upper, begin, end);
    }
  });
  Extremes all;
  for (const Extremes& e : of_task)
    for (int64_t m = 0; m < p.M; ++m) {
      all.lower[m] = std::max(all.lower[m], e.lower[m]);
      all.widest[m] = std::max(all.widest[m], e.widest[m]);
    }
  return all;
}

std::tuple<at::Tensor, at::Tensor> int8_logit_estimates(const at::Tensor& x, const at::Tensor& q,
                                                        const at::Tensor& scales, const at::Tensor& l1,
                                                        double slack) {
  const Pass p = prepare(x, q, scales, l1, slack);
  TORCH_CHECK(p.finite, "int8_logit_estimates: x must be finite, and each row's largest |x| at least ~2e-34");
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor estimates = at::empty({p.M, p.N}, options), bounds = at::empty({p.M, p.N}, options);
  estimate_all(p, q, scales, l1, estimates.data_ptr<float>(), bounds.data_ptr<float>(), nullptr);
  return {estimates, bounds};
}

// The panels (ascending) holding a row n whose upper bound, estimate + bound, reaches for some row
// m of x reach[m] = best_lower[m] - margin * (|best_lower[m]| + the largest bound); empty when
// there are more than `limit` such panels or x is not finite (the caller then runs the full head).
// Only the groups whose largest upper bound reaches are walked row by row.
std::vector<int64_t> candidate_panels(const Pass& p, const at::Tensor& q, const at::Tensor& scales,
                                      const at::Tensor& l1, double margin, int64_t limit) {
  if (!p.finite) return {};
  const int64_t M = p.M, N = p.N, groups = q.size(0);
  const float* sp = scales.data_ptr<float>();
  const float* lp = l1.data_ptr<float>();
  // Reused across calls (this thread's): 200 KB of estimates a step need no fresh allocation.
  thread_local std::vector<float> estimates, upper;
  estimates.resize(M * N);
  upper.resize(groups * kMaxRows);
  float reach[kMaxRows];
  const Extremes all = estimate_all(p, q, scales, l1, estimates.data(), nullptr, upper.data());
  for (int64_t m = 0; m < M; ++m) {
    const float best_lower = all.lower[m];
    reach[m] = best_lower - static_cast<float>(margin) * (std::fabs(best_lower) + all.widest[m]);
    if (!std::isfinite(reach[m])) return {};
  }
  std::vector<int64_t> panels;
  for (int64_t g = 0; g < groups; ++g) {
    bool any = false;
    for (int64_t m = 0; m < M; ++m) any |= upper[g * kMaxRows + m] >= reach[m];
    if (!any) continue;
    const int64_t first = g * kGroupRows, last = std::min(N, first + kGroupRows);
    for (int64_t n = first; n < last; ++n) {
      bool candidate = false;
      for (int64_t m = 0; m < M; ++m) candidate |= estimates[m * N + n] + bound_of(p, m, sp[n], lp[n]) >= reach[m];
      if (!candidate) continue;
      const int64_t panel = n / kPanelRows;
      if (static_cast<int64_t>(panels.size()) == limit) return {};
      panels.push_back(panel);
      n = (panel + 1) * kPanelRows - 1;  // the rest of this panel is in already
    }
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
                              const at::Tensor& l1, const at::Tensor& packed, double slack, double margin,
                              int64_t limit) {
  const Pass p = prepare(x, q, scales, l1, slack);
  TORCH_CHECK((packed.dim() == 3 || packed.dim() == 4) && packed.size(0) * kPanelRows >= p.N,
              "int8_greedy_tokens: packed must be the head's small-batch weight in 16-row panels or AMX tiles, "
              "at least N rows");
  const std::vector<int64_t> panels = candidate_panels(p, q, scales, l1, margin, limit);
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
  m.def("int8_logit_estimates(Tensor x, Tensor q, Tensor scales, Tensor l1, float slack) -> (Tensor, Tensor)",
        &int8_logit_estimates);
  m.def("int8_greedy_tokens(Tensor x, Tensor q, Tensor scales, Tensor l1, Tensor packed, float slack, float margin, "
        "int limit) -> Tensor",
        &int8_greedy_tokens);
  m.def("int8_logits_max_rows() -> int", &int8_logits_max_rows);
  m.def("int8_logits_group_rows() -> int", &int8_logits_group_rows);
}
