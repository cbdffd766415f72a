// paged_prefill_attention: a step's prompt chunks against their contexts in the paged KV cache,
// as flash attention (key tiles with an online softmax: no [queries x keys] score matrix, key
// tiles past a query tile's last position never computed), reading the cache in place of the
// gather + masked SDPA that a chunk after the first needs.
//
// Shape of the work: a pre-pass packs each (chunk, KV head)'s keys into panels of kPanel keys
// transposed ([D][kPanel] floats, what the score micro-kernel streams) and its values into
// contiguous float rows, once per layer, instead of once per query tile that reads them. Then each
// work item is (chunk, KV head, tile of kQueryTile query tokens); the tile's rows are its tokens x
// the G query heads of the KV head (GQA: one K/V panel serves all G), r = token * G + head.
// Per key tile: scores Q K^T by register tiles (6 rows x 16 keys), the mask only on tiles that
// cross a row's causal or window edge, the online softmax, then O = O * alpha + P V by register
// tiles (6 rows x 16 dims; on AVX-512, 6 rows x 64 keys and 6 rows x 64 dims of 512-bit vectors).
// Float32 math; bf16 caches are widened while packing, except on builds with AVX512-BF16, where
// bf16 steps keep bf16 panels and multiply them on AMX tiles (the amx variant: blocks of 128
// keys, Q K^T, softmax and P V per 16-row block, attend_tile_amx) or by vdpbf16ps, with the
// roundings of torch's CPU flash attention for reduced types (the bf16 path below).
//
// Measured (bench/kernels/prefill_attention_kernel.py --threads 1 --cpu-time, 2-core Xeon with
// AMX, the default model's 9 / 3 heads of 64, 2026-12-05, two rounds alternated with the 64-key-
// tile kernel before): bf16 on AMX against the gather + SDPA path: a 1,000-token prompt 2.7-3.6
// vs 4.9-5.4 ms per layer (before: 3.3-3.4), a 4,096-token prompt's two 2,048-token chunks 33-38
// vs 82-90 ms (before: 47-52), a 6,144-token prompt's three 75-85 vs 189-203 ms (before:
// 113-117). In one process, alternated with the kernel before: 1.2x on a 1,024-token prompt,
// 1.45-1.55x on a 2,048-token one and on a 2,048-token chunk after 2,048 cached; in-process time
// to first token of a 4,096-token prompt (LLMEngine, 2 threads) 1.35-1.40 s vs 1.56-1.64 s, of a
// 6,144-token one 2.59-2.73 vs 3.09-3.29 s. Then the softmax's row sums in 16 lanes and a cheaper
// exp (exp2_512): a 4,096-token prompt's attention 21.1 -> 18.8 ms a layer, 1,024 tokens 1.61 ->
// 1.42 (2 threads, alternated in one process). The vdpbf16ps tiles ran at 0.5-0.9x that SDPA
// (torch's AMX flash attention) on that Xeon; on a 2-core AMD Zen 4 (no AMX, vdpbf16ps at twice
// its FMAs' rate) they ran 2.9-4.6x torch's non-AMX SDPA (a 1,024-token prompt 4.1 vs 14.3 ms a
// layer), so where there is no AMX Python times the two at load (workers/attention/
// cpu_prefill_choice.py). float32, 512-bit
// tiles against the AVX2 ones, alternated in one process: 1.22-1.28x (a 1,024-token prompt 12.5
// vs 16.1 ms, 8 prompts / 2,048 tokens 9.5 vs 11.7 ms).

#include "vec.h"

#include <array>
#include <memory>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx_permission.h"
#endif

namespace {

using namespace tpserve;

// Keys per panel of the packed K (the score micro-kernel's width: two 8-lane vectors).
constexpr int64_t kPanel = 16;
// Query tokens per work item, keys per tile of the online softmax.
constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyTile = 64;

// One chunk's place in the step and in the packed buffers.
struct Chunk {
  int64_t query_start;  // first token of the chunk in the step's flat batch
  int64_t query_len;    // tokens in the chunk
  int64_t context_len;  // cached tokens + the chunk
  int64_t key_align;    // keys are packed and tiled in runs of this many (kPanel; kAmxKeys on AMX)
  int64_t key_lo;       // first packed key (a multiple of key_align; above 0 only with a window)
  int64_t packed_keys;  // keys packed from key_lo, rounded up to key_align
  int64_t pack_offset;  // float offset of this chunk's KV head 0 in the packed K and V buffers
};

// Per-thread buffers of one work item, float32.
struct Workspace {
  std::vector<float> q;      // [R, D] the tile's queries, times the softmax scale
  std::vector<float> o;      // [R, D] output accumulators, not yet divided by the row sums
  std::vector<float> s;      // [R, kKeyTile] one key tile's scores, then its probabilities
  std::vector<float> m;      // [R] running max of each row's scores
  std::vector<float> l;      // [R] running sum of each row's exp(score - max)
  std::vector<float> alpha;  // [R] this tile's rescale of each row's earlier sums
};

// Calls f(std::integral_constant<int, RB>{}, r) over rows [0, rows): blocks of the widest register
// tile (6 rows), then one call for the 1-5 rows left. Every register-tile kernel below walks its
// rows this way.
template <typename F>
inline void by_row_blocks(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) f(std::integral_constant<int, 6>{}, r);
  switch (rows - r) {
    case 5: f(std::integral_constant<int, 5>{}, r); break;
    case 4: f(std::integral_constant<int, 4>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Calls f(std::integral_constant<int, NP>{}) for the NP = nk / kPanel panels of a key tile (1-4).
template <typename F>
inline void by_panel_count(int64_t nk, F&& f) {
  static_assert(kKeyTile == 4 * kPanel, "a key tile is at most four panels");
  switch (nk / kPanel) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

#if defined(TPSERVE_AVX2)
// s[r][0..16) = q[r] . keys of one panel, for RB rows. q rows [D] at stride d, panel [D][16].
template <int RB>
inline void qk_rows(float* s, int64_t s_stride, const float* q, const float* panel, int64_t d) {
  __m256 acc[RB][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 k0 = _mm256_loadu_ps(panel + i * kPanel), k1 = _mm256_loadu_ps(panel + i * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 a = _mm256_broadcast_ss(q + r * d + i);
      acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm256_storeu_ps(s + r * s_stride + 8, acc[r][1]);
  }
}

// o[r][c..c+16) = o[r][c..c+16) * alpha[r] + sum_j p[r][j] v[j][c..c+16), for RB rows, nk keys.
// RB 6 x 2 vectors: 12 accumulators + 2 value vectors + the broadcast fit AVX2's 16 registers
// (3 rows x 32 dims needed 17, and GCC then folded all 12 value loads into the FMAs: 15 loads
// per 12 FMAs made the value sum load-bound, 1.7x the time of the equally sized score tile).
template <int RB>
inline void pv_rows(float* o, const float* p, int64_t p_stride, const float* alpha, const float* v, int64_t nk,
                    int64_t d, int64_t c) {
  __m256 acc[RB][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c), a);
    acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c + 8), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const float* vr = v + j * d + c;
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * p_stride + j);
      acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(o + r * d + c, acc[r][0]);
    _mm256_storeu_ps(o + r * d + c + 8, acc[r][1]);
  }
}

// The register tiles over all rows.
inline void qk_tile(float* s, const float* q, const float* panels, int64_t rows, int64_t nk, int64_t d) {
  for (int64_t p = 0; p < nk / kPanel; ++p)
    by_row_blocks(rows, [&](auto rb, int64_t r) {
      qk_rows<rb>(s + p * kPanel + r * kKeyTile, kKeyTile, q + r * d, panels + p * d * kPanel, d);
    });
}

inline void pv_tile(float* o, const float* p, const float* alpha, const float* v, int64_t rows, int64_t nk,
                    int64_t d) {
  for (int64_t c = 0; c < d; c += 16)
    by_row_blocks(rows, [&](auto rb, int64_t r) {
      pv_rows<rb>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c);
    });
}
#endif  // TPSERVE_AVX2

