// tpserve's CPU kernels (issue 11, lever 5): the decode-step ops that eager torch runs as many
// small calls, each one call here. Loaded by workers/cpu/kernels.py (built once per machine with
// -march=native; torch's own OpenMP team runs the parallel loops).
//
// Numerics follow Hugging Face transformers' eager modules op by op: every intermediate that HF
// keeps in the model dtype is rounded to it here too (round_to), so bf16 results match the
// reference's roundings, not just its math. Float math is in fp32 throughout.
//
//   rms_norm            Llama: w * bf16(x * rsqrt(mean(x^2) + eps)); Gemma (offset 1): (1 + w) * ..., one rounding
//   add_rms_norm        residual = x + y (rounded), then rms_norm(residual): one call for both
//   silu_and_mul        bf16(silu(gate)) * up, gate/up the two halves of one projection
//   rotary_             q, k rotated in place (rotate-half layout, cos/sin rows by position)
//   reshape_and_cache   this step's K/V written into their slots of the paged caches
//   paged_decode_attention  one query token per request against its context read from the KV
//                       blocks in place (no gather, no padding); GQA heads share each K/V row read;
//                       optional sliding window and logit soft cap; with fewer (request, KV head)
//                       items than two a thread, each context cut into parts and merged

#include <atomic>

#include "vec.h"

namespace {

using namespace tpserve;

// Rows per parallel task: small batches stay on the calling thread (an OpenMP fork costs more
// than normalizing a few rows).
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t n, double eps,
                   double offset) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;  // the portable path's widened row (the vector paths need none)
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * n;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if (n % 16 == 0) {
        __m512 ssv = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 xv = load16(xr + i);
          ssv = _mm512_fmadd_ps(xv, xv, ssv);
        }
        const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ssv) / static_cast<float>(n) + static_cast<float>(eps));
        const __m512 invv = _mm512_set1_ps(inv), off = _mm512_set1_ps(static_cast<float>(offset));
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 normed = _mm512_mul_ps(load16(xr + i), invv);
          store16(o + i, offset == 0.0 ? _mm512_mul_ps(load16(w + i), round_vec(normed, static_cast<T*>(nullptr)))
                                       : _mm512_mul_ps(normed, _mm512_add_ps(off, load16(w + i))));
        }
        continue;
      }
#elif defined(TPSERVE_AVX2)
      if (n % 8 == 0) {
        __m256 ssv = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
          const __m256 xv = load8(xr + i);
          ssv = _mm256_fmadd_ps(xv, xv, ssv);
        }
        const float inv = 1.f / std::sqrt(hsum8(ssv) / static_cast<float>(n) + static_cast<float>(eps));
        const __m256 invv = _mm256_set1_ps(inv), off = _mm256_set1_ps(static_cast<float>(offset));
        for (int64_t i = 0; i < n; i += 8) {
          const __m256 normed = _mm256_mul_ps(load8(xr + i), invv);
          store8(o + i, offset == 0.0 ? _mm256_mul_ps(load8(w + i), round_vec8(normed, static_cast<T*>(nullptr)))
                                      : _mm256_mul_ps(normed, _mm256_add_ps(off, load8(w + i))));
        }
        continue;
      }
#endif
      buf.resize(n);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        buf[i] = to_f(xr[i]);
        ss += buf[i] * buf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      if (offset == 0.0) {
        // Llama: the normalized row is cast to the model dtype, then scaled by the weight.
        for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(buf[i] * inv));
      } else {
        // Gemma: scaled by (offset + w) in fp32, one cast at the end.
        const float off = static_cast<float>(offset);
        for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(buf[i] * inv * (off + to_f(w[i])));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  TPSERVE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps, offset);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                                double eps, double offset) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type());
  auto residual = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  TPSERVE_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * x.stride(0);
        const scalar_t* yr = yp + r * y.stride(0);
        scalar_t* rr = rp + r * n;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; i + 16 <= n; i += 16) store16(rr + i, _mm512_add_ps(load16(xr + i), load16(yr + i)));
#elif defined(TPSERVE_AVX2)
        for (; i + 8 <= n; i += 8) store8(rr + i, _mm256_add_ps(load8(xr + i), load8(yr + i)));
#endif
        for (; i < n; ++i) rr[i] = from_f<scalar_t>(to_f(xr[i]) + to_f(yr[i]));
      }
    });
  });
  return {residual, rms_norm(residual, weight, eps, offset)};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: the gate and up halves must be the same width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  TPSERVE_DISPATCH(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * gate_up.stride(0);
        const scalar_t* u = g + n;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; i + 16 <= n; i += 16) {
          const __m512 gf = load16(g + i);
          const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gf)));
          const __m512 act = round_vec(_mm512_div_ps(gf, denom), static_cast<scalar_t*>(nullptr));
          store16(o + r * n + i, _mm512_mul_ps(act, load16(u + i)));
        }
#elif defined(TPSERVE_AVX2)
        for (; i + 8 <= n; i += 8) {
          const __m256 gf = load8(g + i);
          const __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gf)));
          const __m256 act = round_vec8(_mm256_div_ps(gf, denom), static_cast<scalar_t*>(nullptr));
          store8(o + r * n + i, _mm256_mul_ps(act, load8(u + i)));
        }
