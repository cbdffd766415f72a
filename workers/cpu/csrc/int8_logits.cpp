// The greedy LM head's first pass (workers/model/greedy_lm_head.py): every logit estimated from an
// int8 copy of the head (W[n] ~ scales[n] * q[n], one scale per vocabulary row) with a bound on
// its error, and the 16-row panels whose rows can still hold the argmax.
//
// Why: a one-row decode step of the default model reads 269 MB of bf16 weights, 56.6 MB of them
// the LM head, and a greedy request reads only the argmax of its logits. This pass reads the
// int8 copy (half the bytes); only the panels with a row whose upper bound reaches the best
// lower bound (less a margin for the logits' own rounding) are then computed exactly, by the
// head's own kernel.
//
//   int8_logit_estimates(x, q, scales, slack) -> (estimates, bounds), both [M, N]
//   int8_argmax_panels(x, q, scales, slack, margin, limit)
//       -> candidate panel ids, ascending (empty: more than `limit`, or a non-finite x)
//
// Each int8 weight is widened to float32 exactly and multiplied by x in float32 (FMAs, four
// chains per row of x, so that the FMA's latency does not set the pace), one scale per row at the
// end. Bound:
// |x . W[n] - estimate[n]| <= scales[n] * slack * ||x||_1, slack = 1/2 for W's rounding to int8
// plus the float32 rounding of this sum and of the exact kernel's (the caller's). x stays float:
// rounding it to int8 as well, for AVX512-VNNI's integer dot products, made the bound useless on
// real hidden states (a few outlier dimensions set x's scale) and was no faster, since the pass is
// bound by memory (Zen 4, 2026-12-06: the default model's head from memory in 1.29 ms with
// vpdpbusd against 1.23 with FMAs).
//
// Weight rows in parallel (at::parallel_for). Each thread's rows are one sequential stream, which
// the hardware prefetcher follows: software prefetches 6-64 rows ahead made the pass 10-16%
// slower (Zen 4: 1.01 ms from memory for the default model's head without them, against 1.82 ms
// for the full bf16 head).

#include "vec.h"

namespace {

using namespace tpserve;

// The most rows of x one pass takes: past two, the widened weights' FMAs cost about as much as
// the full head's bf16 tiles, which share each weight among the rows (Zen 4, in an engine: 4
// rows took 1.07x the full head's step).
constexpr int64_t kMaxRows = 2;
// Output features per panel of panel_linear's layouts.
constexpr int64_t kPanelRows = 16;

// One pass's inputs, checked.
struct Pass {
  at::Tensor x;                // float32 [M, K], contiguous
  int64_t M = 0, N = 0, K = 0;
  float c[kMaxRows] = {0, 0};  // each row of x's bound per unit of scales[n]: slack * ||x[m]||_1
  bool finite = true;          // x has no NaN or infinity
};

Pass prepare(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales, double slack) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "int8 logits: q [N, K] int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == q.size(0),
              "int8 logits: scales [N] float32");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == q.size(1) && x_in.size(0) >= 1 && x_in.size(0) <= kMaxRows,
              "int8 logits: x [M, K] with 1 <= M <= ", kMaxRows, " and K = ", q.size(1));
  Pass p;
  p.x = x_in.to(at::kFloat).contiguous();
  p.M = p.x.size(0), p.N = q.size(0), p.K = q.size(1);
  const float* xp = p.x.data_ptr<float>();
  for (int64_t m = 0; m < p.M; ++m) {
    double l1 = 0.0;
    for (int64_t k = 0; k < p.K; ++k) l1 += std::fabs(xp[m * p.K + k]);
    p.finite &= std::isfinite(l1);
    p.c[m] = static_cast<float>(slack * l1);
  }
  return p;
}

// x . q[n] in float32 for the M rows of x: out[m]. Four accumulators per row of x, each taking
// every fourth vector of weights; named, not an array, which GCC keeps in registers.
template <int M>
inline void dot_row(const Pass& p, const int8_t* qn, float* out) {
  const int64_t K = p.K;
  const float* x = p.x.data_ptr<float>();
  float total[2] = {0.f, 0.f};
  int64_t k = 0;
#if defined(__AVX512F__) || defined(TPSERVE_AVX2)
#if defined(__AVX512F__)
  using V = __m512;
  constexpr int64_t W = 16;
  auto zero = [] { return _mm512_setzero_ps(); };
  auto widen = [](const int8_t* ptr) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr))));
  };
  auto load = [](const float* ptr) { return load16(ptr); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto add = [](V a, V b) { return _mm512_add_ps(a, b); };
  auto sum = [](V a) { return _mm512_reduce_add_ps(a); };
#else
  using V = __m256;
  constexpr int64_t W = 8;
  auto zero = [] { return _mm256_setzero_ps(); };
  auto widen = [](const int8_t* ptr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ptr))));
  };
  auto load = [](const float* ptr) { return load8(ptr); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto add = [](V a, V b) { return _mm256_add_ps(a, b); };
  auto sum = [](V a) { return hsum8(a); };
#endif
  V a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
  V b0 = zero(), b1 = zero(), b2 = zero(), b3 = zero();
  const float* x1 = x + (M > 1 ? K : 0);
  for (; k + 4 * W <= K; k += 4 * W) {
    const V w0 = widen(qn + k), w1 = widen(qn + k + W), w2 = widen(qn + k + 2 * W), w3 = widen(qn + k + 3 * W);
    a0 = fma(w0, load(x + k), a0);
    a1 = fma(w1, load(x + k + W), a1);
    a2 = fma(w2, load(x + k + 2 * W), a2);
    a3 = fma(w3, load(x + k + 3 * W), a3);
    if constexpr (M > 1) {
      b0 = fma(w0, load(x1 + k), b0);
      b1 = fma(w1, load(x1 + k + W), b1);
      b2 = fma(w2, load(x1 + k + 2 * W), b2);
      b3 = fma(w3, load(x1 + k + 3 * W), b3);
    }
  }
  for (; k + W <= K; k += W) {
    const V w0 = widen(qn + k);
    a0 = fma(w0, load(x + k), a0);
    if constexpr (M > 1) b0 = fma(w0, load(x1 + k), b0);
  }
  total[0] = sum(add(add(a0, a1), add(a2, a3)));
  if constexpr (M > 1) total[1] = sum(add(add(b0, b1), add(b2, b3)));
#endif
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) total[m] += static_cast<float>(qn[k]) * x[m * K + k];
  for (int m = 0; m < M; ++m) out[m] = total[m];
}