#if defined(__AVX512F__) && !defined(TPSERVE_PREFILL_F32_256)
// The float32 tiles at 512 bits (AVX-512 machines; the AVX2 tiles above serve the others): one
// vector is a whole 16-key panel row, so a register tile is 6 rows x 4 panels (24 accumulators +
// 4 key vectors of AVX-512's 32 registers) for the scores and 6 rows x 64 dims for the value sum.
// (TPSERVE_PREFILL_F32_256, defined only by an A/B build, keeps the AVX2 tiles for comparison.)
#define TPSERVE_PREFILL_F32_512 1

template <int RB, int NP>
inline void qk_rows512(float* s, const float* q, const float* panels, int64_t d) {
  __m512 acc[RB][NP];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m512 k[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) k[p] = _mm512_loadu_ps(panels + p * d * kPanel + i * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * d + i]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a, k[p], acc[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(s + r * kKeyTile + p * kPanel, acc[r][p]);
}

inline void qk_tile512(float* s, const float* q, const float* panels, int64_t rows, int64_t nk, int64_t d) {
  by_panel_count(nk, [&](auto np) {
    by_row_blocks(rows, [&](auto rb, int64_t r) { qk_rows512<rb, np>(s + r * kKeyTile, q + r * d, panels, d); });
  });
}

template <int RB, int CV>
inline void pv_rows512(float* o, const float* p, const float* alpha, const float* v, int64_t nk, int64_t d,
                       int64_t c) {
  __m512 acc[RB][CV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) acc[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c + 16 * x), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 vv[CV];
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) vv[x] = _mm512_loadu_ps(v + j * d + c + 16 * x);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeyTile + j]);
#pragma GCC unroll 4
      for (int x = 0; x < CV; ++x) acc[r][x] = _mm512_fmadd_ps(pr, vv[x], acc[r][x]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) _mm512_storeu_ps(o + r * d + c + 16 * x, acc[r][x]);
}

// The value sum over all rows: 64-dim slices, then 16-dim ones.
inline void pv_tile512(float* o, const float* p, const float* alpha, const float* v, int64_t rows, int64_t nk,
                       int64_t d) {
  int64_t c = 0;
  auto slice = [&](auto cv) {
    by_row_blocks(rows, [&](auto rb, int64_t r) {
      pv_rows512<rb, cv>(o + r * d, p + r * kKeyTile, alpha + r, v, nk, d, c);
    });
  };
  for (; c + 64 <= d; c += 64) slice(std::integral_constant<int, 4>{});
  for (; c < d; c += 16) slice(std::integral_constant<int, 1>{});
}
#endif  // __AVX512F__

// The portable forms (any head_dim, any CPU): the same tiles as plain loops.
inline void qk_tile_portable(float* s, const float* q, const float* panels, int64_t rows, int64_t nk, int64_t d) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < nk; ++j) {
      const float* panel = panels + (j / kPanel) * d * kPanel + j % kPanel;
      float dot = 0.f;
      for (int64_t i = 0; i < d; ++i) dot += q[r * d + i] * panel[i * kPanel];
      s[r * kKeyTile + j] = dot;
    }
}

inline void pv_tile_portable(float* o, const float* p, const float* alpha, const float* v, int64_t rows, int64_t nk,
                             int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = o + r * d;
    for (int64_t i = 0; i < d; ++i) orow[i] *= alpha[r];
    for (int64_t j = 0; j < nk; ++j) {
      const float pj = p[r * kKeyTile + j];
      const float* vr = v + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) orow[i] += pj * vr[i];
    }
  }
}

// The online softmax of one key tile for one row: scores s[0..nk) (masked ones -inf) become
// probabilities against the row's new running max; returns alpha, the factor on the row's
// earlier sums. A row with every key of the tile masked keeps its state (alpha 1, p all 0).
inline float softmax_tile_row(float* s, int64_t nk, float& m, float& l) {
  float tile_max = -INFINITY;
  int64_t j = 0;
#if defined(TPSERVE_PREFILL_F32_512)
  // 16 lanes where the tiles are 512-bit: at 8 lanes the softmax held the AVX-512 float32 kernel
  // back (1.11-1.19x faster with it at 16, 2-core Xeon; docs/cpu-kernels.md, prefill attention).
  __m512 mx16 = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= nk; j += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(s + j));
  tile_max = _mm512_reduce_max_ps(mx16);
#endif
#if defined(TPSERVE_AVX2)
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= nk; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  tile_max = std::max(tile_max, hmax8(mx));
#endif
  for (; j < nk; ++j) tile_max = std::max(tile_max, s[j]);
  if (tile_max == -INFINITY) {
    std::fill(s, s + nk, 0.f);
    return 1.f;
  }
  const float m_new = std::max(m, tile_max);
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - m_new);
  float sum = 0.f;
  j = 0;
#if defined(TPSERVE_PREFILL_F32_512)
  const __m512 mv16 = _mm512_set1_ps(m_new);
  __m512 sv16 = _mm512_setzero_ps();
  for (; j + 16 <= nk; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    // exp512 clamps its input, so a masked key would weigh e^-104, not 0: zero it.
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                         exp512(_mm512_sub_ps(x, mv16)));
    _mm512_storeu_ps(s + j, e);
    sv16 = _mm512_add_ps(sv16, e);
  }
  sum = _mm512_reduce_add_ps(sv16);
#endif
#if defined(TPSERVE_AVX2)
  const __m256 mv = _mm256_set1_ps(m_new), neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 sv = _mm256_setzero_ps();
  for (; j + 8 <= nk; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    // exp256 clamps its input at -87, so a masked key would weigh e^-87, not 0: zero it.
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, mv)), _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  sum += hsum8(sv);
#endif
  for (; j < nk; ++j) {
    s[j] = s[j] == -INFINITY ? 0.f : std::exp(s[j] - m_new);
    sum += s[j];
  }
  m = m_new;
  l = l * alpha + sum;
  return alpha;
}

// Whether the key tile [k0, k0 + nk) crosses an edge of a query tile whose rows sit at positions
// first_pos..last_pos: a key past the first row's position (causal) or before the last row's
// window start. Tiles that do not are used whole, unmasked.
inline bool tile_crosses_an_edge(int64_t k0, int64_t nk, int64_t first_pos, int64_t last_pos, int64_t window) {
  return k0 + nk - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
}