#endif
        for (; i < n; ++i) {
          const float gf = to_f(g[i]);
          const float act = round_to<scalar_t>(gf / (1.f + std::exp(-gf)));
          o[r * n + i] = from_f<scalar_t>(act * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

// One head row [D] rotated in place; cos/sin rows [D] in the model dtype (as HF builds them).
template <typename T>
inline void rotate_row(T* x, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  T* const tag = nullptr;
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
    const __m512 lo = _mm512_add_ps(round_vec(_mm512_mul_ps(x1, load16(c + i)), tag),
                                    round_vec(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(s + i)), tag));
    const __m512 hi = _mm512_add_ps(round_vec(_mm512_mul_ps(x2, load16(c + i + half)), tag),
                                    round_vec(_mm512_mul_ps(x1, load16(s + i + half)), tag));
    store16(x + i, lo);
    store16(x + i + half, hi);
  }
#elif defined(TPSERVE_AVX2)
  T* const tag = nullptr;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
    const __m256 lo = _mm256_add_ps(round_vec8(_mm256_mul_ps(x1, load8(c + i)), tag),
                                    round_vec8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), load8(s + i)), tag));
    const __m256 hi = _mm256_add_ps(round_vec8(_mm256_mul_ps(x2, load8(c + i + half)), tag),
                                    round_vec8(_mm256_mul_ps(x1, load8(s + i + half)), tag));
    store8(x + i, lo);
    store8(x + i + half, hi);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    // q * cos + rotate_half(q) * sin, each product and the sum rounded as HF's eager ops round them.
    const float lo = round_to<T>(x1 * to_f(c[i])) + round_to<T>(-x2 * to_f(s[i]));
    const float hi = round_to<T>(x2 * to_f(c[i + half])) + round_to<T>(x1 * to_f(s[i + half]));
    x[i] = from_f<T>(lo);
    x[i + half] = from_f<T>(hi);
  }
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: [T, heads, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && positions.scalar_type() == at::kLong);
  const int64_t tokens = q.size(0), d = q.size(2), half = d / 2;
  TORCH_CHECK(positions.numel() == tokens && cos.size(1) == d && sin.sizes() == cos.sizes(), "rotary_: shapes");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position beyond the rotary table");
  TPSERVE_DISPATCH(q.scalar_type(), "rotary_", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + pos[t] * d;
        const scalar_t* s = sp + pos[t] * d;
        for (int64_t h = 0; h < q.size(1); ++h) rotate_row(qp + t * q.stride(0) + h * q.stride(1), c, s, half);
        for (int64_t h = 0; h < k.size(1); ++h) rotate_row(kp + t * k.stride(0) + h * k.stride(1), c, s, half);
      }
    });
  });
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0));
  const CacheStrides cs = cache_strides(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "k, v: [T, KVH, D] of the cache's heads");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == v.scalar_type());
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const size_t bytes = d * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot out of range");
    const int64_t base = (slots[t] / block_size) * cs.block + (slots[t] % block_size) * cs.token;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (base + h * cs.head) * es, kp + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
      std::memcpy(vc + (base + h * cs.head) * es, vp + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
    }
  }
}

// One (request, KV head): its G query heads against context [start, len) read through the block
// table (rows: context_rows). Scores are kept for the whole context (two passes: exact softmax,
// then the weighted V sum). out: T (the op's output) or float (one part of a split context);
// stats, for a part: [2][G], each head's largest score, then its sum of exp(score - largest).
template <typename T, typename O>
void decode_one(O* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t len,
                int64_t start, int64_t group, int64_t d, float scale, float soft_cap, std::vector<float>& scores,
                std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& row, float* stats) {
  const int64_t n = len - start;
  scores.resize(group * n);
  for (int64_t g = 0; g < group; ++g) load_row(q + g * d, qf.data() + g * d, d);
  for (int64_t t = start; t < len; ++t) {
    load_row(k_cache + rows[t - start], row.data(), d);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qg[i] * row[i];
      float s = dot * scale;
      if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
      scores[g * n + (t - start)] = s;
    }
  }
  std::fill(acc.begin(), acc.begin() + group * d, 0.f);
  std::vector<float> sums(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    const float mx = *std::max_element(sg, sg + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - mx);
      sum += sg[i];
    }
    sums[g] = sum;
    if (stats) stats[g] = mx, stats[group + g] = sum;
  }
  for (int64_t t = start; t < len; ++t) {
    load_row(v_cache + rows[t - start], row.data(), d);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + (t - start)];
      float* ag = acc.data() + g * d;
      for (int64_t i = 0; i < d; ++i) ag[i] += p * row[i];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / sums[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = from_f<O>(acc[g * d + i] * inv);
  }
}


// The rows a thread's next item (the next request or KV head it takes) reads first: its K rows,
// as context_rows gives them (count of them; none: count 0).
struct NextItemRows {
  const int64_t* rows = nullptr;
  int64_t count = 0;
};

#if defined(__AVX512F__) || defined(TPSERVE_AVX2)
// How many tokens ahead the decode attention prefetches K/V rows (a block's rows are contiguous,
// the next block may be anywhere: the hardware prefetcher cannot guess it). Measured with 30
// layers of cold caches, 64 x 300-token contexts, bf16: none 1.63, 8 ahead 1.24, 16 1.07,
// 32 0.98, 64 1.04 ms per layer (15.0 GB/s at 32; a plain sum reads ~16.5 GB/s here).
constexpr int64_t kPrefetchAhead = 32;
// ... and this many ahead into L2 as well (the same rows twice: into L2 early, into L1 late).
// Measured with the same 30 cold layers (bench.kernels.decode_attention_kernel, bf16, 2-core Xeon,
// builds alternated): 64 x 450 tokens 35.4 -> 33.2 ms (96-192 ahead alike), 16 x 1,000 19.5 ->
// 18.3. Either prefetch alone, at any distance or hint, had been tried without a gain.
constexpr int64_t kPrefetchL2Ahead = 128;

// Every cache line of one row (d elements) into the cache level `Hint` names (_MM_HINT_T0: L1,
// _MM_HINT_T1: L2; the hint's type is GCC's enum, an int elsewhere). always_inline: GCC 12 counts
// a prefetch as no side effect, so a helper it did not inline early was found pure and its calls
// deleted (none of these prefetches reached the object file).
template <decltype(_MM_HINT_T0) Hint, typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(p + off, Hint);
}

// The rows of `count` tokens from t + kPrefetchAhead into L1 and from t + kPrefetchL2Ahead into
// L2 (none at or past len); row_at(i) is token i's row.
template <typename RowAt>
__attribute__((always_inline)) inline void prefetch_ahead(const RowAt& row_at, int64_t t, int64_t count, int64_t len, int64_t d) {
  for (int64_t i = t + kPrefetchAhead; i < std::min(t + kPrefetchAhead + count, len); ++i)
    prefetch_row<_MM_HINT_T0>(row_at(i), d);
  for (int64_t i = t + kPrefetchL2Ahead; i < std::min(t + kPrefetchL2Ahead + count, len); ++i)
    prefetch_row<_MM_HINT_T1>(row_at(i), d);
}

// While the scores of this context's tokens [i, i + count) (offsets into rows) are computed, into
// L2: their V rows, which the weighted V sum reads once the scores are done, and the next item's K
// rows at the same offsets, which its scores read first. Without these, each context's V pass and
// each next context's first scores started on rows that nobody had asked memory for. Measured on
// a 2-core AMD EPYC Zen 4 (bench.kernels.decode_attention_kernel's 30 cold layers, default model
// heads, builds alternated in one process, medians of 11-15), without -> with:
//   avx512_bf16 build, bf16: 64 x 450 tokens 29.9 -> 26.2 ms, 16 x 1,000 14.6 -> 12.3;
//   avx512_bf16 build, float32: 64 x 450 66.2 -> 50.0;
//   avx2 build, 64 x 450: float32 84.5 -> 64.5, bf16 42.1 -> 34.4.
// (On a Zen 3, V during the scores alone had not helped the avx2 build; not re-measured there.)
template <typename T>
__attribute__((always_inline)) inline void prefetch_later(const T* k_cache, const T* v_cache, const int64_t* rows,
                                                          const NextItemRows& next, int64_t i, int64_t count,
                                                          int64_t d) {
  for (int64_t j = i; j < i + count; ++j) prefetch_row<_MM_HINT_T1>(v_cache + rows[j], d);
  for (int64_t j = i; j < std::min(i + count, next.count); ++j) prefetch_row<_MM_HINT_T1>(k_cache + next.rows[j], d);
}

