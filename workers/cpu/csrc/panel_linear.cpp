// panel_linear: y = x W^T (+ bias) in float32 (AVX2 + FMA, or AVX-512) on a copy of W packed in
// panels of 16 output features, [N/16, K, 16]: for each k, the panel's 16 weights sit in one
// 64-byte line.
//
// Why: oneDNN's prepacked float32 GEMM (workers/cpu/linear.py) ran the default model's 30 layers
// of projections (cache-cold, 2 threads, 2-core AMD EPYC Zen 3) at 68 GFLOP/s with 16 rows, 94
// with 32, 114 with 64 and ~142 at 512-2048, against this CPU's ~160 GFLOP/s of FMAs; a decode
// step at 16 requests spent 57 of its 85 ms there. This kernel ran the same passes at 116 / 125 /
// 147 / 166 GFLOP/s (1.69x / 1.33x / 1.28x / 1.17x oneDNN's speed), and at 1-8 rows, where the
// weight stream from memory bounds it, as fast as skinny_linear's one-pass loop (1.5-1.65x oneDNN).
// skinny_linear's float32 register tiles, which this replaces, ran 9-48 rows at 52-64 GFLOP/s; a
// first version of this kernel written like them, with an `__m256 acc[R][2]` array, ran at the
// same speed, and objdump showed why: GCC stored the array to the stack on every k step.
//
// Loop shape (BLIS's): each parallel task owns whole panels, and takes the x rows in blocks of 192
// (a prefill chunk's) past all of them (prefill-sized batches: threads claim (row block, panels)
// units from a counter instead, see kClaimRows). Within a panel, the x rows go by in tiles of up to 6: a
// 6 x 16 register tile of accumulators (12 ymm), two weight vectors and one broadcast x value per
// k, so 8 loads feed 12 FMAs, which two loads a cycle keep up with. The panel (K x 64 bytes: 36-96
// KB for the default model) stays in L2 across the row tiles; while the first row tile runs, the
// next panel is prefetched into L2, one line per k. The accumulators are named scalars, not an
// array: GCC keeps those in registers.
//
// bf16 on AVX512-BF16 builds: either the same panels of bf16 weights, widened to float32 as they
// load (FMA tiles), or pair panels [N/16, K/2, 32] multiplied by vdpbf16ps without widening
// (PairForm below: 1.9-2.3x the widened panels from 16 rows on a Zen 4); workers/cpu/linear.py
// times the two at load. On the avx2 build both forms too, as float32 FMAs on weights widened in
// registers (the 256-bit tiles' FmaForm and PairForm), the sums rounded to bf16 in integer ops:
// half the bytes of float32 weights per token where the weight stream sets the pace.
//
// AVX-512 builds (Intel since Skylake-SP, AMD Zen 4) take two panels at a time in 12 x 32 tiles of
// zmm accumulators instead (tile512 below), on the same packed weights. Against the 256-bit tiles
// (the avx2 build's) and oneDNN on a 2-core Sapphire Rapids-class Xeon, the default model's 30
// layers cache-cold, one thread's CPU time (the machine was shared), best of 5, GFLOP/s:
// 1 row 6.5 / 5.4 / 4.6 (oneDNN), 16 rows 75 / 51 / 58, 64 rows 116 / 84 / 109, 256 rows
// 132 / 96 / 138.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TPSERVE_PANEL_AVX2 1
#endif
#if defined(TPSERVE_PANEL_AVX2) && defined(__AVX512F__)
#define TPSERVE_PANEL_AVX512 1
#endif
#if defined(TPSERVE_PANEL_AVX512) && defined(__AVX512BF16__)
#define TPSERVE_PANEL_BF16 1
#endif