// One row's scores over the key tile [k0, k0 + nk): the soft cap (cap * tanh(s / cap)), then, on a
// tile that crosses an edge, -inf on the keys the query at position pos does not see.
inline void cap_and_mask_row(float* sr, int64_t nk, float soft_cap, bool masked, int64_t pos, int64_t k0,
                             int64_t window) {
  if (soft_cap > 0.f)
    for (int64_t j = 0; j < nk; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
  if (!masked) return;
  // Visible keys: (pos - window, pos], in this tile's coordinates.
  const int64_t vis_hi = std::min<int64_t>(nk, pos - k0 + 1);
  const int64_t vis_lo = window > 0 ? std::clamp<int64_t>(pos - window + 1 - k0, 0, nk) : 0;
  for (int64_t j = 0; j < std::min(vis_lo, nk); ++j) sr[j] = -INFINITY;
  for (int64_t j = std::max<int64_t>(vis_hi, 0); j < nk; ++j) sr[j] = -INFINITY;
}

// The keys a query tile at positions first_pos..last_pos reads from a chunk's packed panels:
// [begin, end), panel-aligned, from its first row's window start to its last row.
struct KeyRange {
  int64_t begin;  // first key, a multiple of the chunk's key_align, at or after its key_lo
  int64_t end;    // one past the last key, rounded up to kPanel
};

inline KeyRange visible_keys(const Chunk& c, int64_t first_pos, int64_t last_pos, int64_t window) {
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t a = c.key_align;
  return {std::max(c.key_lo, lo / a * a), (last_pos + 1 + a - 1) / a * a};
}

// One work item: query tokens [i0, i0 + nq) of a chunk, the G heads of KV head h. positions: the
// chunk's first query sits at context_len - query_len.
template <typename T>
void attend_tile(T* out, const T* q, int64_t q_stride, const Chunk& c, int64_t h, int64_t i0, int64_t nq,
                 int64_t group, int64_t heads, int64_t d, const float* k_packed, const float* v_packed,
                 int64_t kv_heads, float scale, int64_t window, float soft_cap, bool vector_tiles, Workspace& ws) {
  const int64_t rows = nq * group;
  ws.q.resize(rows * d);
  ws.o.assign(rows * d, 0.f);
  ws.s.resize(rows * kKeyTile);
  ws.m.assign(rows, -INFINITY);
  ws.l.assign(rows, 0.f);
  ws.alpha.resize(rows);
  const int64_t first_pos = c.context_len - c.query_len + i0;  // position of the tile's first query
  const int64_t last_pos = first_pos + nq - 1;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + (c.query_start + i0 + i) * q_stride + (h * group + g) * d;
      float* dst = ws.q.data() + (i * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]) * scale;
    }
  const float* kh = k_packed + c.pack_offset + h * c.packed_keys * d;
  const float* vh = v_packed + c.pack_offset + h * c.packed_keys * d;
  const KeyRange keys = visible_keys(c, first_pos, last_pos, window);
  for (int64_t k0 = keys.begin; k0 < keys.end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, keys.end - k0);
    const float* panels = kh + (k0 - c.key_lo) * d;
    const float* values = vh + (k0 - c.key_lo) * d;
#if defined(TPSERVE_PREFILL_F32_512)
    if (vector_tiles)
      qk_tile512(ws.s.data(), ws.q.data(), panels, rows, nk, d);
    else
#elif defined(TPSERVE_AVX2)
    if (vector_tiles)
      qk_tile(ws.s.data(), ws.q.data(), panels, rows, nk, d);
    else
#endif
      qk_tile_portable(ws.s.data(), ws.q.data(), panels, rows, nk, d);
    const bool masked = tile_crosses_an_edge(k0, nk, first_pos, last_pos, window);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = ws.s.data() + r * kKeyTile;
      cap_and_mask_row(sr, nk, soft_cap, masked, first_pos + r / group, k0, window);
      ws.alpha[r] = softmax_tile_row(sr, nk, ws.m[r], ws.l[r]);
    }
#if defined(TPSERVE_PREFILL_F32_512)
    if (vector_tiles)
      pv_tile512(ws.o.data(), ws.s.data(), ws.alpha.data(), values, rows, nk, d);
    else
#elif defined(TPSERVE_AVX2)
    if (vector_tiles)
      pv_tile(ws.o.data(), ws.s.data(), ws.alpha.data(), values, rows, nk, d);
    else
#endif
      pv_tile_portable(ws.o.data(), ws.s.data(), ws.alpha.data(), values, rows, nk, d);
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = 1.f / ws.l[r];
      T* dst = out + (c.query_start + i0 + i) * heads * d + (h * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = from_f<T>(ws.o[r * d + x] * inv);
    }
}