#endif

#if defined(__AVX512F__)
// decode_one for AVX-512, head_dim = 16 * NV and G query heads per KV head, both compile-time so
// that the accumulators and query vectors are zmm registers (32 of them), as in the AVX2 path below:
// - float32 scores: 16 tokens per step, one query head at a time: 16 accumulators (one per token),
//   the head's query vector loaded once per 16 FMAs, the key rows re-read from L1 for each head;
//   one 16-way transpose-reduction per head gives 16 scores.
// - bf16 scores (AVX512-BF16): 4 tokens per step, their key rows in registers for all G heads.
// - Weighted V sum: the head is walked in slices of SV vectors, all tokens per slice, with G x SV
//   accumulators, the G probabilities broadcast once per token and one value vector at a time.
//   bf16 with AVX512-BF16: two tokens a step on vdpbf16ps instead (weighted_values_bf16).
// - While the scores run, the V rows they will weigh and the next item's K rows are asked for
//   (prefetch_later).
// The form before (a runtime group size, and for float32 a full horizontal reduction per score),
// alternated with this one in one process over 30 cold layers (default model's heads, head-major
// 16-token blocks), one thread's CPU time (the 2-core Xeon was shared), medians of 7:
// float32 64 x 450 tokens 137.6 -> 119.3 ms (11.3 GB/s of K/V; a plain sum of the same bytes on
// that thread: 15.2 GB/s), 16 x 1,000 75.1 -> 63.8 ms; bf16 unchanged (69.9 -> 69.7 ms, 9.6 GB/s
// against 16.1). Prefetching 64, 128 or 256 tokens ahead instead of 32: the same or slower.

// The totals of sixteen vectors as the sixteen lanes of one __m512 (lane i: a[i]'s total): 30
// shuffles and 15 adds for 16 dot products, where a horizontal reduction each costs 64 of each.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], e[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // within 128-bit lanes: pairs of elements, per vector pair
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // within 128-bit lanes: element j holds a[4i + j]'s lane total
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes: pairs of lanes
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head's scores against 16 key rows (row(i): token i's row) in fp32 (float32 caches,
// and bf16 ones without AVX512-BF16), the query scaled: 16 accumulators, the query's vector
// loaded once per 16 FMAs, one transpose-reduction.
template <typename T, int NV, typename Row>
inline __m512 scores16(const float* qg, Row row) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) {
    const __m512 qj = _mm512_load_ps(qg + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(qj, load16(row(i) + 16 * j), a[i]);
  }
  return reduce16(a);
}

// Scores [G][padded] of G scaled fp32 query heads (qs: [G][d]) against context tokens [start, len).
// 16 tokens whose rows follow each other d elements apart (a 16-token block of a head-major
// cache) are addressed from one pointer: the FMAs take them at constant offsets. 16 scattered
// pointers would not fit the 16 general registers: each FMA then waits on reloading its pointer.
template <typename T, int NV, int G>
void qk_scores_avx512(float* scores, int64_t padded, const float* qs, const T* k_cache, const T* v_cache,
                      const int64_t* rows, int64_t start, int64_t len, const NextItemRows& next) {
  constexpr int64_t d = 16 * NV;
  auto key_row = [&](int64_t t) { return k_cache + rows[t - start]; };
  int64_t t = start;
  for (; t + 16 <= len; t += 16) {
    // Rows of the blocks ahead are scattered: ask for them before they are needed.
    prefetch_ahead(key_row, t, 16, len, d);
    prefetch_later(k_cache, v_cache, rows, next, t - start, 16, d);
    const int64_t* r = rows + (t - start);
    bool contiguous = true;
    for (int i = 1; i < 16; ++i) contiguous &= r[i] == r[0] + i * d;
    const T* k0 = k_cache + r[0];
    for (int g = 0; g < G; ++g) {
      const __m512 s = contiguous ? scores16<T, NV>(qs + g * d, [&](int i) { return k0 + i * d; })
                                  : scores16<T, NV>(qs + g * d, [&](int i) { return k_cache + r[i]; });
      _mm512_storeu_ps(scores + g * padded + (t - start), s);
    }
  }
  for (; t < len; ++t) {
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int j = 0; j < NV; ++j) a = _mm512_fmadd_ps(_mm512_load_ps(qs + g * d + 16 * j), load16(key_row(t) + 16 * j), a);
      scores[g * padded + (t - start)] = _mm512_reduce_add_ps(a);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
// The totals of four vectors as the four lanes of one __m128: three shuffle-adds for four dot
// products instead of a full horizontal reduction each.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// bf16 query . key scores with AVX512-BF16 dot products (pairs of bf16 products summed in fp32,
// as exact as converting both to fp32 first), four tokens per step: their key rows loaded into
// registers once for all G heads (whose query vectors stay in registers), one reduce4 per head.
// NP = head_dim / 32. The 16-token form of the fp32 scores, tried here too, ran 7-8% slower over
// the whole kernel (30 cold layers, 64 x 450 and 16 x 1,000 tokens).
template <int NP, int G>
void qk_scores_bf16(float* scores, int64_t padded, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                    const c10::BFloat16* v_cache, const int64_t* rows, int64_t start, int64_t len, float scale,
                    const NextItemRows& next) {
  constexpr int64_t d = 32 * NP;
  __m512bh qv[G][NP];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NP; ++j) qv[g][j] = (__m512bh)_mm512_loadu_si512(q + g * d + 32 * j);
  const __m128 sc = _mm_set1_ps(scale);
  auto key_row = [&](int64_t t) { return k_cache + rows[t - start]; };
  int64_t t = start;
  for (; t + 4 <= len; t += 4) {
    prefetch_ahead(key_row, t, 4, len, d);
    prefetch_later(k_cache, v_cache, rows, next, t - start, 4, d);
    __m512bh kv[4][NP];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < NP; ++j) kv[i][j] = (__m512bh)_mm512_loadu_si512(key_row(t + i) + 32 * j);
    for (int g = 0; g < G; ++g) {
      __m512 acc[4];
      for (int i = 0; i < 4; ++i) {
        acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[i][0]);
        for (int j = 1; j < NP; ++j) acc[i] = _mm512_dpbf16_ps(acc[i], qv[g][j], kv[i][j]);
      }
      _mm_storeu_ps(scores + g * padded + (t - start), _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), sc));
    }
  }
  for (; t < len; ++t) {
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < NP; ++j)
        acc = _mm512_dpbf16_ps(acc, qv[g][j], (__m512bh)_mm512_loadu_si512(key_row(t) + 32 * j));
      scores[g * padded + (t - start)] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}