namespace {

// Output features per panel: two ymm vectors.
constexpr int64_t kPanel = 16;

#if defined(TPSERVE_PANEL_AVX2)
// Rows of x a task takes past all its panels before the next rows (a prefill chunk's): 192 rows
// of K = 576-1536 floats (0.4-1.2 MB) stay in L2/L3 while the panels pass, instead of the whole
// chunk streaming from memory once per panel. Measured 2-6% faster than no blocking at 256-2048
// rows (96: about the same, 384: slower at 1024-2048).
constexpr int64_t kRowBlock = 192;
// Batches of at least kClaimRows rows (prefill chunks) are cut into units of (row block, chunk
// of panels), about kClaimsPerThread per thread per row block, that the threads take from a
// shared counter instead of half the panels each. Why: a served replica shares its cores with
// the HTTP path and the client, and every time one of them preempts a thread that owns a fixed
// half, its partner finishes and waits. With a neighbour busy 0.3 ms in every 2.3 ms (6.5% of a
// 2-core Zen 4), 4 layers' bf16 projections at 512 / 2,048 rows took 37.3 / 150.6 ms with halves
// and 35.6 / 142.6 with claims (alone: 32.7 / 132.6 both ways, 20 rounds alternated). At 64 rows
// (0.3 ms a projection, as short as the neighbour's bursts) claims won nothing under the
// neighbour and cost 1.5% alone, at 256 rows 2.2% alone: decode batches keep their halves.
constexpr int64_t kClaimRows = 512;
constexpr int64_t kClaimsPerThread = 8;
#endif

#if defined(TPSERVE_PANEL_AVX2) && !defined(TPSERVE_PANEL_AVX512)
// Rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast = 15 of 16 ymm.
constexpr int kTileRows = 6;

// How a 256-bit tile reads its panels. FmaForm: one k a step, float32 panels [N/16, K, 16] or
// bf16 ones widened as they load (vpmovzxwd + a shift: exact, a bf16 value is a float32 with the
// low 16 bits zero). PairForm: bf16 pair panels [N/16, K/2, 32], one k-pair a step; a 32-bit lane
// holds (W[j][2i] low, W[j][2i + 1] high), so a shift left by 16 gives the even k's float32
// weights and a mask of the high half the odd k's, both exact: two integer ops per 8 lanes feed
// 2 x 6 FMAs, where the widened panels spend four (a widening and a shift per 8 lanes of each k).
// On a 2-core Zen 3 the two ran within 2-4% of each other (30 layers cold, 16-256 rows), so
// linear.py's timing at load picks. x is float32 in both (bf16 x widened once by panel_linear):
// kXStep floats a step.
struct FmaForm {
  static constexpr int64_t kStep = kPanel, kXStep = 1;
};
struct PairForm {
  static constexpr int64_t kStep = 2 * kPanel, kXStep = 2;
};

// Panels as they sit in memory: float32, or bf16 (as its bits) widened to float32 on load.
// Aligned loads (panel_linear checks): measured 4-6% faster than unaligned ones for float32.
inline __m256 load_w8(const float* p) { return _mm256_load_ps(p); }
inline __m256 load_w8(const uint16_t* p) {
  const __m128i bits = _mm_load_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
// Outputs: float32, or rounded once to bf16 as c10::BFloat16 rounds (vec.h's store8).
inline void store_y8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store_y8(uint16_t* p, __m256 v) { tpserve::store8(reinterpret_cast<c10::BFloat16*>(p), v); }

#define TPSERVE_ACC_DECL(i) __m256 acc##i##a = _mm256_setzero_ps(), acc##i##b = _mm256_setzero_ps();
#define TPSERVE_ACC_FMA(i, xk)                                      \
  if constexpr (R > i) {                                            \
    const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + (xk)); \
    acc##i##a = _mm256_fmadd_ps(w0, xv, acc##i##a);                 \
    acc##i##b = _mm256_fmadd_ps(w1, xv, acc##i##b);                 \
  }
#define TPSERVE_ACC_FMA_ALL(xk)                                                          \
  TPSERVE_ACC_FMA(0, xk) TPSERVE_ACC_FMA(1, xk) TPSERVE_ACC_FMA(2, xk)                   \
  TPSERVE_ACC_FMA(3, xk) TPSERVE_ACC_FMA(4, xk) TPSERVE_ACC_FMA(5, xk)
#define TPSERVE_ACC_STORE(i)                                                            \
  if constexpr (R > i) {                                                                \
    store_y8(y + i * y_stride, _mm256_add_ps(acc##i##a, b0));                           \
    store_y8(y + i * y_stride + 8, _mm256_add_ps(acc##i##b, b1));                       \
  }

// R x rows (x_stride apart) times one panel (`steps` steps of Form::kStep values) into y's 16
// columns (y_stride apart), plus bias (16 values, or null). `prefetch`: the next panel, one line
// of it per step, or null.
template <typename Form, int R, typename W, typename Y>
void tile(const float* x, int64_t x_stride, const W* panel, int64_t steps, const float* bias, Y* y,
          int64_t y_stride, const W* prefetch) {
  TPSERVE_ACC_DECL(0) TPSERVE_ACC_DECL(1) TPSERVE_ACC_DECL(2)
  TPSERVE_ACC_DECL(3) TPSERVE_ACC_DECL(4) TPSERVE_ACC_DECL(5)
#pragma GCC unroll 4
  for (int64_t k = 0; k < steps; ++k) {
    const W* p = panel + k * Form::kStep;
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * Form::kStep), _MM_HINT_T1);
    if constexpr (std::is_same_v<Form, PairForm>) {
      const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)), 16));
      __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + 16)), 16));
      TPSERVE_ACC_FMA_ALL(2 * k)
      w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)), high));
      w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + 16)), high));
      TPSERVE_ACC_FMA_ALL(2 * k + 1)
    } else {
      const __m256 w0 = load_w8(p), w1 = load_w8(p + 8);
      TPSERVE_ACC_FMA_ALL(k)
    }
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  TPSERVE_ACC_STORE(0) TPSERVE_ACC_STORE(1) TPSERVE_ACC_STORE(2)
  TPSERVE_ACC_STORE(3) TPSERVE_ACC_STORE(4) TPSERVE_ACC_STORE(5)
}

