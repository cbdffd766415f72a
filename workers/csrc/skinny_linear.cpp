// skinny_linear: y = x W^T (+ bias) for a few rows of x on the plain [N, K] weight: float32 (AVX2 +
// FMA, 1-48 rows) and bfloat16 (AVX512-BF16, 1-8 rows; its section below says why only those).
//
// Why: a decode step at low concurrency multiplies a few rows by every weight of the model. At
// 1-8 rows it is bound by how fast the weights stream from memory: oneDNN's prepacked GEMM
// (workers/cpu_linear.py), right for prefill and large batches, streamed the default model's
// projections and LM head (538 MB, cache-cold) at 11-13 GB/s there on a 2-core AMD EPYC (Zen 1);
// the one-pass loop below streams them at 12-19 GB/s (two threads; a plain sum of the same bytes
// reads at ~20 GB/s): 1.3-1.5x faster at every row count from 1 to 8. From 9 rows on the FMAs
// bound it, and oneDNN's GEMM ran 9-48 rows at 33-51 GFLOP/s against Zen 1's ~64 peak; the
// register tiles below run them 1.05-1.16x faster (30 layers' projections; about even at 64
// rows, where oneDNN reaches 60 GFLOP/s), so skinny_linear stops at 48 (skinny_linear_max_rows).
//
// Loop shapes: each task owns a block of weight rows. 1-8 rows: the block streams one weight row
// after another, each weight vector, loaded once, feeding every x row (held in L1). 9-48 rows:
// 3 weight rows x 4 x rows register tiles, the 3 weight rows staying in L1 while all the x rows
// pass them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TPSERVE_SKINNY_AVX2 1
#endif

namespace {

// f(std::integral_constant<int, M>()) for M = 1..8 (8 for more: the callers' limit), so that each
// row count runs its own fully unrolled loop.
template <typename F>
inline void for_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

#if defined(TPSERVE_SKINNY_AVX2)
// Rows up to which skinny_linear beats the packed GEMM (measured; see the header).
constexpr int64_t kMaxRows = 48;
// Up to this many rows, one pass over the weights with every x row at once; above it, register
// tiles of kTileW weight rows x kTileX x rows.
constexpr int64_t kOnePassRows = 8;
constexpr int kTileW = 3, kTileX = 4;
// Weight rows per parallel task (a multiple of kTileW).
constexpr int64_t kBlockRows = 48;
// How far ahead (in floats) each weight row is prefetched: 2 KB, measured best of 1, 2 and 4 KB.
constexpr int64_t kPrefetch = 512;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R weight rows (from w, K apart) times T x rows (from x, x_stride apart) into y[t][r] (y_stride
// apart), plus bias[r] when there is a bias: R x T accumulators of eight lanes, each weight vector
// loaded once for the T rows and each x vector once for the R rows. K's tail past a multiple of 8
// is summed in scalar.
template <int R, int T, bool Prefetch>
void tile(const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias, float* y,
          int64_t y_stride) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) {
      if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + kPrefetch), _MM_HINT_T0);
      wv[r] = _mm256_loadu_ps(w + r * K + k);
    }
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t k = k8; k < K; ++k) s += w[r * K + k] * x[t * x_stride + k];
      y[t * y_stride + r] = bias ? s + bias[r] : s;
    }
  }
}

// Every x row against one weight row at a time (1-8 rows): one sequential weight stream per
// thread, measured faster than interleaving 2-4 weight rows at these counts.
template <int T>
void one_pass(const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias, float* y,
              int64_t y_stride, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    tile<1, T, true>(x, x_stride, w + n * K, K, bias ? bias + n : nullptr, y + n, y_stride);
}

void one_pass_any(int64_t M, const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias,
                  float* y, int64_t y_stride, int64_t n0, int64_t n1) {
  for_rows(M, [&](auto rows) { one_pass<decltype(rows)::value>(x, x_stride, w, K, bias, y, y_stride, n0, n1); });
}

// R weight rows against all M x rows, kTileX at a time (the R rows stay in L1 between tiles).
template <int R>
void tiles_down_x(int64_t M, const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias,
                  float* y, int64_t y_stride) {
  int64_t m = 0;
  for (; m + kTileX <= M; m += kTileX)
    tile<R, kTileX, false>(x + m * x_stride, x_stride, w, K, bias, y + m * y_stride, y_stride);
  const float* xm = x + m * x_stride;
  float* ym = y + m * y_stride;
  switch (M - m) {
    case 3: tile<R, 3, false>(xm, x_stride, w, K, bias, ym, y_stride); break;
    case 2: tile<R, 2, false>(xm, x_stride, w, K, bias, ym, y_stride); break;
    case 1: tile<R, 1, false>(xm, x_stride, w, K, bias, ym, y_stride); break;
    default: break;
  }
}

// 9-48 rows: kTileW x kTileX register tiles (12 accumulators, three weight vectors and one x
// vector: all 16 ymm registers; 7 loads per 12 FMAs, so Zen 1's one 256-bit FMA per cycle, not
// its loads, bounds it).
void tiled(int64_t M, const float* x, int64_t x_stride, const float* w, int64_t K, const float* bias, float* y,
           int64_t y_stride, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileW <= n1; n += kTileW)
    tiles_down_x<kTileW>(M, x, x_stride, w + n * K, K, bias ? bias + n : nullptr, y + n, y_stride);
  for (; n < n1; ++n) tiles_down_x<1>(M, x, x_stride, w + n * K, K, bias ? bias + n : nullptr, y + n, y_stride);
}
#else
constexpr int64_t kMaxRows = 0;
#endif

