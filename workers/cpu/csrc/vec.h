// Vector helpers shared by tpserve's CPU kernels (cpu_ops.cpp, prefill_attention.cpp): dtype
// conversions with HF's roundings, 8- and 16-lane exp, loads and stores of float32/bf16 rows, and
// the walk from a block table to the rows of a context in the paged KV cache.
//
// torch's extension builder hashes the sources it compiles, not the headers they include:
// workers/cpu/kernels.py folds this file's content into the extension's name, so a change here
// rebuilds the library.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

// float32 and bfloat16, the dtypes a CPU model runs in.
#define TPSERVE_DISPATCH(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tpserve {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }  // BFloat16: round to nearest even

// x rounded to T and back: the rounding HF applies where it keeps an intermediate in T.
template <typename T>
inline float round_to(float x) { return to_f(from_f<T>(x)); }

#if defined(__AVX512F__)


// exp on 16 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, then
// scaled by 2^n (scalef). Relative error ~2e-7 (about 2 ulp of fp32), below bf16's and within
// the fp32 tests' tolerance.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// x rounded to T and back, 16 lanes (round_to's vector form; bf16 needs AVX512-BF16).
inline __m512 round_vec(__m512 x, float*) { return x; }
#if defined(__AVX512BF16__)
inline __m512 round_vec(__m512 x, c10::BFloat16*) {
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}
#endif
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
#endif  // __AVX512F__

// The 8-lane (AVX2 + FMA) forms of the helpers above, for CPUs without AVX-512 (AMD Zen 1-3,
// Intel client parts): the same math and the same roundings, half the lanes. Measured on a 2-core
// AMD EPYC (Zen 1), float32, the default model's decode step at 16 x 300-token contexts: attention
// 1.67 -> 0.80 ms per layer, SiLU gate 290 -> 54 us (the portable loops ran before).
#if defined(__AVX2__) && defined(__FMA__)
#define TPSERVE_AVX2 1

// exp on 8 floats: exp512's reduction and polynomial; 2^n is built from its exponent bits, so x
// is clamped to [-87, 88] (n stays a normal exponent; e^-87 ~ 1.6e-38 is 0 to any softmax or SiLU).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The bf16 bits of 8 floats (low half of each lane), rounded as c10::BFloat16 rounds: to nearest
// even, NaN to 0x7FC0 (AVX2 has no bf16 convert).
inline __m256i bf16_bits(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

// x rounded to T and back, 8 lanes (round_to's vector form).
inline __m256 round_vec8(__m256 x, float*) { return x; }
inline __m256 round_vec8(__m256 x, c10::BFloat16*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  // 32 -> 16 bits per lane: packus works within 128-bit halves, the permute joins them.
  const __m256i bits = bf16_bits(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// acc + p * m[0..8), the 8 floats at m read by the FMA itself (a memory operand: no register).
inline __m256 fmadd_mem(__m256 acc, __m256 p, const float* m) {
  asm("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(p), "m"(*reinterpret_cast<const __m256_u*>(m)));
  return acc;
}

// The totals of eight vectors as the eight lanes of one __m256.
inline __m256 reduce8_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif  // __AVX2__ && __FMA__

// n values of a float32 or bf16 row as float32 (exact), 8 lanes at a time where AVX2 is built:
// panel_linear widens each prefill chunk's bf16 x through it (512 rows x 1,536 a call).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(TPSERVE_AVX2)
  for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

// Element strides of a paged KV cache indexed [block, token in block, KV head, dim]: any layout
// whose head rows are contiguous. On CPU the caches are head-major in memory ([block][head][token]
// under a permuted view, workers/runner/kv_cache.py), so the kernels take strides rather than assume the
// token-major shape.
struct CacheStrides {
  // Elements between blocks, tokens of a block, KV heads of a token.
  int64_t block, token, head;
};

inline CacheStrides cache_strides(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "caches: [num_blocks, block_size, KVH, D], rows contiguous");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "the K and V caches must share a shape and a layout");
  return {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
}

// Element offset, within a cache, of head h's row for every context token in [start, len), walked
// block by block: a division per token (t / block_size) costs more than the token's FMAs (a 64-bit
// idiv takes 14-46 cycles on Zen 1, and the kernels below needed one or more per token per pass).
template <typename Index>
inline void context_rows(std::vector<int64_t>& rows, const Index* table, int64_t start, int64_t len, int64_t block_size,
                         const CacheStrides& s, int64_t h) {
  const int64_t n = len - start;
  rows.resize(n);
  int64_t i = 0, off = start % block_size;
  for (int64_t blk = start / block_size; i < n; ++blk, off = 0) {
    const int64_t base = static_cast<int64_t>(table[blk]) * s.block + h * s.head;
    for (; off < block_size && i < n; ++off, ++i) rows[i] = base + off * s.token;
  }
}

}  // namespace tpserve