// Packs one panel of one (chunk, KV head): keys [first, first + kPanel), K transposed into
// [D][kPanel], V as float rows; keys past the context are zeros (always masked). rows: the
// panel's element offsets in the caches (context_rows), for the keys inside the context.
template <typename T>
void pack_panel(float* k_dst, float* v_dst, const T* k_cache, const T* v_cache, const std::vector<int64_t>& rows,
                int64_t d) {
  for (int64_t j = 0; j < kPanel; ++j) {
    float* vrow = v_dst + j * d;
    if (j >= static_cast<int64_t>(rows.size())) {
      for (int64_t x = 0; x < d; ++x) k_dst[x * kPanel + j] = 0.f;
      std::fill(vrow, vrow + d, 0.f);
      continue;
    }
    const T* kr = k_cache + rows[j];
    const T* vr = v_cache + rows[j];
    for (int64_t x = 0; x < d; ++x) k_dst[x * kPanel + j] = to_f(kr[x]);
    for (int64_t x = 0; x < d; ++x) vrow[x] = to_f(vr[x]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---- The bf16 path (AVX512-BF16) ----
// Q K^T and P V by vdpbf16ps: each lane multiplies a pair of bf16 values by another pair and adds
// both products to a float32 sum (the products are exact in float32). Both operands are the
// cache's bf16 bits, never widened: the pre-pass packs
//   K per panel as [D/2][kPanel][2]: dims (2i, 2i+1) of 16 keys in one 512-bit vector, so a row's
//     broadcast query pair (q[2i], q[2i+1]) dotted with it adds to 16 scores at once;
//   V per key pair as [D][2]: (v[j][c], v[j+1][c]) for every dim c, so a row's broadcast
//     probability pair (p[j], p[j+1]) dotted with 16 such pairs adds to 16 output dims at once.
// The roundings are those of torch's CPU flash attention for reduced types (what HF's SDPA runs
// on CPU): scores in float32 from bf16 q and k, times the scale in float32, a float32 softmax with
// float32 row sums, the probabilities rounded to bf16 for P V only, float32 output accumulators
// divided by the row sum and rounded to bf16 once. (The float32 exp is computed as 2^x with the
// scale and log2 e folded into one factor, to 2 ulp, against a row max that may lag the true one
// by up to 2^8 (kLazyRescale); probabilities below 2^-126 are 0, as torch's exp makes them.)
#define TPSERVE_PREFILL_BF16 1

// bf16 values as their bits (the packed panels copy the cache's bits).
using Bits = uint16_t;

// A row's pair of bf16 values at p (two adjacent elements) in every 32-bit lane.
inline __m512bh broadcast_pair(const Bits* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// s[r][16p..16p+16) = q[r] . keys of panel p, for RB rows and NP panels.
// 6 rows x 4 panels: 24 accumulators + 4 key vectors in AVX-512's 32 registers; the query pair
// is a broadcast memory operand of each vdpbf16ps.
template <int RB, int NP>
inline void qk_rows_bf16(float* s, const Bits* q, const Bits* panels, int64_t d) {
  __m512 acc[RB][NP];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 2; ++i) {
    __m512bh k[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) k[p] = (__m512bh)_mm512_loadu_si512(panels + p * d * kPanel + i * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh qr = broadcast_pair(q + r * d + 2 * i);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], k[p], qr);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(s + r * kKeyTile + p * kPanel, acc[r][p]);
}

// Scores of all rows against nk keys (a multiple of kPanel, at most kKeyTile) of packed panels.
inline void qk_tile_bf16(float* s, const Bits* q, const Bits* panels, int64_t rows, int64_t nk, int64_t d) {
  by_panel_count(nk, [&](auto np) {
    by_row_blocks(rows, [&](auto rb, int64_t r) { qk_rows_bf16<rb, np>(s + r * kKeyTile, q + r * d, panels, d); });
  });
}

// o[r][c..c+16CV) += sum_j p[r][j] v[j][c..c+16CV), for RB rows and
// nk keys (even). p: bf16 rows at stride kKeyTile; v: key pairs of [D][2]. 6 rows x 4 vectors:
// 24 accumulators + 4 value vectors.
template <int RB, int CV>
inline void pv_rows_bf16(float* o, const Bits* p, const Bits* v, int64_t nk, int64_t d, int64_t c) {
  __m512 acc[RB][CV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) acc[r][x] = _mm512_loadu_ps(o + r * d + c + 16 * x);
  for (int64_t t = 0; t < nk / 2; ++t) {
    __m512bh vv[CV];
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) vv[x] = (__m512bh)_mm512_loadu_si512(v + t * 2 * d + 2 * (c + 16 * x));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = broadcast_pair(p + r * kKeyTile + 2 * t);
#pragma GCC unroll 4
      for (int x = 0; x < CV; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], vv[x], pr);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CV; ++x) _mm512_storeu_ps(o + r * d + c + 16 * x, acc[r][x]);
}

// The value sum over all rows: 64-dim slices, then 16-dim ones (head_dim a multiple of 16).
inline void pv_tile_bf16(float* o, const Bits* p, const Bits* v, int64_t rows, int64_t nk, int64_t d) {
  int64_t c = 0;
  auto slice = [&](auto cv) {
    by_row_blocks(rows, [&](auto rb, int64_t r) { pv_rows_bf16<rb, cv>(o + r * d, p + r * kKeyTile, v, nk, d, c); });
  };
  for (; c + 64 <= d; c += 64) slice(std::integral_constant<int, 4>{});
  for (; c < d; c += 16) slice(std::integral_constant<int, 1>{});
}

// Rows of an AMX tile (A and C): an AMX work item's rows are padded to a multiple of it.
constexpr int64_t kAmxRows = 16;

// Per-thread buffers of one vdpbf16ps work item.
struct WorkspaceBf16 {
  std::vector<Bits> q;   // [R, D] the tile's queries (bf16 bits, unscaled)
  std::vector<float> o;  // [R, D] output accumulators, not yet divided by the row sums
  std::vector<float> s;  // [R, kKeyTile] one key tile's scores
  std::vector<Bits> p;   // [R, kKeyTile] their probabilities, rounded to bf16
  std::vector<float> m;  // [R] each row's reference max, in base-2 units (score x scale x log2 e)
  std::vector<float> l;  // [R, kSumLanes] running sums of each row's 2^(score x scale x log2 e - m)
};

// A bf16 row's running sum of probabilities is kept in 16 lanes, added across once when its
// output is stored: one horizontal add per row and key block cost a 4k prompt's attention 5-9%.
constexpr int64_t kSumLanes = 16;

// The softmax runs in base 2, e^x = 2^(x log2 e), the scale folded into the factor: one FMA per
// score (score x scale log2 e - m) feeds exp2_512.
constexpr float kLog2e = 1.44269504088896341f;

// A row's reference max moves only when a block's max passes it by more than this many powers of
// two (FlashAttention-4's lazy rescale): probabilities then reach at most 2^8, far inside float32
// and bf16 range, and a row's accumulators are rescaled a few times per prompt, not at every block
// whose max grows a little. Rounding is unchanged: bf16 keeps 8 bits relative to any reference.
constexpr float kLazyRescale = 8.f;

// 2^t on 16 floats: t = n + f, |f| <= 1/2 (vreduceps gives f = t - round(t) in one instruction,
// exactly; roundscale and a subtraction took two), 2^f by a degree-3 polynomial fitted (minimax,
// relative) on [-1/2, 1/2], then scaled by 2^n (scalef). Relative error 7.5e-5: every probability
// is rounded to bf16 next (up to 2^-9 = 2.0e-3), 26x coarser, and the row sums' error stays far
// below the output's own bf16 rounding. Degree 5 (2.3e-7, exp512's) made the 4k prompt's
// attention 4-5% slower. t = -inf gives NaN (f = -inf - -inf): callers clamp masked scores first
// (a large negative n gives 0, flushed: attend_bf16 runs with flush-to-zero).
inline __m512 exp2_512(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(t, f);
  __m512 p = _mm512_set1_ps(5.517134443e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.426103354e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932609677e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999281168e-1f));
  return _mm512_scalef_ps(p, n);
}

// One row's probabilities over nk keys (a multiple of 16): p = 2^(s c - m) rounded to bf16 (two
// vectors per convert), returning their float32 sum in 16 lanes. Clamp: the block has masked (-inf) scores,
// lifted to -256 so that exp2_512 never sees -inf (2^-256 flushes to 0: attend_bf16 runs with
// flush-to-zero).
template <bool Clamp>
inline __m512 exp_row_bf16(Bits* p, const float* s, int64_t nk, float c, float m) {
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(m), floor = _mm512_set1_ps(-256.f);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= nk; j += 32) {
    __m512 t0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, mv);
    __m512 t1 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), cv, mv);
    if constexpr (Clamp) {
      t0 = _mm512_max_ps(t0, floor);
      t1 = _mm512_max_ps(t1, floor);
    }
    const __m512 e0 = exp2_512(t0), e1 = exp2_512(t1);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(p + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
  if (j < nk) {  // 16 keys left (the vdpbf16ps path's panels)
    __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, mv);
    if constexpr (Clamp) t = _mm512_max_ps(t, floor);
    const __m512 e = exp2_512(t);
    sum0 = _mm512_add_ps(sum0, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_add_ps(sum0, sum1);
}

// One row of the online softmax over one key block: nk scores sr (a multiple of 16) times the
// scale (torch's order: scale, then cap and mask; without a cap the scale is folded into the
// exponent's factor, scale > 0 commuting with the max), masked keys -inf, become probabilities
// rounded to bf16 in pr (the row sum l, in kSumLanes lanes, adds them unrounded, as torch's flash
// attention does). When the block's max passes the row's reference max m by more than
// kLazyRescale, m moves there and l is rescaled; the return value is that factor, which the
// caller applies to the row's accumulators (1: m held). A row with every key of the block masked keeps its state (p all 0).
inline float softmax_row_bf16(float* sr, Bits* pr, int64_t nk, float scale, float soft_cap, bool masked, int64_t pos,
                              int64_t k0, int64_t window, float& m, float* l) {
  float c = scale * kLog2e;
  if (soft_cap > 0.f) {  // the cap needs scaled scores
    for (int64_t j = 0; j < nk; ++j) sr[j] *= scale;
    c = kLog2e;
  }
  if (soft_cap > 0.f || masked) cap_and_mask_row(sr, nk, soft_cap, masked, pos, k0, window);
  __m512 mx0 = _mm512_loadu_ps(sr), mx1 = mx0;
  int64_t j = 16;
  for (; j + 32 <= nk; j += 32) {
    mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(sr + j));
    mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(sr + j + 16));
  }
  if (j < nk) mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(sr + j));
  const __m512 mx = _mm512_max_ps(mx0, mx1);
  float alpha = 1.f;
  // The horizontal max only where m may move: a row's first visible block (m -inf), or a lane
  // past m + kLazyRescale. (A block wholly masked after m is set needs no test: its -inf
  // scores are clamped and flushed to 0 below.)
  if (m == -INFINITY ||
      _mm512_cmp_ps_mask(_mm512_mul_ps(mx, _mm512_set1_ps(c)), _mm512_set1_ps(m + kLazyRescale), _CMP_GT_OQ)) {
    const float block_max = _mm512_reduce_max_ps(mx);
    if (block_max == -INFINITY) {  // no visible key yet
      std::fill(pr, pr + nk, Bits{0});
      return 1.f;
    }
    const float m_block = block_max * c;
    if (m != -INFINITY) {
      alpha = std::exp2(m - m_block);
      _mm512_storeu_ps(l, _mm512_mul_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha)));
    }
    m = m_block;
  }
  const __m512 e = masked ? exp_row_bf16<true>(pr, sr, nk, c, m) : exp_row_bf16<false>(pr, sr, nk, c, m);
  _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), e));
  return alpha;
}