#endif

// Scores [group][padded] (n real, the rest padding) -> exp(score - max) in place (after the soft
// cap, if any); inv_sum[g]: 1 / head g's sum; max_out (or null): each head's max.
inline void softmax_avx512(float* scores, int64_t padded, int64_t n, int group, float soft_cap, float* inv_sum,
                           float* max_out) {
  for (int g = 0; g < group; ++g) {
    float* sg = scores + g * padded;
    if (soft_cap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = soft_cap * std::tanh(sg[i] / soft_cap);
    for (int64_t i = n; i < padded; ++i) sg[i] = -INFINITY;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < padded; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + i));
    const float largest = _mm512_reduce_max_ps(mx);
    if (max_out) max_out[g] = largest;
    const __m512 m = _mm512_set1_ps(largest);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + i), m));
      _mm512_storeu_ps(sg + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// Value vectors per slice of the weighted V sum: the most (a divisor of NV) whose G x SV
// accumulators, G broadcast probabilities and one value vector fit the 32 zmm registers.
template <int NV, int G>
constexpr int value_slice_avx512() {
  int sv = NV;
  while (sv > 1 && G * sv + G + 1 > 32) sv /= 2;
  return sv;
}

// out[g] = inv_sum[g] * sum_t p[g][t] V[t] for G heads over context tokens [start, len).
template <typename T, int NV, int G, typename O>
void weighted_values_avx512(O* out, const float* scores, int64_t padded, const float* inv_sum, const T* v_cache,
                            const int64_t* rows, int64_t start, int64_t len) {
  constexpr int64_t d = 16 * NV;
  constexpr int SV = value_slice_avx512<NV, G>();
  static_assert(NV % SV == 0, "slices must tile the head");
  for (int c = 0; c < NV; c += SV) {
    __m512 acc[G][SV];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int x = 0; x < SV; ++x) acc[g][x] = _mm512_setzero_ps();
    for (int64_t t = start; t < len; ++t) {
      // The first slice reads the rows from memory; the others find them in L2.
      if (c == 0) prefetch_ahead([&](int64_t i) { return v_cache + rows[i - start]; }, t, 1, len, d);
      const T* vr = v_cache + rows[t - start] + 16 * c;
      __m512 p[G];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[g * padded + (t - start)]);
#pragma GCC unroll 16
      for (int x = 0; x < SV; ++x) {
        const __m512 v = load16(vr + 16 * x);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) acc[g][x] = _mm512_fmadd_ps(p[g], v, acc[g][x]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      alignas(64) float row[16 * SV];
#pragma GCC unroll 16
      for (int x = 0; x < SV; ++x) _mm512_store_ps(row + 16 * x, _mm512_mul_ps(acc[g][x], _mm512_set1_ps(inv_sum[g])));
      // from_f: c10's rounding of the fp32 result, as the portable path rounds it.
      for (int i = 0; i < 16 * SV; ++i) out[g * d + 16 * c + i] = from_f<O>(row[i]);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
// 32-dim chunks per slice of the bf16 weighted V sum: the most (a divisor of NP) whose G x 2 SP
// accumulators, 2 SP interleaved value vectors and G broadcast pairs fit the 32 zmm registers.
template <int NP, int G>
constexpr int value_pair_slice() {
  int sp = NP;
  while (sp > 1 && 2 * G * sp + 2 * sp + G > 32) sp /= 2;
  return sp;
}

// The bf16 weighted V sum on vdpbf16ps: out[g] = inv_sum[g] * sum_t p[g][t] V[t], two tokens a
// step. Their value rows are interleaved in registers (vpunpck{l,h}wd: the pairs (V[t][i],
// V[t+1][i])), and each head's probability pair (p[t], p[t+1]), rounded to bf16, is broadcast to
// them: one vdpbf16ps adds both tokens' products for 16 dims. The fp32 form takes per token G x NV
// FMAs and NV widenings of a bf16 vector to fp32; this one half as many multiply instructions and
// a quarter of the shuffles. probs: [G][padded] bf16, zeros past the context (an odd last token
// is paired with a zero row). Rounding the probabilities to bf16 before they weigh V is what
// FlashAttention and SGLang's CPU decode kernel do; the sum and its normalization stay fp32.
// Against the fp32 form (prefetch_later's measurement): 64 x 450 tokens 30.9 -> 29.9 ms from
// memory, 16 x 1,000 16.9 -> 14.6; with one layer's caches hot in L3 (30 calls) 13.7 -> 10.7 ms,
// so the arithmetic shrank more than the time from memory shows.
template <int NP, int G, typename O>
void weighted_values_bf16(O* out, const uint16_t* probs, int64_t padded, const float* inv_sum,
                          const c10::BFloat16* v_cache, const int64_t* rows, int64_t start, int64_t len) {
  constexpr int64_t d = 32 * NP;
  constexpr int SP = value_pair_slice<NP, G>();
  static_assert(NP % SP == 0, "slices must tile the head");
  // Lane j of a lo accumulator holds dim 8 (j / 4) + j % 4 of its 32, of a hi one dim 8 (j / 4) + 4 + j % 4
  // (vpunpck works within 128-bit lanes): these pick dims 0-15 and 16-31 back out of the two.
  const __m512i dims_low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i dims_high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < NP; c += SP) {
    __m512 acc[G][2 * SP];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int x = 0; x < 2 * SP; ++x) acc[g][x] = _mm512_setzero_ps();
    // Tokens i and i + 1 of the context (offsets into rows and probs; r1 null: no second token).
    auto two_tokens = [&](const c10::BFloat16* r0, const c10::BFloat16* r1, int64_t i) {
      __m512i lo[SP], hi[SP];
#pragma GCC unroll 16
      for (int x = 0; x < SP; ++x) {
        const __m512i a = _mm512_loadu_si512(r0 + 32 * (c + x));
        const __m512i b = r1 ? _mm512_loadu_si512(r1 + 32 * (c + x)) : _mm512_setzero_si512();
        lo[x] = _mm512_unpacklo_epi16(a, b);
        hi[x] = _mm512_unpackhi_epi16(a, b);
      }
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, probs + g * padded + i, sizeof(pair));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 16
        for (int x = 0; x < SP; ++x) {
          acc[g][2 * x] = _mm512_dpbf16_ps(acc[g][2 * x], (__m512bh)lo[x], p);
          acc[g][2 * x + 1] = _mm512_dpbf16_ps(acc[g][2 * x + 1], (__m512bh)hi[x], p);
        }
      }
    };
    int64_t t = start;
    for (; t + 2 <= len; t += 2) {
      // The first slice reads the rows from memory; the others find them in L2.
      if (c == 0) prefetch_ahead([&](int64_t i) { return v_cache + rows[i - start]; }, t, 2, len, d);
      two_tokens(v_cache + rows[t - start], v_cache + rows[t + 1 - start], t - start);
    }
    if (t < len) two_tokens(v_cache + rows[t - start], nullptr, t - start);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      alignas(64) float row[32 * SP];
      const __m512 inv = _mm512_set1_ps(inv_sum[g]);
#pragma GCC unroll 16
      for (int x = 0; x < SP; ++x) {
        const __m512 lo = acc[g][2 * x], hi = acc[g][2 * x + 1];
        _mm512_store_ps(row + 32 * x, _mm512_mul_ps(_mm512_permutex2var_ps(lo, dims_low, hi), inv));
        _mm512_store_ps(row + 32 * x + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, dims_high, hi), inv));
      }
      // from_f: c10's rounding of the fp32 result, as the portable path rounds it.
      for (int i = 0; i < 32 * SP; ++i) out[g * d + 32 * c + i] = from_f<O>(row[i]);
    }
  }
}
#endif

