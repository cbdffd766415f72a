// skinny_linear: y = x W^T (+ bias) for a few rows of x, float32, on the plain [N, K] weight.
//
// Why: a decode step at low concurrency multiplies 1-8 rows by every weight of the model, so it
// is bound by how fast the weights stream from memory, not by FMAs. oneDNN's prepacked GEMM
// (workers/cpu_linear.py), right for prefill and large decode batches, streamed the default
// model's projections and LM head (538 MB, cache-cold) at 11-13 GB/s for 1-8 rows on a 2-core
// AMD EPYC (Zen 1); this loop streams them at 12-18 GB/s (two threads; a plain sum of the same
// bytes reads at ~20 GB/s there): 1.33-1.48x faster at every row count from 1 to 8, about even
// at 12 and 16 (where it would take two passes), so it stops at 8 (skinny_linear_max_rows).
//
// Loop shape: each task owns a block of weight rows and streams them one after another; each
// weight vector, loaded once, feeds every x row (the x rows, at most 8 x K floats, stay in L1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TPSERVE_SKINNY_AVX2 1
#endif

namespace {

#if defined(TPSERVE_SKINNY_AVX2)
// Rows up to which skinny_linear beats the packed GEMM (measured; see skinny_linear_max_rows):
// all of them in one pass over the weights (eight accumulators, one weight and one x vector: 10
// of the 16 ymm registers).
constexpr int64_t kMaxRows = 8;
// Weight rows per parallel task.
constexpr int64_t kBlockRows = 16;
// How far ahead (in floats) each weight row is prefetched: 2 KB, measured best of 1, 2 and 4 KB.
constexpr int64_t kPrefetch = 512;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Weight rows [n0, n1) (each K floats) times the T rows of x (x_stride apart) into y[t][n]
// (y_stride apart), plus bias[n] when there is a bias. K's tail past a multiple of 8 is summed in
// scalar. One weight row at a time: measured as fast as two or four interleaved rows at 1-2 x
// rows and faster from 3 on (fewer registers, one sequential stream per thread).
template <int T>
void rows(const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias, float* y,
          int64_t y_stride, int64_t n0, int64_t n1) {
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + k + kPrefetch), _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(wn + k);
      for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * x_stride + k), acc[t]);
    }
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[t]);
      for (int64_t k = k8; k < K; ++k) s += wn[k] * x[t * x_stride + k];
      y[t * y_stride + n] = bias ? s + bias[n] : s;
    }
  }
}

void rows_any(int64_t M, const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias, float* y,
              int64_t y_stride, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: rows<1>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 2: rows<2>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 3: rows<3>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 4: rows<4>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 5: rows<5>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 6: rows<6>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    case 7: rows<7>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
    default: rows<8>(x, x_stride, w, K, bias, y, y_stride, n0, n1); break;
  }
}
#else
constexpr int64_t kMaxRows = 0;
#endif

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kMaxRows > 0, "skinny_linear: built without AVX2 + FMA (skinny_linear_max_rows() is 0)");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x_in.size(0) <= kMaxRows, "skinny_linear: at most ", kMaxRows, " rows of x");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: float32 only");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: the weight must be contiguous");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "skinny_linear: bias must be float32 [N]");
    bias_ptr = b.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(TPSERVE_SKINNY_AVX2)
  if (M == 0 || N == 0) return y;  // (rows_any has no 0-row case)
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    rows_any(M, xp, x_stride, wp, K, bias_ptr, yp, N, begin * kBlockRows, std::min(N, end * kBlockRows));
  });
#endif
  return y;
}

// The most x rows for which the engine should call skinny_linear instead of the packed GEMM;
// 0 where this build has no such path (no AVX2 + FMA).
int64_t skinny_linear_max_rows() { return kMaxRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &skinny_linear);
  m.def("skinny_linear_max_rows() -> int", &skinny_linear_max_rows);
}