// o[0..d) *= alpha (nothing to do where alpha is 1, the common case).
inline void rescale_row(float* o, float alpha, int64_t d) {
  if (alpha == 1.f) return;
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t x = 0; x < d; x += 16) _mm512_storeu_ps(o + x, _mm512_mul_ps(_mm512_loadu_ps(o + x), a));
}

// A bf16 work item's output rows: o / l, rounded to bf16 once.
inline void store_rows_bf16(c10::BFloat16* out, const float* o, const float* l, const Chunk& c, int64_t h,
                            int64_t i0, int64_t rows, int64_t group, int64_t heads, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + kSumLanes * r)));
    c10::BFloat16* dst = out + (c.query_start + i0 + r / group) * heads * d + (h * group + r % group) * d;
    for (int64_t x = 0; x < d; x += 16) store16(dst + x, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + x), inv));
  }
}

// The G query heads of each of a bf16 work item's nq tokens, as adjacent rows of dst (d values
// each): the rows both bf16 paths multiply.
inline void gather_group_queries(Bits* dst, const c10::BFloat16* q, int64_t q_stride, const Chunk& c, int64_t h,
                                 int64_t i0, int64_t nq, int64_t group, int64_t d) {
  for (int64_t i = 0; i < nq; ++i)
    std::memcpy(dst + i * group * d, q + (c.query_start + i0 + i) * q_stride + h * group * d, group * d * sizeof(Bits));
}

// Where a bf16 work item reads: its first and last query positions, its KV head's packed keys
// and values, and the keys its queries see.
struct ItemKeys {
  int64_t first_pos, last_pos;
  const Bits* k;
  const Bits* v;
  KeyRange keys;
};

// A bf16 work item's start on either path's workspace (its q rows already sized): every row's
// running max and sum reset, its queries gathered; returns where it reads.
template <typename Workspace>
ItemKeys begin_item(Workspace& ws, int64_t rows, const c10::BFloat16* q, int64_t q_stride, const Chunk& c, int64_t h,
                    int64_t i0, int64_t nq, int64_t group, int64_t d, const Bits* k_packed, const Bits* v_packed,
                    int64_t window) {
  ws.m.assign(rows, -INFINITY);
  ws.l.assign(rows * kSumLanes, 0.f);
  gather_group_queries(ws.q.data(), q, q_stride, c, h, i0, nq, group, d);
  const int64_t first_pos = c.context_len - c.query_len + i0, last_pos = first_pos + nq - 1;
  return {first_pos, last_pos, k_packed + c.pack_offset + h * c.packed_keys * d,
          v_packed + c.pack_offset + h * c.packed_keys * d, visible_keys(c, first_pos, last_pos, window)};
}

// attend_tile's bf16 form on vdpbf16ps register tiles (head_dim a multiple of 16): the same work
// item, key range, masks and online softmax, on bf16 panels, in key tiles of kKeyTile.
void attend_tile_bf16(c10::BFloat16* out, const c10::BFloat16* q, int64_t q_stride, const Chunk& c, int64_t h,
                      int64_t i0, int64_t nq, int64_t group, int64_t heads, int64_t d, const Bits* k_packed,
                      const Bits* v_packed, float scale, int64_t window, float soft_cap, WorkspaceBf16& ws) {
  const int64_t rows = nq * group;
  ws.q.resize(rows * d);
  ws.o.assign(rows * d, 0.f);
  ws.s.resize(rows * kKeyTile);
  ws.p.resize(rows * kKeyTile);
  const auto [first_pos, last_pos, kh, vh, keys] = begin_item(ws, rows, q, q_stride, c, h, i0, nq, group, d,
                                                              k_packed, v_packed, window);
  for (int64_t k0 = keys.begin; k0 < keys.end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, keys.end - k0);
    qk_tile_bf16(ws.s.data(), ws.q.data(), kh + (k0 - c.key_lo) * d, rows, nk, d);
    const bool masked = tile_crosses_an_edge(k0, nk, first_pos, last_pos, window);
    for (int64_t r = 0; r < rows; ++r) {
      const float alpha = softmax_row_bf16(ws.s.data() + r * kKeyTile, ws.p.data() + r * kKeyTile, nk, scale,
                                           soft_cap, masked, first_pos + r / group, k0, window, ws.m[r],
                                           ws.l.data() + kSumLanes * r);
      rescale_row(ws.o.data() + r * d, alpha, d);
    }
    pv_tile_bf16(ws.o.data(), ws.p.data(), vh + (k0 - c.key_lo) * d, rows, nk, d);
  }
  store_rows_bf16(out, ws.o.data(), ws.l.data(), c, h, i0, rows, group, heads, d);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
// ---- AMX tiles for the bf16 path (the amx variant) ----
// _tile_dpbf16ps multiplies a 16 x 32 bf16 A tile by a 32 x 16 B tile held as 16 rows of pairs
// (the layout the packed K panels and V pairs already have) into a 16 x 16 float32 C tile, 16x
// the work of one vdpbf16ps: Q K^T is one row block of 16 q rows x 32 dims (A) times a panel's 16
// dim pairs x 16 keys (B); P V one block of 16 probability rows x 32 keys (A) times 16 key pairs
// x 16 dims (B). Keys are packed in runs of 32 (kAmxKeys), the depth of one product.
#define TPSERVE_PREFILL_AMX 1
constexpr int64_t kAmxKeys = 32;

// Keys per softmax step on AMX: each row's max, horizontal sums and reference-max check, and each
// row block's accumulator tile loads and stores, happen once per block. 128: the block's K and V
// panels (16 KB each) and one row block's scores and probabilities (12 KB) fit L1 together, so
// the work item's later row blocks read K and V from L1 (measured against 64, 96 and 256 keys:
// each 4-12% slower on a 2,048-token chunk after 4,096 cached).
constexpr int64_t kAmxBlock = 128;

using tpserve::amx_usable;

// Palette 1, every tile 16 rows x 64 bytes: tmm0-3 C, tmm4 and tmm7 A, tmm5-6 B (alternated, so
// a load need not wait for the product before it to read its tile).
struct alignas(64) AmxConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_amx() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  // GCC 12 does not see ldtilecfg read the struct and sank the stores above past it (the
  // tiles then fault as unconfigured): a compiler barrier keeps them before.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Scores of one 16-row block against nk keys (a multiple of 32) into s (row stride ld floats).
