// skinny_linear: y = x W^T (+ bias) for 1-8 bfloat16 rows of x on the plain [N, K] weight, by
// AVX512-BF16 dot products (a CPU with AVX512-BF16 but no AMX; with AMX, amx_linear.cpp serves
// bf16). float32 batches go to panel_linear.cpp, which replaced this file's float32 loops: it
// streams the weights as fast at 1-8 rows and ran 9-48 rows 1.8-2.3x faster (2-core AMD EPYC
// Zen 3; these register tiles' accumulator array stayed on the stack).
//
// Why: a decode step at low concurrency multiplies a few rows by every weight of the model, which
// is bound by how fast the weights stream from memory; oneDNN's GEMM streams them more slowly.
//
// Loop shape: each task owns a block of weight rows and streams one weight row after another,
// each weight vector, loaded once, feeding every x row (held in L1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TPSERVE_SKINNY_BF16 1
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

// ---- bfloat16 (AVX512-BF16) ---------------------------------------------------------------
// The one-pass loop on bf16 rows (1-8 rows, bound by the weight stream), by vdpbf16ps: each instruction multiplies 32 bf16
// pairs of a weight row and an x row exactly and adds them into 16 float32 lanes; the sum is
// rounded to bf16 once at the end (with the bias, in float32), as oneDNN's bf16 GEMM rounds its
// float32 accumulator once: the same rounding, another order of the float32 sums.
#if defined(TPSERVE_SKINNY_BF16)
// Weight rows per parallel task.
constexpr int64_t kBlockRows = 48;
// Rows up to which the bf16 kernel beats oneDNN's packed bf16 GEMM (on AMX): measured over 30
// layers' projections of the default model's shapes on a 2-core Xeon, 1.4-2.4x at 1-4 rows,
// 1.02-1.16x at 8; at 12-32 rows register tiles of 4 weight x 4 x rows ran 0.3-0.8x oneDNN's
// speed (vdpbf16ps bound: the AMX tiles do 16x more per instruction), so only the one-pass loop.
constexpr int64_t kMaxRowsBf16 = 8;
// Prefetch distance in bf16 elements (2 KB: measured best of 1, 2 and 4 KB for the float32 loop
// this file once had).
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
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16,
              "skinny_linear: bfloat16 only (float32 batches take panel_linear)");
  return skinny_linear_bf16(x_in, weight, bias);
}

// The most bfloat16 rows for which the engine should call skinny_linear: 0 where this build has
// no AVX512-BF16.
int64_t skinny_linear_max_rows_bf16() { return kMaxRowsBf16; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &skinny_linear);
  m.def("skinny_linear_max_rows_bf16() -> int", &skinny_linear_max_rows_bf16);
}