template <typename T, int NV, int G, typename O>
void decode_one_avx512(O* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t len,
                       int64_t start, float scale, float soft_cap, std::vector<float>& scores,
                       std::vector<uint16_t>& probs, const NextItemRows& next, float* stats) {
  constexpr int64_t d = 16 * NV;
  const int64_t n = len - start;
  const int64_t padded = (n + 15) / 16 * 16;
  scores.resize(G * padded);
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    qk_scores_bf16<NV / 2, G>(scores.data(), padded, q, k_cache, v_cache, rows, start, len, scale, next);
  } else
#endif
  {
    alignas(64) float qs[G * d];
    for (int64_t i = 0; i < G * d; i += 16) _mm512_store_ps(qs + i, _mm512_mul_ps(load16(q + i), _mm512_set1_ps(scale)));
    qk_scores_avx512<T, NV, G>(scores.data(), padded, qs, k_cache, v_cache, rows, start, len, next);
  }
  float inv_sum[G];
  softmax_avx512(scores.data(), padded, n, G, soft_cap, inv_sum, stats);
  if (stats)
    for (int g = 0; g < G; ++g) stats[G + g] = 1.f / inv_sum[g];
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    probs.resize(G * padded);
    for (int64_t i = 0; i < G * padded; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + i),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(scores.data() + i))));
    weighted_values_bf16<NV / 2, G>(out, probs.data(), padded, inv_sum, v_cache, rows, start, len);
    return;
  }
#endif
  weighted_values_avx512<T, NV, G>(out, scores.data(), padded, inv_sum, v_cache, rows, start, len);
}

// The G (query heads per KV head, 1-8) and head_dim (64, 128, 256) decode_one_avx512 is built
// for; false: not one (the portable path takes it).
template <typename T, typename O>
bool decode_one_avx512_dispatch(O* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* rows,
                                int64_t len, int64_t start, int64_t group, int64_t d, float scale, float soft_cap,
                                std::vector<float>& scores, std::vector<uint16_t>& probs, const NextItemRows& next,
                                float* stats) {
#define TPSERVE_DECODE_AVX512(NV, G)                                                                                  \
  case G:                                                                                                           \
    decode_one_avx512<T, NV, G>(out, q, k_cache, v_cache, rows, len, start, scale, soft_cap, scores, probs, next, \
                                stats);                                                                         \
    return true;
#define TPSERVE_DECODE_AVX512_GROUPS(NV) \
  switch (group) {                       \
    TPSERVE_DECODE_AVX512(NV, 1)         \
    TPSERVE_DECODE_AVX512(NV, 2)         \
    TPSERVE_DECODE_AVX512(NV, 3)         \
    TPSERVE_DECODE_AVX512(NV, 4)         \
    TPSERVE_DECODE_AVX512(NV, 5)         \
    TPSERVE_DECODE_AVX512(NV, 6)         \
    TPSERVE_DECODE_AVX512(NV, 7)         \
    TPSERVE_DECODE_AVX512(NV, 8)         \
    default:                             \
      return false;                      \
  }
  if (d == 64) TPSERVE_DECODE_AVX512_GROUPS(4)
  if (d == 128) TPSERVE_DECODE_AVX512_GROUPS(8)
  if (d == 256) TPSERVE_DECODE_AVX512_GROUPS(16)
#undef TPSERVE_DECODE_AVX512_GROUPS
#undef TPSERVE_DECODE_AVX512
  return false;
}
#endif  // __AVX512F__

#if defined(TPSERVE_AVX2) && !defined(__AVX512F__)
// Tokens per step of shared_key_scores: the most (8, 4, 2 or 1) whose TB x G accumulators fit 12
// of the 16 ymm (one more holds the key vector; the query vectors are memory operands).
template <int G>
constexpr int shared_key_tokens() {
  return G * 8 <= 12 ? 8 : (G * 4 <= 12 ? 4 : (G * 2 <= 12 ? 2 : 1));
}

// decode_one_avx2's scores, [start, len) by steps of TB tokens (what is left, fewer than TB, is
// the caller's): each key vector is loaded and widened once and multiplied into all G heads' sums,
// the query vectors read by the FMAs from L1 (scaled, qs). Why: the kernel is bound by its
// instructions, not memory, on the AVX2 CPUs measured (a context read from L3 took as long per
// token as one from memory), and bf16 keys cost two instructions to widen per 8 values; the form
// before, one head at a time, re-read and re-widened every key row G times (for SmolLM2's G = 3,
// 48 of the ~80 instructions of a token's scores), and an earlier one that held the query vectors
// in registers spilled. SmolLM2's heads, 64 x 350 tokens over 30 cold layers: 23.3-24.9 -> 21.2-22.6
// ms on a Zen 4 with this build (docs/cpu-kernels.md has the other shapes and what was tried on
// top). Returns the first token not scored.
template <typename T, int NV, int G>
int64_t shared_key_scores(float* scores, int64_t padded, const float* qs, const T* k_cache, const T* v_cache,
                          const int64_t* rows, int64_t start, int64_t len, const NextItemRows& next) {
  constexpr int64_t d = 8 * NV;
  constexpr int TB = shared_key_tokens<G>();
  constexpr int A = TB * G;  // accumulators, token-major: acc[i * G + g]
  int64_t t = start;
  for (; t + TB <= len; t += TB) {
    prefetch_ahead([&](int64_t i) { return k_cache + rows[i - start]; }, t, TB, len, d);
    prefetch_later(k_cache, v_cache, rows, next, t - start, TB, d);
    __m256 acc[A];
#pragma GCC unroll 16
    for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
#pragma GCC unroll 4
      for (int i = 0; i < TB; ++i) {
        const __m256 k = load8(k_cache + rows[t + i - start] + 8 * j);
#pragma GCC unroll 12
        for (int g = 0; g < G; ++g) acc[i * G + g] = fmadd_mem(acc[i * G + g], k, qs + g * d + 8 * j);
      }
    }
    // The A totals, eight at a time, then each to its head's row of scores.
    alignas(32) float total[(A + 7) / 8 * 8];
    const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int a = 0; a < A; a += 8) {
      auto at = [&](int x) { return a + x < A ? acc[a + x] : zero; };
      _mm256_store_ps(total + a, reduce8_256(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < TB; ++i)
#pragma GCC unroll 12
      for (int g = 0; g < G; ++g) scores[g * padded + (t + i - start)] = total[i * G + g];
  }
  return t;
}