// All M rows against one panel: full tiles of kTileRows, then one tile of the rest. The first
// tile prefetches the next panel.
template <typename Form, typename W, typename Y>
void panel_rows(int64_t M, const float* x, int64_t x_stride, const W* panel, int64_t steps, const float* bias,
                Y* y, int64_t y_stride, const W* next_panel) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<Form, kTileRows>(x + m * x_stride, x_stride, panel, steps, bias, y + m * y_stride, y_stride,
                          m == 0 ? next_panel : nullptr);
  const float* xm = x + m * x_stride;
  Y* ym = y + m * y_stride;
  const W* pf = m == 0 ? next_panel : nullptr;
  switch (M - m) {
    case 5: tile<Form, 5>(xm, x_stride, panel, steps, bias, ym, y_stride, pf); break;
    case 4: tile<Form, 4>(xm, x_stride, panel, steps, bias, ym, y_stride, pf); break;
    case 3: tile<Form, 3>(xm, x_stride, panel, steps, bias, ym, y_stride, pf); break;
    case 2: tile<Form, 2>(xm, x_stride, panel, steps, bias, ym, y_stride, pf); break;
    case 1: tile<Form, 1>(xm, x_stride, panel, steps, bias, ym, y_stride, pf); break;
    default: break;
  }
}

// One task's panels [begin, end) for `rows` rows of x (y: those rows' outputs, N apart).
template <typename Form, typename W, typename Y>
void task_panels(int64_t rows, const float* x, int64_t x_stride, const W* wp, int64_t panel_size, int64_t steps,
                 const float* bias, Y* y, int64_t N, int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p)
    panel_rows<Form>(rows, x, x_stride, wp + p * panel_size, steps, bias ? bias + p * kPanel : nullptr,
                     y + p * kPanel, N, p + 1 < end ? wp + (p + 1) * panel_size : nullptr);
}
#undef TPSERVE_ACC_DECL
#undef TPSERVE_ACC_FMA
#undef TPSERVE_ACC_FMA_ALL
#undef TPSERVE_ACC_STORE
#endif

#if defined(TPSERVE_PANEL_AVX512)
// AVX-512 (32 zmm): two panels at once (32 output features) in tiles of up to 12 rows: 12 x 2
// accumulators + 2 weight vectors + 1 broadcast = 27 zmm. Per k, 2 weight loads and 12 broadcasts
// feed 24 FMAs of 16 lanes (the 256-bit tile: 8 loads, 12 FMAs of 8 lanes), so the FMAs, not the
// loads, set the pace. The same [N/16, K, 16] panels: the packing, and whoever calls it, do not
// change. Unaligned loads: on these CPUs they cost nothing at an aligned address, and
// panel_pack_weight's copies start 64-byte aligned (torch's allocator; huge_pages.carve).
constexpr int kTileRows512 = 12;