// head_dim 32 or 64: the block's queries stay in A tiles 4 and 7 for all nk keys, and the keys go
// 32 at a time into C tiles 0-1 and 2-3 alternately, so that one pair's stores overlap the other's
// products. (A tile reloaded while products still read it stalls until they finish: 3x slower.)
template <int X>
inline void qk_resident_amx(float* s, int64_t ld, const Bits* q, const Bits* panels, int64_t nk) {
  constexpr int64_t d = 32 * X, panel = d * kPanel;
  const int64_t stride = ld * sizeof(float);
  _tile_loadd(4, q, d * sizeof(Bits));
  if constexpr (X == 2) _tile_loadd(7, q + 32, d * sizeof(Bits));
  for (int64_t j = 0; j < nk; j += 64) {
    const Bits* pj = panels + j * d;  // the panel of keys j..j+15: [D/2][16][2]
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(5, pj, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, pj + panel, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (X == 2) {
      _tile_loadd(5, pj + 32 * kPanel, 64);  // dims 32..63
      _tile_dpbf16ps(0, 7, 5);
      _tile_loadd(6, pj + panel + 32 * kPanel, 64);
      _tile_dpbf16ps(1, 7, 6);
    }
    _tile_stored(0, s + j, stride);
    _tile_stored(1, s + j + 16, stride);
    if (nk - j <= kAmxKeys) break;
    const Bits* pk = pj + 2 * panel;
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(5, pk, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, pk + panel, 64);
    _tile_dpbf16ps(3, 4, 6);
    if constexpr (X == 2) {
      _tile_loadd(5, pk + 32 * kPanel, 64);
      _tile_dpbf16ps(2, 7, 5);
      _tile_loadd(6, pk + panel + 32 * kPanel, 64);
      _tile_dpbf16ps(3, 7, 6);
    }
    _tile_stored(2, s + j + 32, stride);
    _tile_stored(3, s + j + 48, stride);
  }
}

// The same for any head_dim a multiple of 32: 64 keys (four C tiles) at a time, the queries
// reloaded per 32 dims (only tiles 4 and 7 are free for them).
inline void qk_block_amx(float* s, int64_t ld, const Bits* q, const Bits* panels, int64_t nk, int64_t d) {
  if (d == 64) return qk_resident_amx<2>(s, ld, q, panels, nk);
  if (d == 32) return qk_resident_amx<1>(s, ld, q, panels, nk);
  const int64_t panel = d * kPanel;  // elements per packed panel
  const int64_t stride = ld * sizeof(float);
  for (int64_t j = 0; j < nk; j += 64) {
    const bool four = nk - j > kAmxKeys;
    const Bits* pj = panels + j * d;  // the panel of keys j..j+15
    _tile_zero(0);
    _tile_zero(1);
    if (four) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t x = 0; x < d; x += 32) {
      _tile_loadd(4, q + x, d * sizeof(Bits));
      const Bits* b = pj + x * kPanel;  // dim pairs x/2.. of the first panel
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + panel, 64);
      _tile_dpbf16ps(1, 4, 6);
      if (four) {
        _tile_loadd(5, b + 2 * panel, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b + 3 * panel, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, s + j, stride);
    _tile_stored(1, s + j + 16, stride);
    if (four) {
      _tile_stored(2, s + j + 32, stride);
      _tile_stored(3, s + j + 48, stride);
    }
  }
}

// o += P V for one 16-row block: nk keys (a multiple of 32) of probabilities p (row stride ld)
// times the V pairs; o's rows (stride d) in 64-dim runs of four C tiles, loaded and stored once
// per key block (head_dim a multiple of 32). The probabilities of alternate 32-key steps go to A
// tiles 4 and 7, so a step's load need not wait for the products of the step before.
inline void pv_block_amx(float* o, const Bits* p, int64_t ld, const Bits* v, int64_t nk, int64_t d) {
  const int64_t o_stride = d * sizeof(float), v_stride = 2 * d * sizeof(Bits), p_stride = ld * sizeof(Bits);
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const bool four = d - c0 >= 64;
    _tile_loadd(0, o + c0, o_stride);
    _tile_loadd(1, o + c0 + 16, o_stride);
    if (four) {
      _tile_loadd(2, o + c0 + 32, o_stride);
      _tile_loadd(3, o + c0 + 48, o_stride);
    }
// One run of 32 keys: the probabilities in A tile `a` times the V pairs at b into C tiles 0-1 (0-3
// when four). A macro: the tile intrinsics take literal tile numbers.
#define TPSERVE_PV_RUN(a, b)                 \
  _tile_loadd(5, b, v_stride);               \
  _tile_dpbf16ps(0, a, 5);                   \
  _tile_loadd(6, (b) + 32, v_stride);        \
  _tile_dpbf16ps(1, a, 6);                   \
  if (four) {                                \
    _tile_loadd(5, (b) + 64, v_stride);      \
    _tile_dpbf16ps(2, a, 5);                 \
    _tile_loadd(6, (b) + 96, v_stride);      \
    _tile_dpbf16ps(3, a, 6);                 \
  }
    for (int64_t k = 0; k < nk; k += 2 * kAmxKeys) {
      _tile_loadd(4, p + k, p_stride);
      const Bits* b = v + k * d + 2 * c0;  // key pairs k/2.., dims c0..
      TPSERVE_PV_RUN(4, b)
      if (nk - k <= kAmxKeys) break;
      _tile_loadd(7, p + k + kAmxKeys, p_stride);
      b += kAmxKeys * d;  // the next 16 key pairs
      TPSERVE_PV_RUN(7, b)
    }
#undef TPSERVE_PV_RUN
    _tile_stored(0, o + c0, o_stride);
    _tile_stored(1, o + c0 + 16, o_stride);
    if (four) {
      _tile_stored(2, o + c0 + 32, o_stride);
      _tile_stored(3, o + c0 + 48, o_stride);
    }
  }
}

// Per-thread buffers of one AMX work item. Rows are padded to a multiple of kAmxRows (the tiles'
// height): padded rows are zero queries whose results are dropped.
struct WorkspaceAmx {
  std::vector<Bits> q;   // [R, D] the tile's queries (bf16 bits, unscaled)
  std::vector<float> o;  // [R, D] output accumulators, not yet divided by the row sums
  std::vector<float> s;  // [16, kAmxBlock] one row block's scores of one key block
  std::vector<Bits> p;   // [16, kAmxBlock] their probabilities, rounded to bf16
  std::vector<float> m;  // [R] each row's reference max, in base-2 units (score x scale x log2 e)
  std::vector<float> l;  // [R, kSumLanes] running sums of each row's 2^(score x scale x log2 e - m)
};

// attend_tile's form on AMX tiles (head_dim a multiple of 32, keys aligned to kAmxKeys): per key
// block of kAmxBlock keys, per 16-row block, Q K^T, the softmax and P V back to back: the scores
// and probabilities take one row block's room (12 KB), leaving L1 to the block's K and V panels,
// which the next row block reads again. (Every row block's Q K^T, then all rows' softmax, then
// every row block's P V ran as fast, within the shared machine's noise; issuing the tile work of
// the next and previous row blocks between this one's softmax rows, so that the tile unit and the
// vector units overlap, ran no faster, mostly 10-40% slower.)
void attend_tile_amx(c10::BFloat16* out, const c10::BFloat16* q, int64_t q_stride, const Chunk& c, int64_t h,
                     int64_t i0, int64_t nq, int64_t group, int64_t heads, int64_t d, const Bits* k_packed,
                     const Bits* v_packed, float scale, int64_t window, float soft_cap, WorkspaceAmx& ws) {
  const int64_t rows = nq * group, padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  ws.q.assign(padded * d, Bits{0});
  ws.o.assign(padded * d, 0.f);
  ws.s.resize(kAmxRows * kAmxBlock);
  ws.p.resize(kAmxRows * kAmxBlock);
  const auto [first_pos, last_pos, kh, vh, keys] = begin_item(ws, rows, q, q_stride, c, h, i0, nq, group, d,
                                                              k_packed, v_packed, window);
  for (int64_t k0 = keys.begin; k0 < keys.end; k0 += kAmxBlock) {
    const int64_t nk = std::min(kAmxBlock, keys.end - k0);
    const Bits* panels = kh + (k0 - c.key_lo) * d;
    const Bits* values = vh + (k0 - c.key_lo) * d;
    const bool masked = tile_crosses_an_edge(k0, nk, first_pos, last_pos, window);
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
      qk_block_amx(ws.s.data(), kAmxBlock, ws.q.data() + r0 * d, panels, nk, d);
      const int64_t live = std::min(kAmxRows, rows - r0);  // rows of the block that are not padding
      for (int64_t r = 0; r < live; ++r) {
        const float alpha =
            softmax_row_bf16(ws.s.data() + r * kAmxBlock, ws.p.data() + r * kAmxBlock, nk, scale, soft_cap, masked,
                             first_pos + (r0 + r) / group, k0, window, ws.m[r0 + r], ws.l.data() + kSumLanes * (r0 + r));
        rescale_row(ws.o.data() + (r0 + r) * d, alpha, d);
      }
      if (live < kAmxRows) std::fill(ws.p.data() + live * kAmxBlock, ws.p.data() + kAmxRows * kAmxBlock, Bits{0});
      pv_block_amx(ws.o.data() + r0 * d, ws.p.data(), kAmxBlock, values, nk, d);
    }
  }
  store_rows_bf16(out, ws.o.data(), ws.l.data(), c, h, i0, rows, group, heads, d);
}
#endif  // AMX