// estimates [M][N] and bounds [M][N] (or null) for weight rows [begin, end), and per row of x the
// largest estimate - bound among them (lower, [M]).
template <int M>
void estimate_rows(const Pass& p, const int8_t* q, const float* scales, float* estimates, float* bounds,
                   float* lower, int64_t begin, int64_t end) {
  const int64_t N = p.N, K = p.K;
  for (int m = 0; m < M; ++m) lower[m] = -INFINITY;
  float dots[2];
  for (int64_t n = begin; n < end; ++n) {
    dot_row<M>(p, q + n * K, dots);
    for (int m = 0; m < M; ++m) {
      const float e = dots[m] * scales[n], bound = scales[n] * p.c[m];
      estimates[m * N + n] = e;
      if (bounds) bounds[m * N + n] = bound;
      lower[m] = std::max(lower[m], e - bound);
    }
  }
}

// Every estimate (and bound, if asked), and per row of x the largest lower bound.
void estimate_all(const Pass& p, const at::Tensor& q, const at::Tensor& scales, float* estimates, float* bounds,
                  float* best_lower) {
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  // 256 weight rows a task at least: a row is K bytes (576 for the default model), a task ~150 KB.
  const int64_t grain = 256, tasks = (p.N + grain - 1) / grain;
  std::vector<float> lowers(tasks * kMaxRows, -INFINITY);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = t * grain, end = std::min(p.N, begin + grain);
      float* lower = lowers.data() + t * kMaxRows;
      if (p.M == 1)
        estimate_rows<1>(p, qp, sp, estimates, bounds, lower, begin, end);
      else
        estimate_rows<2>(p, qp, sp, estimates, bounds, lower, begin, end);
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
at::Tensor int8_argmax_panels(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, double slack,
                              double margin, int64_t limit) {
  const Pass p = prepare(x, q, scales, slack);
  const auto none = at::empty({0}, at::TensorOptions().dtype(at::kLong));
  if (!p.finite) return none;
  const int64_t M = p.M, N = p.N;
  const float* sp = scales.data_ptr<float>();
  std::vector<float> estimates(M * N);
  float best_lower[kMaxRows], reach[kMaxRows];
  estimate_all(p, q, scales, estimates.data(), nullptr, best_lower);
  const float widest_scale = N > 0 ? *std::max_element(sp, sp + N) : 0.f;
  for (int64_t m = 0; m < M; ++m) {
    reach[m] = best_lower[m] - static_cast<float>(margin) * (std::fabs(best_lower[m]) + p.c[m] * widest_scale);
    if (!std::isfinite(reach[m])) return none;
  }
  std::vector<int64_t> panels;
  for (int64_t n = 0; n < N; ++n) {
    bool candidate = false;
    for (int64_t m = 0; m < M; ++m) candidate |= estimates[m * N + n] + sp[n] * p.c[m] >= reach[m];
    if (!candidate) continue;
    const int64_t panel = n / kPanelRows;
    if (static_cast<int64_t>(panels.size()) == limit) return none;
    panels.push_back(panel);
    n = (panel + 1) * kPanelRows - 1;  // the rest of this panel is in already
  }
  at::Tensor out = at::empty({static_cast<int64_t>(panels.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(panels.begin(), panels.end(), out.data_ptr<int64_t>());
  return out;
}

int64_t int8_logits_max_rows() { return kMaxRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("int8_logit_estimates(Tensor x, Tensor q, Tensor scales, float slack) -> (Tensor, Tensor)",
        &int8_logit_estimates);
  m.def("int8_argmax_panels(Tensor x, Tensor q, Tensor scales, float slack, float margin, int limit) -> Tensor",
        &int8_argmax_panels);
  m.def("int8_logits_max_rows() -> int", &int8_logits_max_rows);
}