// Weights as they sit in the panels: float32, or bf16 (as its bits) widened to float32 on load,
// exactly (a bf16 value is a float32 with the low 16 bits zero).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// Outputs: float32, or rounded once to bf16 (round to nearest even, as c10::BFloat16 does).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#if defined(TPSERVE_PANEL_BF16)
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// How a tile multiplies: FmaForm, float32 x against float32 panels or bf16 ones widened as they
// load, one k a step, FMAs; PairForm (below, AVX512-BF16), bf16 x against pair panels, one k-pair
// a step, vdpbf16ps. Each names the panel values a step reads (kStep) and the x values (kXStep),
// the weight load, the broadcast of a row's x and the multiply-add into a float32 accumulator.
struct FmaForm {
  static constexpr int64_t kStep = kPanel, kXStep = 1;
  template <typename W>
  static __m512 weights(const W* p) { return load16(p); }
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 mac(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

#define TPSERVE_ACC512_DECL(i) __m512 acc##i##a = _mm512_setzero_ps(), acc##i##b = _mm512_setzero_ps();
#define TPSERVE_ACC512_MAC(i)                                                  \
  if constexpr (R > i) {                                                     \
    const auto xv = Form::broadcast(x + i * x_stride + Form::kXStep * k);    \
    acc##i##a = Form::mac(acc##i##a, w0, xv);                                \
    if constexpr (P == 2) acc##i##b = Form::mac(acc##i##b, w1, xv);          \
  }
#define TPSERVE_ACC512_STORE(i)                                                                        \
  if constexpr (R > i) {                                                                               \
    store16(y + i * y_stride, _mm512_add_ps(acc##i##a, b0));                                           \
    if constexpr (P == 2) store16(y + i * y_stride + kPanel, _mm512_add_ps(acc##i##b, b1));            \
  }

// R x rows (x_stride apart) times P (1 or 2) panels (panel_size values apart, `steps` steps of
// Form::kStep values each) into y's 16 P columns (y_stride apart), plus bias (16 P values, or null).
// pf0, pf1: panels to prefetch into L2, one line of each per step, or null.
template <typename Form, int R, int P, typename X, typename W, typename Y>
void tile512(const X* x, int64_t x_stride, const W* panel, int64_t panel_size, int64_t steps, const float* bias,
             Y* y, int64_t y_stride, const W* pf0, const W* pf1) {
  TPSERVE_ACC512_DECL(0) TPSERVE_ACC512_DECL(1) TPSERVE_ACC512_DECL(2) TPSERVE_ACC512_DECL(3)
  TPSERVE_ACC512_DECL(4) TPSERVE_ACC512_DECL(5) TPSERVE_ACC512_DECL(6) TPSERVE_ACC512_DECL(7)
  TPSERVE_ACC512_DECL(8) TPSERVE_ACC512_DECL(9) TPSERVE_ACC512_DECL(10) TPSERVE_ACC512_DECL(11)
#pragma GCC unroll 2
  for (int64_t k = 0; k < steps; ++k) {
    if (pf0) _mm_prefetch(reinterpret_cast<const char*>(pf0 + k * Form::kStep), _MM_HINT_T1);
    if (pf1) _mm_prefetch(reinterpret_cast<const char*>(pf1 + k * Form::kStep), _MM_HINT_T1);
    const auto w0 = Form::weights(panel + k * Form::kStep);
    const auto w1 = P == 2 ? Form::weights(panel + panel_size + k * Form::kStep) : w0;
    TPSERVE_ACC512_MAC(0) TPSERVE_ACC512_MAC(1) TPSERVE_ACC512_MAC(2) TPSERVE_ACC512_MAC(3)
    TPSERVE_ACC512_MAC(4) TPSERVE_ACC512_MAC(5) TPSERVE_ACC512_MAC(6) TPSERVE_ACC512_MAC(7)
    TPSERVE_ACC512_MAC(8) TPSERVE_ACC512_MAC(9) TPSERVE_ACC512_MAC(10) TPSERVE_ACC512_MAC(11)
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias && P == 2 ? _mm512_loadu_ps(bias + kPanel) : _mm512_setzero_ps();
  TPSERVE_ACC512_STORE(0) TPSERVE_ACC512_STORE(1) TPSERVE_ACC512_STORE(2) TPSERVE_ACC512_STORE(3)
  TPSERVE_ACC512_STORE(4) TPSERVE_ACC512_STORE(5) TPSERVE_ACC512_STORE(6) TPSERVE_ACC512_STORE(7)
  TPSERVE_ACC512_STORE(8) TPSERVE_ACC512_STORE(9) TPSERVE_ACC512_STORE(10) TPSERVE_ACC512_STORE(11)
}
#undef TPSERVE_ACC512_DECL
#undef TPSERVE_ACC512_MAC
#undef TPSERVE_ACC512_STORE

#if defined(TPSERVE_PANEL_BF16)
// ---- Pair panels: bf16 x bf16 on vdpbf16ps ----
// The same panels of 16 output features, each k-pair's weights interleaved, [N/16, K/2, 16, 2]:
// one 64-byte line holds (W[16p + j][2i], W[16p + j][2i + 1]) for j = 0..15, and one vdpbf16ps
// multiplies it by a row's broadcast pair (x[2i], x[2i + 1]) and adds both products to the 16
// float32 sums. x is read as bf16 in place, never widened. Why: where vdpbf16ps issues at its
// full rate (AMD Zen 4: 64 FLOP a cycle per core, against 32 for 512-bit FMAs, which Zen 4 runs as
// two 256-bit halves; peak_probe there: 457 vs 231 GFLOP/s on 2 threads) it doubles the widened
// panels' compute bound, which sets their pace from 16 rows; on an Intel Xeon it issues at half
// its FMAs' FLOP rate (peak_probe: 238 vs 478), and the widened panels stay. linear.py times the
// two forms against each other at load. Sums: both products of a pair are exact in float32 and
// added to the accumulator in turn (the instruction's order), denormal inputs and results flushed
// to zero, then the bias, then one rounding to bf16: the widened panels' float32 sum in another
// order. The same tiles as FmaForm's: 12 x 2 accumulators + 2 weight vectors + the broadcast.
struct PairForm {
  static constexpr int64_t kStep = 2 * kPanel, kXStep = 2;
  static __m512bh weights(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh broadcast(const uint16_t* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 mac(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// The last tile of a panel's rows: `rest` (1 to kTileRows512 - 1) rows, a compile-time count each.
template <typename Form, int P, int R = kTileRows512 - 1, typename X, typename W, typename Y>
void tile512_rest(int64_t rest, const X* x, int64_t x_stride, const W* panel, int64_t panel_size, int64_t K,
                  const float* bias, Y* y, int64_t y_stride, const W* pf0, const W* pf1) {
  if constexpr (R > 0) {
    if (rest == R) return tile512<Form, R, P>(x, x_stride, panel, panel_size, K, bias, y, y_stride, pf0, pf1);
    tile512_rest<Form, P, R - 1>(rest, x, x_stride, panel, panel_size, K, bias, y, y_stride, pf0, pf1);
  }
}

// All M rows against P panels: full tiles of kTileRows512, then one tile of the rest. The first
// tile prefetches the next panels.
template <typename Form, int P, typename X, typename W, typename Y>
void panel_rows512(int64_t M, const X* x, int64_t x_stride, const W* panel, int64_t panel_size, int64_t K,
                   const float* bias, Y* y, int64_t y_stride, const W* pf0, const W* pf1) {
  int64_t m = 0;
  for (; m + kTileRows512 <= M; m += kTileRows512)
    tile512<Form, kTileRows512, P>(x + m * x_stride, x_stride, panel, panel_size, K, bias, y + m * y_stride,
                                         y_stride, m == 0 ? pf0 : nullptr, m == 0 ? pf1 : nullptr);
  if (m < M)
    tile512_rest<Form, P>(M - m, x + m * x_stride, x_stride, panel, panel_size, K, bias, y + m * y_stride, y_stride,
                           m == 0 ? pf0 : nullptr, m == 0 ? pf1 : nullptr);
}

// One task's panels [begin, end) for `rows` rows of x, two at a time (an odd last one alone).
template <typename Form = FmaForm, typename X, typename W, typename Y>
void task_panels(int64_t rows, const X* x, int64_t x_stride, const W* wp, int64_t panel_size, int64_t K,
                 const float* bias, Y* y, int64_t N, int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; p += 2) {
    const W* pf0 = p + 2 < end ? wp + (p + 2) * panel_size : nullptr;
    const W* pf1 = p + 3 < end ? wp + (p + 3) * panel_size : nullptr;
    const float* b = bias ? bias + p * kPanel : nullptr;
    if (p + 1 < end)
      panel_rows512<Form, 2>(rows, x, x_stride, wp + p * panel_size, panel_size, K, b, y + p * kPanel, N, pf0, pf1);
    else
      panel_rows512<Form, 1>(rows, x, x_stride, wp + p * panel_size, panel_size, K, b, y + p * kPanel, N, pf0, pf1);
  }
}

#endif

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "panel_linear: a float32 or bfloat16 weight [N, K]");
  TORCH_CHECK(weight.size(0) % kPanel == 0, "panel_linear: output features must be a multiple of ", kPanel,
              ", got ", weight.size(0));
}

template <typename T>
void pack_panels(const T* w, T* o, int64_t panels, int64_t K) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel; ++j) {
        const T* row = w + (p * kPanel + j) * K;
        T* dst = o + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) dst[k * kPanel] = row[k];
      }
  });
}

// W [N, K] bf16 -> pair panels [N/16, K/2, 32]: out[p][i][2j + e] = W[16p + j][2i + e].
void pack_pair_panels(const uint16_t* w, uint16_t* o, int64_t panels, int64_t K) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel; ++j) {
        const uint16_t* row = w + (p * kPanel + j) * K;
        uint16_t* dst = o + p * K * kPanel + 2 * j;
        for (int64_t i = 0; i < K / 2; ++i) {
          dst[i * 2 * kPanel] = row[2 * i];
          dst[i * 2 * kPanel + 1] = row[2 * i + 1];
        }
      }
  });
}