// A bf16 row of d values at src (the cache's bits), or zeros where src is null (a key past the
// context: always masked, but its bits must not be NaN, which 0 * NaN would leave in P V).
inline __m512i widen_bits(const Bits* src, int64_t x) {
  return src ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x)))
             : _mm512_setzero_si512();
}

// pack_panel's bf16 form: K of keys [first, first + kPanel) as [D/2][kPanel][2], V as kPanel / 2
// key pairs of [D][2]; keys past the context are zeros. rows: the keys' offsets in the caches.
inline void pack_panel_bf16(Bits* k_dst, Bits* v_dst, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                            const std::vector<int64_t>& rows, int64_t d) {
  const int64_t n = static_cast<int64_t>(rows.size());
  uint32_t* k_pairs = reinterpret_cast<uint32_t*>(k_dst);
  for (int64_t j = 0; j < kPanel; ++j) {
    const Bits* kr = j < n ? reinterpret_cast<const Bits*>(k_cache + rows[j]) : nullptr;
    for (int64_t i = 0; i < d / 2; ++i) {
      uint32_t pair = 0;
      if (kr) std::memcpy(&pair, kr + 2 * i, sizeof(pair));
      k_pairs[i * kPanel + j] = pair;
    }
  }
  for (int64_t t = 0; t < kPanel / 2; ++t) {
    const Bits* a = 2 * t < n ? reinterpret_cast<const Bits*>(v_cache + rows[2 * t]) : nullptr;
    const Bits* b = 2 * t + 1 < n ? reinterpret_cast<const Bits*>(v_cache + rows[2 * t + 1]) : nullptr;
    for (int64_t x = 0; x < d; x += 16)
      _mm512_storeu_si512(v_dst + t * 2 * d + 2 * x,
                          _mm512_or_si512(widen_bits(a, x), _mm512_slli_epi32(widen_bits(b, x), 16)));
  }
}
#endif  // __AVX512F__ && __AVX512BF16__

// A step's chunks, checked and placed in the packed buffers, and the two passes' work lists.
struct StepPlan {
  std::vector<Chunk> chunks;
  int64_t packed_elements = 0;                // elements of each packed buffer (K and V)
  std::vector<std::array<int64_t, 3>> panels;  // pre-pass work items: (chunk, KV head, panel)
  std::vector<std::array<int64_t, 3>> items;   // attention work items: (chunk, KV head, query tile)
};

StepPlan plan_step(const at::Tensor& chunks, int64_t tokens, int64_t block_size, int64_t width, int64_t kv_heads,
                   int64_t d, int64_t sliding_window, int64_t key_align) {
  StepPlan plan;
  const int32_t* info = chunks.data_ptr<int32_t>();
  plan.chunks.resize(chunks.size(0));
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    Chunk& c = plan.chunks[i];
    c.query_start = info[3 * i];
    c.query_len = info[3 * i + 1];
    c.context_len = info[3 * i + 2];
    TORCH_CHECK(c.query_len >= 1 && c.query_start >= 0 && c.query_start + c.query_len <= tokens &&
                    c.query_len <= c.context_len && (c.context_len + block_size - 1) / block_size <= width,
                "a chunk outside the step's tokens or longer than its block table");
    const int64_t first_pos = c.context_len - c.query_len;
    c.key_align = key_align;
    c.key_lo = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) / key_align * key_align : 0;
    c.packed_keys = (c.context_len - c.key_lo + key_align - 1) / key_align * key_align;
    c.pack_offset = plan.packed_elements;
    plan.packed_elements += kv_heads * c.packed_keys * d;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t p = 0; p < c.packed_keys / kPanel; ++p) plan.panels.push_back({static_cast<int64_t>(i), h, p});
  }
  // Each chunk's tiles taken first, last, second, second-last...: a causal tile's cost grows with
  // its position, and the threads split the list into equal runs, so each run gets equal work.
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const int64_t tiles = (plan.chunks[i].query_len + kQueryTile - 1) / kQueryTile;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t a = 0, b = tiles - 1; a <= b; ++a, --b) {
        plan.items.push_back({static_cast<int64_t>(i), h, a});
        if (b != a) plan.items.push_back({static_cast<int64_t>(i), h, b});
      }
  }
  return plan;
}

// Where the pre-pass reads and writes: the caches, their strides, the block tables.
template <typename T, typename Index>
struct CacheView {
  const T* k;             // K cache
  const T* v;             // V cache
  CacheStrides strides;   // element strides of both caches
  const Index* tables;    // [C, width] block tables
  int64_t width;          // block table columns
  int64_t block_size;     // tokens per block
};

// The pre-pass: every panel of every (chunk, KV head), packed by pack(k_dst, v_dst, rows) where
// rows are the panel's keys' offsets in the caches.
template <typename T, typename Index, typename Pack>
void pack_panels(const StepPlan& plan, const CacheView<T, Index>& cache, int64_t d, Pack&& pack) {
  at::parallel_for(0, static_cast<int64_t>(plan.panels.size()), 8, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t n = begin; n < end; ++n) {
      const auto [i, h, p] = plan.panels[n];
      const Chunk& c = plan.chunks[i];
      const int64_t first = c.key_lo + p * kPanel;
      // A panel wholly past the context (keys aligned to more than a panel) packs zeros.
      if (first < c.context_len)
        context_rows(rows, cache.tables + i * cache.width, first, std::min(first + kPanel, c.context_len),
                     cache.block_size, cache.strides, h);
      else
        rows.clear();
      pack(c.pack_offset + (h * c.packed_keys + p * kPanel) * d, rows);
    }
  });
}