// decode_one for head_dim = 8 * NV and G query heads per KV head, both compile-time so that the
// accumulators are registers (AVX2 has 16 ymm). Shaped so that every FMA chain is short next to
// the work around it (Zen 3's FMA takes 4 cycles and two issue per cycle: 8 chains in flight):
// - Scores: shared_key_scores (above), 8 / G tokens a step or fewer, each key vector widened once
//   for all G heads; one 8-way reduction per 8 accumulators.
// - Weighted V sum: the head is walked in slices of SV vectors, all tokens per slice, with G x SV
//   accumulators: SV = 4 for G <= 3 (12 accumulators), 2 for G <= 6, else 1. bf16 rows with 12
//   accumulators take the G probabilities into registers once a token and widen one value vector
//   at a time (16 ymm in all; 3-4% faster than 2-vector slices for SmolLM2, docs/cpu-kernels.md).
//   The first slice reads the rows from memory and prefetches whole rows ahead; the rest find
//   them in L2.
// The form before (scores 4 tokens at a time with all G x NV query vectors live, 24 for SmolLM2,
// which spilled; V slices of 2 vectors, whose 6 FMA chains waited on latency), alternated with
// this one in one process over 30 cold layers of 64 x 450-token contexts on 2 threads: 76.2 ->
// 68.5 ms (median of 12). Both stay well above the memory's time: reading and summing the same
// rows takes 47 ms. The arithmetic (~23 ms) and the memory stalls add up rather than overlap, and
// neither prefetching 16-256 tokens ahead nor prefetching the V rows during the scores changed that
// on the Zen 3; the V rows and the next item's K rows during the scores (prefetch_later) took the
// same pass from 84.5 to 64.5 ms on a Zen 4.
template <typename T, int NV, int G, typename O>
void decode_one_avx2(O* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t len,
                     int64_t start, float scale, float soft_cap, std::vector<float>& scores, const NextItemRows& next,
                     float* stats) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 16");
  constexpr int64_t d = 8 * NV;
  constexpr int SV = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  static_assert(NV % SV == 0, "slices must tile the head");
  const int64_t n = len - start;
  const int64_t padded = (n + 7) / 8 * 8;
  scores.resize(G * padded);
  auto row_at = [&](const T* cache, int64_t t) { return cache + rows[t - start]; };
  alignas(32) float qs[G * d];
  for (int64_t i = 0; i < G * d; i += 8) _mm256_store_ps(qs + i, _mm256_mul_ps(load8(q + i), _mm256_set1_ps(scale)));
  int64_t t = start;
  t = shared_key_scores<T, NV, G>(scores.data(), padded, qs, k_cache, v_cache, rows, start, len, next);
  for (; t < len; ++t) {
    const T* kr = row_at(k_cache, t);
    for (int g = 0; g < G; ++g) {
      __m256 a = _mm256_mul_ps(_mm256_load_ps(qs + g * d), load8(kr));
      for (int j = 1; j < NV; ++j) a = _mm256_fmadd_ps(_mm256_load_ps(qs + g * d + 8 * j), load8(kr + 8 * j), a);
      scores[g * padded + (t - start)] = hsum8(a);
    }
  }
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores.data() + g * padded;
    if (soft_cap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = soft_cap * std::tanh(sg[i] / soft_cap);
    for (int64_t i = n; i < padded; ++i) sg[i] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < padded; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + i));
    const float largest = hmax8(mx);
    const __m256 m = _mm256_set1_ps(largest);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));
      _mm256_storeu_ps(sg + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float total = hsum8(sum);
    inv_sum[g] = 1.f / total;
    if (stats) stats[g] = largest, stats[G + g] = total;
  }
  for (int c = 0; c < NV; c += SV) {
    __m256 acc[G][SV];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int x = 0; x < SV; ++x) acc[g][x] = _mm256_setzero_ps();
    for (int64_t t = start; t < len; ++t) {
      if (c == 0) prefetch_ahead([&](int64_t i) { return row_at(v_cache, i); }, t, 1, len, d);
      const T* vr = row_at(v_cache, t) + 8 * c;
      if constexpr (std::is_same_v<T, float> && G * SV + 1 + SV > 16) {
        // G x SV accumulators + SV value vectors + the broadcast would not fit: the FMAs take the
        // value rows as memory operands (L1 hits after the first head). Left to itself, GCC
        // loads them into registers and spills an accumulator, whose chain then runs through a
        // store and a reload every token.
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(scores.data() + g * padded + (t - start));
#pragma GCC unroll 4
          for (int x = 0; x < SV; ++x) acc[g][x] = fmadd_mem(acc[g][x], p, vr + 8 * x);
        }
      } else if constexpr (!std::is_same_v<T, float> && G * SV + SV + 1 > 16) {
        // SV widened value vectors at once would not fit beside the accumulators (G = 3: 12 + 4
        // + 1): the G probabilities broadcast once, then one widened value vector at a time.
        __m256 p[G];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(scores.data() + g * padded + (t - start));
#pragma GCC unroll 4
        for (int x = 0; x < SV; ++x) {
          const __m256 v = load8(vr + 8 * x);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) acc[g][x] = _mm256_fmadd_ps(p[g], v, acc[g][x]);
        }
      } else {
        __m256 v[SV];
#pragma GCC unroll 4
        for (int x = 0; x < SV; ++x) v[x] = load8(vr + 8 * x);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(scores.data() + g * padded + (t - start));
#pragma GCC unroll 4
          for (int x = 0; x < SV; ++x) acc[g][x] = _mm256_fmadd_ps(p, v[x], acc[g][x]);
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m256 inv = _mm256_set1_ps(inv_sum[g]);
#pragma GCC unroll 4
      for (int x = 0; x < SV; ++x) store8(out + g * d + 8 * (c + x), _mm256_mul_ps(acc[g][x], inv));
    }
  }
}