// W [N, K] -> [N/16, K, 16] of W's dtype: out[p][k][j] = W[16p + j][k]. Once per weight, at load.
// pairs (bf16, even K): pair panels [N/16, K/2, 32] for the vdpbf16ps tiles instead; the shape
// tells panel_linear which form it is given.
at::Tensor panel_pack_weight(const at::Tensor& weight_in, bool pairs) {
  check_weight(weight_in);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1), panels = N / kPanel;
  if (pairs) {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && K % 2 == 0,
                "panel_pack_weight: pair panels need a bfloat16 weight with an even K, got ", weight.scalar_type(),
                " with K = ", K);
    at::Tensor out = at::empty({panels, K / 2, 2 * kPanel}, weight.options());
    pack_pair_panels(reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                     reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), panels, K);
    return out;
  }
  at::Tensor out = at::empty({panels, K, kPanel}, weight.options());
  if (weight.scalar_type() == at::kFloat)
    pack_panels(weight.data_ptr<float>(), out.data_ptr<float>(), panels, K);
  else
    pack_panels(reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), panels, K);
  return out;
}

// Whether this build multiplies bf16 panels: AVX-512 with AVX512-BF16 (vcvtneps2bf16 for the one
// rounding of the float32 sums to bf16), or the 256-bit tiles of an AVX2 build (the rounding in
// integer ops). Not the avx512 build without AVX512-BF16, whose 512-bit tiles have neither.
bool panel_linear_bf16_available() {
#if defined(TPSERVE_PANEL_BF16) || (defined(TPSERVE_PANEL_AVX2) && !defined(TPSERVE_PANEL_AVX512))
  return true;
#else
  return false;
#endif
}