// The float32 path (float32 steps, and bf16 ones on builds without AVX512-BF16): caches widened
// to float32 panels, float32 tiles.
template <typename T, typename Index>
void attend_float32(const StepPlan& plan, const CacheView<T, Index>& cache, T* out, const T* q, int64_t q_stride,
                    int64_t heads, int64_t kv_heads, int64_t d, float scale, int64_t window, float soft_cap) {
  // Uninitialized (every float is written by the pre-pass, padding included): a zero fill of
  // both buffers would be one more pass over them per layer.
  const std::unique_ptr<float[]> k_packed(new float[plan.packed_elements]), v_packed(new float[plan.packed_elements]);
  pack_panels(plan, cache, d, [&](int64_t offset, const std::vector<int64_t>& rows) {
    pack_panel(k_packed.get() + offset, v_packed.get() + offset, cache.k, cache.v, rows, d);
  });
  // The register tiles walk the head in 16-float slices (pv_tile); other head sizes take the loops.
  const bool vector_tiles = d % 16 == 0;
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, static_cast<int64_t>(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    for (int64_t n = begin; n < end; ++n) {
      const auto [i, h, tile] = plan.items[n];
      const Chunk& c = plan.chunks[i];
      const int64_t i0 = tile * kQueryTile;
      attend_tile(out, q, q_stride, c, h, i0, std::min(kQueryTile, c.query_len - i0), group, heads, d,
                  k_packed.get(), v_packed.get(), kv_heads, scale, window, soft_cap, vector_tiles, ws);
    }
  });
}

#if defined(TPSERVE_PREFILL_BF16)
// The bf16 path: panels of the cache's bf16 bits, AMX tiles where plan_step aligned the keys for
// them (uses_amx_tiles), else vdpbf16ps register tiles (head_dim a multiple of 16).
template <typename Index>
void attend_bf16(const StepPlan& plan, const CacheView<c10::BFloat16, Index>& cache, c10::BFloat16* out,
                 const c10::BFloat16* q, int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                 int64_t window, float soft_cap) {
  const std::unique_ptr<Bits[]> k_packed(new Bits[plan.packed_elements]), v_packed(new Bits[plan.packed_elements]);
  pack_panels(plan, cache, d, [&](int64_t offset, const std::vector<int64_t>& rows) {
    pack_panel_bf16(k_packed.get() + offset, v_packed.get() + offset, cache.k, cache.v, rows, d);
  });
  const int64_t group = heads / kv_heads;
  auto run = [&](auto amx) {
    at::parallel_for(0, static_cast<int64_t>(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
#if defined(TPSERVE_PREFILL_AMX)
      if constexpr (decltype(amx)::value) configure_amx();  // tile state is per thread
      WorkspaceAmx wa;
#endif
      // Flush-to-zero for the softmax's float math: a probability below 2^-126 (a key far below
      // its row's max, or a masked one) is 0 rather than a denormal, each of which costs a
      // microcode assist (the 1,024-token prompt ran 1.3x slower with them); torch's exp also
      // returns 0 below the smallest normal. Restored before the thread leaves.
      const unsigned int csr = _mm_getcsr();
      _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
      WorkspaceBf16 ws;
      for (int64_t n = begin; n < end; ++n) {
        const auto [i, h, tile] = plan.items[n];
        const Chunk& c = plan.chunks[i];
        const int64_t i0 = tile * kQueryTile, nq = std::min(kQueryTile, c.query_len - i0);
#if defined(TPSERVE_PREFILL_AMX)
        if constexpr (decltype(amx)::value) {
          attend_tile_amx(out, q, q_stride, c, h, i0, nq, group, heads, d, k_packed.get(), v_packed.get(), scale,
                          window, soft_cap, wa);
          continue;
        }
#endif
        attend_tile_bf16(out, q, q_stride, c, h, i0, nq, group, heads, d, k_packed.get(), v_packed.get(), scale,
                         window, soft_cap, ws);
      }
      _mm_setcsr(csr);
#if defined(TPSERVE_PREFILL_AMX)
      if constexpr (decltype(amx)::value) _tile_release();
#endif
    });
  };
#if defined(TPSERVE_PREFILL_AMX)
  if (plan.chunks.empty() || plan.chunks[0].key_align == kAmxKeys) return run(std::true_type{});
#endif
  run(std::false_type{});
}
#endif

// The bf16 tiles for bf16 steps where the build has them (head_dim a multiple of 16), the float32
// tiles otherwise.
template <typename T, typename Index>
void attend_step(const StepPlan& plan, const CacheView<T, Index>& cache, T* out, const T* q, int64_t q_stride,
                 int64_t heads, int64_t kv_heads, int64_t d, float scale, int64_t window, float soft_cap) {
#if defined(TPSERVE_PREFILL_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d % 16 == 0) return attend_bf16(plan, cache, out, q, q_stride, heads, kv_heads, d, scale, window, soft_cap);
  }
#endif
  attend_float32(plan, cache, out, q, q_stride, heads, kv_heads, d, scale, window, soft_cap);
}

// Whether a step of q's dtype and head size runs on AMX tiles: bf16, head_dim a multiple of 32
// (an A tile row is 32 bf16), on the amx build, where Linux grants the tile state.
bool uses_amx_tiles(const at::Tensor& q) {
#if defined(TPSERVE_PREFILL_AMX)
  return q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 && amx_usable();
#else
  (void)q;
  return false;
#endif
}

// Which tiles a bf16 step with a head_dim of 64 runs on in this build and process: "amx" (the
// amx variant, where Linux grants the tile state), "avx512_bf16" (vdpbf16ps register tiles), or
// "float32" (widened to the float32 tiles). Python routes bf16 prefill to the kernel only on
// "amx", the one measured faster than torch's SDPA (workers/attention/paged.py).
std::string prefill_attention_bf16_path() {
#if defined(TPSERVE_PREFILL_AMX)
  if (amx_usable()) return "amx";
#endif
#if defined(TPSERVE_PREFILL_BF16)
  return "avx512_bf16";
#else
  return "float32";
#endif
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& chunks, double scale,
                             int64_t sliding_window, double soft_cap) {
  // out [T, H, D] contiguous; q [T, H, D] with contiguous heads; caches [num_blocks, block_size, KVH, D]
  // (any strides, rows contiguous);
  // block_tables [C, W]; chunks [C, 3] int32: query start, query length, context length.
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, H, D] with contiguous heads");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.sizes() == q.sizes(), "out: [T, H, D], contiguous");
  TORCH_CHECK(block_tables.is_contiguous());
  const CacheStrides strides = cache_strides(k_cache, v_cache);
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k_cache.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == q.scalar_type(), "q, out and the caches must share a dtype");
  TORCH_CHECK(chunks.scalar_type() == at::kInt && chunks.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 3,
              "chunks: [C, 3] int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == chunks.size(0), "block_tables: [C, W]");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes());
#if defined(TPSERVE_PREFILL_AMX)
  const int64_t key_align = uses_amx_tiles(q) ? kAmxKeys : kPanel;
#else
  const int64_t key_align = kPanel;
#endif
  const StepPlan plan = plan_step(chunks, tokens, block_size, width, kv_heads, d, sliding_window, key_align);
  AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_prefill_attention_check", [&] {
    // Every block a context reads must exist: a bad table would read outside the cache.
    const index_t* tables = block_tables.data_ptr<index_t>();
    for (size_t i = 0; i < plan.chunks.size(); ++i)
      for (int64_t b = 0; b < (plan.chunks[i].context_len + block_size - 1) / block_size; ++b)
        TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks, "block id out of range");
  });
  const float sc = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  TPSERVE_DISPATCH(q.scalar_type(), "paged_prefill_attention", [&] {
    AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_prefill_attention_index", [&] {
      const CacheView<scalar_t, index_t> cache{k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), strides,
                                               block_tables.data_ptr<index_t>(), width, block_size};
      attend_step(plan, cache, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0), heads, kv_heads, d, sc,
                  sliding_window, cap);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor chunks, float scale, int sliding_window, float soft_cap) -> ()",
        &paged_prefill_attention);
  m.def("prefill_attention_bf16_path() -> str", &prefill_attention_bf16_path);
}