// The G (query heads per KV head) and head_dim decode_one_avx2 is built for; false: not one.
template <typename T, typename O>
bool decode_one_avx2_dispatch(O* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* rows,
                              int64_t len, int64_t start, int64_t group, int64_t d, float scale, float soft_cap,
                              std::vector<float>& scores, const NextItemRows& next, float* stats) {
#define TPSERVE_DECODE_AVX2(NV, G)                                                                       \
  case G:                                                                                              \
    decode_one_avx2<T, NV, G>(out, q, k_cache, v_cache, rows, len, start, scale, soft_cap, scores, next, stats); \
    return true;
#define TPSERVE_DECODE_AVX2_GROUPS(NV) \
  switch (group) {                     \
    TPSERVE_DECODE_AVX2(NV, 1)         \
    TPSERVE_DECODE_AVX2(NV, 2)         \
    TPSERVE_DECODE_AVX2(NV, 3)         \
    TPSERVE_DECODE_AVX2(NV, 4)         \
    TPSERVE_DECODE_AVX2(NV, 5)         \
    TPSERVE_DECODE_AVX2(NV, 6)         \
    TPSERVE_DECODE_AVX2(NV, 7)         \
    TPSERVE_DECODE_AVX2(NV, 8)         \
    default:                           \
      return false;                    \
  }
  if (d == 64) TPSERVE_DECODE_AVX2_GROUPS(8)
  if (d == 128) TPSERVE_DECODE_AVX2_GROUPS(16)
#undef TPSERVE_DECODE_AVX2_GROUPS
#undef TPSERVE_DECODE_AVX2
  return false;
}
#endif  // TPSERVE_AVX2 && !__AVX512F__

// Context tokens a part of a split context gets at least. With parts of 256 tokens (Zen 4, one
// request, alternated as below) 520 / 700 / 1,000-token contexts ran within the noise or up to
// 20% slower (0.75 -> 0.91 ms at 520): each part's fixed work and the merge cost what the balance
// won. From 2,048 tokens it wins.
constexpr int64_t kMinSplitTokens = 1024;

// How many parts each (request, KV head) item's context is cut into (flash-decoding): 1 where the
// step's items give every thread two or more; else the fewest parts that give every thread two
// units or more and all threads an equal count, no part under kMinSplitTokens of the longest
// context. Why: one request has one item per KV head (3 for the default model), so on 2 threads
// one thread did two and the other one while it waited, and on 16 threads 13 waited. Measured on
// the 2-core Zen 4 (30 cold layers, bf16, alternated in one process, medians of 11-15): one
// request of 4,000 / 6,000 tokens 4.32 -> 3.97, 6.93 -> 6.23 ms in two parts (2,000 tokens: 2.30
// -> 2.21, inside the noise); less than the 25% the balance alone suggests, since the lone thread
// had had the memory to itself.
int64_t decode_context_splits(int64_t items, int64_t longest, int64_t threads) {
  if (threads <= 1 || items >= 2 * threads) return 1;
  const int64_t most = std::max<int64_t>(1, longest / kMinSplitTokens);
  int64_t splits = 1;
  while (splits < most && (items * splits < 2 * threads || items * splits % threads != 0)) ++splits;
  return splits;
}

// The units one thread of the decode attention runs, in order: its static share [cur, end), or,
// with a counter, chunks of `chunk` units claimed from it until none are left. Why claims: a
// step's contexts differ in length (a served batch's prompts and outputs), so half the items
// each left one thread waiting for the other at the region's end, and under a served load a
// preempted thread's fixed half waits for it too. Measured (2-core Zen 4, bf16, 30 cold layers,
// python -m bench.kernels.decode_attention_kernel, the two builds alternated in their own
// processes): 32 contexts of 150 tokens then 32 of 550 ran at 0.60-0.75 of a plain read of the
// same bytes with halves (median 0.65), 0.56-0.90 with claims (0.75); 64 random lengths of
// 64-640 tokens (halves 11,193 / 12,108 tokens) higher with claims in 4 pairs of 4; 64 of 350
// tokens, nothing to balance, 0.63-0.78 against 0.64-0.84 (no cost).
struct UnitQueue {
  std::atomic<int64_t>* counter;  // claims' source (nullptr: a static share)
  int64_t chunk;                  // units per claim
  int64_t units;                  // every unit of the step
  int64_t cur, end;               // the units claimed and not yet handed out

  // The next unit, or -1 when this thread has no more.
  int64_t pop() {
    if (cur == end) {
      if (counter == nullptr) return -1;
      cur = counter->fetch_add(chunk, std::memory_order_relaxed);
      if (cur >= units) {
        cur = end;
        return -1;
      }
      end = std::min(cur + chunk, units);
    }
    return cur++;
  }
};