// y [M, N] = x W^T + bias. float32 x and panels: float32 y. bf16 x and panels (AVX512-BF16 builds):
// x widened to float32 once, the panels' weights widened as they load, float32 sums (the products
// of two bf16 values are exact in float32) plus the bias, rounded once to a bf16 y. bf16 x and pair
// panels ([N/16, K/2, 32]): the same sums on vdpbf16ps, x read as it is (PairForm).
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const bool pairs = bf16 && packed.dim() == 3 && packed.size(2) == 2 * kPanel;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kPanel || pairs) &&
                  (packed.scalar_type() == at::kFloat || bf16) && packed.is_contiguous(),
              "panel_linear: the weight as panel_pack_weight returns it, [N/16, K, 16] float32 or bfloat16, or "
              "[N/16, K/2, 32] bfloat16 pairs");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
              "panel_linear: the packed weight must start 32-byte aligned, as panel_pack_weight returns it");
  const int64_t packed_k = pairs ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == packed_k && x_in.scalar_type() == packed.scalar_type(),
              "panel_linear: x must be [M, K] with K = ", packed_k, " of the packed weight's dtype");
  TORCH_CHECK(!bf16 || panel_linear_bf16_available(),
              "panel_linear: bfloat16 needs a build with AVX512-BF16, or the avx2 build");