// ---- bfloat16 (AVX512-BF16) ---------------------------------------------------------------
// The one-pass loop on bf16 rows (1-8 rows, bound by the weight stream), by vdpbf16ps: each instruction multiplies 32 bf16
// pairs of a weight row and an x row exactly and adds them into 16 float32 lanes; the sum is
// rounded to bf16 once at the end (with the bias, in float32), as oneDNN's bf16 GEMM rounds its
// float32 accumulator once: the same rounding, another order of the float32 sums.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(TPSERVE_SKINNY_AVX2)
#define TPSERVE_SKINNY_BF16 1
// Rows up to which the bf16 kernel beats oneDNN's packed bf16 GEMM (on AMX): measured over 30
// layers' projections of the default model's shapes on a 2-core Xeon, 1.4-2.4x at 1-4 rows,
// 1.02-1.16x at 8; at 12-32 rows register tiles of 4 weight x 4 x rows ran 0.3-0.8x oneDNN's
// speed (vdpbf16ps bound: the AMX tiles do 16x more per instruction), so only the one-pass loop.
constexpr int64_t kMaxRowsBf16 = 8;
// Prefetch distance in bf16 elements (2 KB), as the float32 loop's.
constexpr int64_t kPrefetchBf16 = 1024;

// R weight rows x T x rows into y[t][r]: R x T accumulators of 16 float32 lanes; the K tail past a
// multiple of 32 is read by masked loads (zeros add nothing).
template <int R, int T, bool Prefetch>
void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias,
               c10::BFloat16* y, int64_t y_stride) {
  // Written out twice (full chunks, then the masked tail) rather than through a helper taking
  // the accumulators by reference: GCC then keeps them in registers (through a lambda it kept
  // them on the stack, and 9-32 rows ran at a quarter of the FMA rate).
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t k32 = K & ~int64_t(31);
  for (int64_t k = 0; k < k32; k += 32) {
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + kPrefetchBf16), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * x_stride + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  if (k32 < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t(1) << (K - k32)) - 1);
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k32);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * x_stride + k32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const float s = _mm512_reduce_add_ps(acc[r][t]);
      y[t * y_stride + r] = c10::BFloat16(bias ? s + bias[r] : s);  // round to nearest even
    }
}

template <int T>
void one_pass_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias,
                   c10::BFloat16* y, int64_t y_stride, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    tile_bf16<1, T, true>(x, x_stride, w + n * K, K, bias ? bias + n : nullptr, y + n, y_stride);
}

void one_pass_any_bf16(int64_t M, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                       const float* bias, c10::BFloat16* y, int64_t y_stride, int64_t n0, int64_t n1) {
  for_rows(M, [&](auto rows) { one_pass_bf16<decltype(rows)::value>(x, x_stride, w, K, bias, y, y_stride, n0, n1); });
}

#else
constexpr int64_t kMaxRowsBf16 = 0;
#endif

at::Tensor skinny_linear_bf16(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kMaxRowsBf16 > 0, "skinny_linear: built without AVX512-BF16, no bfloat16 path "
              "(skinny_linear_max_rows_bf16() is 0)");
  TORCH_CHECK(x_in.size(0) <= kMaxRowsBf16, "skinny_linear: at most ", kMaxRowsBf16, " rows of x in bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "skinny_linear: x and weight of one dtype");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: the weight must be contiguous");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b;  // the bias in float32: it is added to the float32 sums before the one rounding
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "skinny_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(TPSERVE_SKINNY_BF16)
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kBlockRows, n1 = std::min(N, end * kBlockRows);
    one_pass_any_bf16(M, xp, x_stride, wp, K, bias_ptr, yp, N, n0, n1);
  });
#endif
  return y;
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K]");
  if (x_in.scalar_type() != at::kBFloat16)
    TORCH_CHECK(kMaxRows > 0, "skinny_linear: built without AVX2 + FMA (skinny_linear_max_rows() is 0)");
  if (x_in.scalar_type() == at::kBFloat16) return skinny_linear_bf16(x_in, weight, bias);
  TORCH_CHECK(x_in.size(0) <= kMaxRows, "skinny_linear: at most ", kMaxRows, " rows of x");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: float32 or bfloat16 only, x and weight of one dtype");
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
  if (M == 0 || N == 0) return y;  // (one_pass_any has no 0-row case)
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kBlockRows, n1 = std::min(N, end * kBlockRows);
    if (M <= kOnePassRows) {
      one_pass_any(M, xp, x_stride, wp, K, bias_ptr, yp, N, n0, n1);
    } else {
      tiled(M, xp, x_stride, wp, K, bias_ptr, yp, N, n0, n1);
    }
  });
#endif
  return y;
}

// The most x rows for which the engine should call skinny_linear instead of the packed GEMM;
// 0 where this build has no such path (no AVX2 + FMA).
int64_t skinny_linear_max_rows() { return kMaxRows; }
// The same for bfloat16 rows: 0 where this build has no AVX512-BF16.
int64_t skinny_linear_max_rows_bf16() { return kMaxRowsBf16; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &skinny_linear);
  m.def("skinny_linear_max_rows() -> int", &skinny_linear_max_rows);
  m.def("skinny_linear_max_rows_bf16() -> int", &skinny_linear_max_rows_bf16);
}