// Claims per thread the decode attention aims at when it claims: enough that the last one's
// wait is short (1/16 of a thread's work), few enough that the counter costs nothing
// measurable (a claim is one atomic add; an item of 350 tokens takes ~4 us).
constexpr int64_t kDecodeClaimsPerThread = 16;

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double soft_cap) {
  // out, q: [N, H, D]; caches: [num_blocks, block_size, KVH, D] (any strides, rows contiguous);
  // block_tables [N, W]; context_lens [N].
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [N, H, D] with contiguous heads");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(block_tables.is_contiguous());
  const CacheStrides cs = cache_strides(k_cache, v_cache);
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous());
  const int64_t num_reqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d);
  const int64_t group = heads / kv_heads;
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_decode_attention_check", [&] {
    // Every block a context reads must exist: a bad table would read outside the cache.
    const index_t* tables = block_tables.data_ptr<index_t>();
    for (int64_t b = 0; b < num_reqs; ++b) {
      const int64_t used = (lens[b] + block_size - 1) / block_size;
      TORCH_CHECK(lens[b] >= 1 && used <= width, "context longer than its block table");
      for (int64_t i = 0; i < used; ++i)
        TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < num_blocks, "block id out of range");
    }
  });
  TPSERVE_DISPATCH(q.scalar_type(), "paged_decode_attention", [&] {
    AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_decode_attention_index", [&] {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      const scalar_t* kc = k_cache.data_ptr<scalar_t>();
      const scalar_t* vc = v_cache.data_ptr<scalar_t>();
      const index_t* tables = block_tables.data_ptr<index_t>();
      // The first context token an item (request b, KV head h) attends to.
      auto first_token = [&](int64_t b) {
        return sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : int64_t{0};
      };
      const int64_t items = num_reqs * kv_heads;
      int64_t longest = 0;
      for (int64_t b = 0; b < num_reqs; ++b) longest = std::max<int64_t>(longest, lens[b] - first_token(b));
      const int64_t threads = at::get_num_threads();
      const int64_t splits = decode_context_splits(items, longest, threads);
      // Units of work: an item's context, or one of its `splits` parts, each [s0, s1).
      auto unit_range = [&](int64_t unit, int64_t& s0, int64_t& s1) {
        const int64_t b = unit / splits / kv_heads, start = first_token(b);
        const int64_t part = (lens[b] - start + splits - 1) / splits;
        s0 = std::min<int64_t>(lens[b], start + unit % splits * part);
        s1 = std::min<int64_t>(lens[b], s0 + part);
      };
      // A part's result (split contexts only): its G x d outputs normalized by its own sum, then
      // the G largest scores and the G sums (decode_one's stats), for the merge below.
      const int64_t part_size = group * d + 2 * group;
      const at::Tensor parts = splits > 1 ? at::empty({items * splits, part_size}, q.options().dtype(at::kFloat))
                                          : at::Tensor();
      const float sc = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
      // Whole contexts are claimed (UnitQueue); split parts keep static shares, since the split
      // already gives every thread an equal count of equal parts. A claim takes whole requests
      // (their KV heads share cache lines) once there are enough of them.
      const int64_t units = items * splits;
      const bool claims = splits == 1 && threads > 1 && units > threads;
      const int64_t chunk = num_reqs >= threads * kDecodeClaimsPerThread
                                ? kv_heads * (num_reqs / (threads * kDecodeClaimsPerThread))
                                : 1;
      std::atomic<int64_t> counter{0};
      at::parallel_for(0, claims ? threads : units, 1, [&](int64_t begin, int64_t end) {
        UnitQueue queue = claims ? UnitQueue{&counter, chunk, units, 0, 0} : UnitQueue{nullptr, 0, units, begin, end};
        // Scratch kept per thread across calls: 7 fresh vectors per thread per layer were ~420
        // allocations a step, some zero-filled, on memory the weight stream had evicted.
        thread_local std::vector<float> scores, qf, acc, row;
        thread_local std::vector<uint16_t> probs;
        qf.resize(group * d);
        acc.resize(group * d);
        row.resize(d);
        // This unit's rows and the next one's (its K rows are asked for while this one's scores run).
        thread_local std::vector<int64_t> rows, next_rows;
        auto unit_rows = [&](std::vector<int64_t>& out_rows, int64_t unit) {
          const int64_t item = unit / splits, b = item / kv_heads;
          int64_t s0, s1;
          unit_range(unit, s0, s1);
          context_rows(out_rows, tables + b * width, s0, s1, block_size, cs, item % kv_heads);
        };
        int64_t following = queue.pop();
        if (following >= 0) unit_rows(next_rows, following);
        for (int64_t unit = following; unit >= 0; unit = following) {
          const int64_t item = unit / splits, b = item / kv_heads, h = item % kv_heads;
          int64_t s0, s1;
          unit_range(unit, s0, s1);
          const scalar_t* qb = qp + b * q.stride(0) + h * group * d;
          std::swap(rows, next_rows);
          NextItemRows next;
          following = queue.pop();
          if (following >= 0) {
            unit_rows(next_rows, following);
            next = {next_rows.data(), static_cast<int64_t>(next_rows.size())};
          }
          // The best path this build has for the group and head_dim, writing o (scalar_t: the
          // op's output; float: a part) and, for a part, its stats.
          auto attend = [&](auto* o, float* stats) {
#if defined(__AVX512F__)
            if (decode_one_avx512_dispatch<scalar_t>(o, qb, kc, vc, rows.data(), s1, s0, group, d, sc, cap, scores,
                                                     probs, next, stats))
              return;
#elif defined(TPSERVE_AVX2)
            if (decode_one_avx2_dispatch<scalar_t>(o, qb, kc, vc, rows.data(), s1, s0, group, d, sc, cap, scores,
                                                   next, stats))
              return;
#endif
            decode_one<scalar_t>(o, qb, kc, vc, rows.data(), s1, s0, group, d, sc, cap, scores, qf, acc, row, stats);
          };
          if (splits == 1) {
            attend(op + (b * heads + h * group) * d, nullptr);
            continue;
          }
          float* part = parts.data_ptr<float>() + unit * part_size;
          if (s0 == s1) {  // a context shorter than the others: this part is empty
            std::fill(part + group * d, part + group * d + group, -INFINITY);
            std::fill(part + group * d + group, part + part_size, 0.f);
            continue;
          }
          attend(part, part + group * d);
        }
      });
      if (splits == 1) return;
      // Each head's parts, rescaled to the largest score among them: out = sum_j w_j o_j / sum_j w_j,
      // w_j = sum_j exp(max_j - max). An item has one part at least that is not empty. On this
      // thread: a few items' G x d sums cost less than a parallel region's fork and join.
      {
        std::vector<float> w(splits), o(d);
        for (int64_t item = 0; item < items; ++item) {
          const int64_t b = item / kv_heads, h = item % kv_heads;
          const float* first = parts.data_ptr<float>() + item * splits * part_size;
          for (int64_t g = 0; g < group; ++g) {
            float largest = -INFINITY;
            for (int64_t j = 0; j < splits; ++j) largest = std::max(largest, first[j * part_size + group * d + g]);
            float total = 0.f;
            for (int64_t j = 0; j < splits; ++j) {
              const float* stats = first + j * part_size + group * d;
              w[j] = stats[group + g] == 0.f ? 0.f : stats[group + g] * std::exp(stats[g] - largest);
              total += w[j];
            }
            std::fill(o.begin(), o.end(), 0.f);
            for (int64_t j = 0; j < splits; ++j) {
              if (w[j] == 0.f) continue;  // an empty part's outputs were never written
              for (int64_t i = 0; i < d; ++i) o[i] += w[j] * first[j * part_size + g * d + i];
            }
            scalar_t* out_row = op + (b * heads + h * group + g) * d;
            for (int64_t i = 0; i < d; ++i) out_row[i] = from_f<scalar_t>(o[i] / total);
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(tpserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps, float offset) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &rotary_);
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &reshape_and_cache);
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int sliding_window, float soft_cap) -> ()",
        &paged_decode_attention);
  m.def("decode_context_splits(int items, int longest, int threads) -> int", &decode_context_splits);
}