#if defined(TPSERVE_PANEL_AVX2)
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * kPanel;
  at::Tensor b;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias->scalar_type() == x_in.scalar_type() && b.numel() == N, "panel_linear: bias must be [N] of x's dtype");
    bias_ptr = b.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  // bf16 x: widened to float32 once (M x K, small next to the weights), except on pair panels of
  // an AVX512-BF16 build, whose vdpbf16ps reads it as it is; float32 x: read in place. Widened
  // into this thread's buffer by vec.h's load_row: at::Tensor::to's dispatch cost ~8 us a call, 1 ms
  // of a 1-request bf16 decode step's 13 on a 2-core Zen 3.
#if defined(TPSERVE_PANEL_BF16)
  const bool widen_x = bf16 && !pairs;
#else
  const bool widen_x = bf16;
#endif
  thread_local std::vector<float> widened;
  int64_t x_stride = x.stride(0);
  if (widen_x) {
    widened.resize(M * K);
    const auto* src = x.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < M; ++m) tpserve::load_row(src + m * x_stride, widened.data() + m * K, K);
    x_stride = K;
  }
  const float* xf = widen_x ? widened.data() : bf16 ? nullptr : x.data_ptr<float>();
  const int64_t panel_size = K * kPanel;
  // Each task owns whole panels and takes the rows in blocks of kRowBlock past all of them (from
  // kClaimRows rows: claims units of them from a counter); `k_steps`: the tiles' k loop count (K,
  // or K/2 pairs).
  auto run = [&](auto form, const auto* xp, const auto* wp, auto* yp, int64_t k_steps) {
    const int64_t threads = at::get_num_threads();
    if (M >= kClaimRows && threads > 1) {
      const int64_t chunk = std::max<int64_t>(2, (panels / (threads * kClaimsPerThread)) & ~int64_t{1});
      const int64_t per_block = (panels + chunk - 1) / chunk;
      const int64_t units = (M + kRowBlock - 1) / kRowBlock * per_block;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
          const int64_t m0 = u / per_block * kRowBlock, begin = u % per_block * chunk;
          task_panels<decltype(form)>(std::min(kRowBlock, M - m0), xp + m0 * x_stride, x_stride, wp, panel_size,
                                       k_steps, bias_ptr, yp + m0 * N, N, begin, std::min(panels, begin + chunk));
        }
      });
      return;
    }
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
        task_panels<decltype(form)>(rows, xp + m0 * x_stride, x_stride, wp, panel_size, k_steps, bias_ptr,
                                     yp + m0 * N, N, begin, end);
      }
    });
  };
#if defined(TPSERVE_PANEL_BF16) || !defined(TPSERVE_PANEL_AVX512)
  if (bf16) {
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
#if defined(TPSERVE_PANEL_BF16)
    const auto* pair_x = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
#else
    const float* pair_x = xf;
#endif
    if (pairs)
      run(PairForm{}, pair_x, wp, yp, K / 2);
    else
      run(FmaForm{}, xf, wp, yp, K);
    return y;
  }
#endif
  run(FmaForm{}, xf, packed.data_ptr<float>(), y.data_ptr<float>(), K);
  return y;
#else
  TORCH_CHECK(false, "panel_linear: built without AVX2 + FMA (panel_linear_available() is false)");
  return at::Tensor();
#endif
}

// Whether this build has the kernel (AVX2 + FMA), for float32.
bool panel_linear_available() {
#if defined(TPSERVE_PANEL_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("panel_pack_weight(Tensor weight, bool pairs=False) -> Tensor", &panel_pack_weight);
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &panel_linear);
  m.def("panel_linear_available() -> bool", &panel_linear_available);
  m.def("panel_linear_bf16_available() -> bool", &panel_linear_bf16_available);
}
