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
// tiles (6 rows x 16 dims). Float32 math throughout; bf16 caches are widened while packing.

#include "vec.h"

#include <array>
#include <memory>

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
  int64_t key_lo;       // first packed key (a multiple of kPanel; above 0 only with a window)
  int64_t packed_keys;  // keys packed from key_lo, rounded up to kPanel
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

// The register tiles over all rows: blocks of the widest tile, then one call for the rest.
inline void qk_tile(float* s, const float* q, const float* panels, int64_t rows, int64_t nk, int64_t d) {
  for (int64_t p = 0; p < nk / kPanel; ++p) {
    const float* panel = panels + p * d * kPanel;
    float* sp = s + p * kPanel;
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) qk_rows<6>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d);
    switch (rows - r) {
      case 5: qk_rows<5>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d); break;
      case 4: qk_rows<4>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d); break;
      case 3: qk_rows<3>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d); break;
      case 2: qk_rows<2>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d); break;
      case 1: qk_rows<1>(sp + r * kKeyTile, kKeyTile, q + r * d, panel, d); break;
      default: break;
    }
  }
}

inline void pv_tile(float* o, const float* p, const float* alpha, const float* v, int64_t rows, int64_t nk,
                    int64_t d) {
  for (int64_t c = 0; c < d; c += 16) {
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) pv_rows<6>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c);
    switch (rows - r) {
      case 5: pv_rows<5>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c); break;
      case 4: pv_rows<4>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c); break;
      case 3: pv_rows<3>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c); break;
      case 2: pv_rows<2>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c); break;
      case 1: pv_rows<1>(o + r * d, p + r * kKeyTile, kKeyTile, alpha + r, v, nk, d, c); break;
      default: break;
    }
  }
}
#endif  // TPSERVE_AVX2

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
#if defined(TPSERVE_AVX2)
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= nk; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  tile_max = hmax8(mx);
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
  sum = hsum8(sv);
#endif
  for (; j < nk; ++j) {
    s[j] = s[j] == -INFINITY ? 0.f : std::exp(s[j] - m_new);
    sum += s[j];
  }
  m = m_new;
  l = l * alpha + sum;
  return alpha;
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
  // Keys this tile can see: from its first row's window start (panel-aligned) to its last row.
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t key_begin = std::max(c.key_lo, lo / kPanel * kPanel);
  const int64_t key_end = (last_pos + 1 + kPanel - 1) / kPanel * kPanel;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, key_end - k0);
    const float* panels = kh + (k0 - c.key_lo) * d;
    const float* values = vh + (k0 - c.key_lo) * d;
#if defined(TPSERVE_AVX2)
    if (vector_tiles)
      qk_tile(ws.s.data(), ws.q.data(), panels, rows, nk, d);
    else
#endif
      qk_tile_portable(ws.s.data(), ws.q.data(), panels, rows, nk, d);
    // A tile crosses an edge when a key lies past the first row's position (causal) or before
    // the last row's window start.
    const bool masked = k0 + nk - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = ws.s.data() + r * kKeyTile;
      if (soft_cap > 0.f)
        for (int64_t j = 0; j < nk; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
      if (masked) {
        const int64_t pos = first_pos + r / group;
        // Visible keys: (pos - window, pos], in this tile's coordinates.
        const int64_t vis_hi = std::min<int64_t>(nk, pos - k0 + 1);
        const int64_t vis_lo = window > 0 ? std::clamp<int64_t>(pos - window + 1 - k0, 0, nk) : 0;
        for (int64_t j = 0; j < std::min(vis_lo, nk); ++j) sr[j] = -INFINITY;
        for (int64_t j = std::max<int64_t>(vis_hi, 0); j < nk; ++j) sr[j] = -INFINITY;
      }
      ws.alpha[r] = softmax_tile_row(sr, nk, ws.m[r], ws.l[r]);
    }
#if defined(TPSERVE_AVX2)
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
  const int64_t group = heads / kv_heads;
  const int32_t* info = chunks.data_ptr<int32_t>();
  std::vector<Chunk> cs(chunks.size(0));
  int64_t packed_floats = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    Chunk& c = cs[i];
    c.query_start = info[3 * i];
    c.query_len = info[3 * i + 1];
    c.context_len = info[3 * i + 2];
    TORCH_CHECK(c.query_len >= 1 && c.query_start >= 0 && c.query_start + c.query_len <= tokens &&
                    c.query_len <= c.context_len && (c.context_len + block_size - 1) / block_size <= width,
                "a chunk outside the step's tokens or longer than its block table");
    const int64_t first_pos = c.context_len - c.query_len;
    c.key_lo = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) / kPanel * kPanel : 0;
    c.packed_keys = (c.context_len - c.key_lo + kPanel - 1) / kPanel * kPanel;
    c.pack_offset = packed_floats;
    packed_floats += kv_heads * c.packed_keys * d;
  }
  AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_prefill_attention_check", [&] {
    // Every block a context reads must exist: a bad table would read outside the cache.
    const index_t* tables = block_tables.data_ptr<index_t>();
    for (size_t i = 0; i < cs.size(); ++i)
      for (int64_t b = 0; b < (cs[i].context_len + block_size - 1) / block_size; ++b)
        TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks, "block id out of range");
  });
  // Uninitialized (every float is written by the pre-pass, padding included): a zero fill of
  // both buffers would be one more pass over them per layer.
  const std::unique_ptr<float[]> k_packed(new float[packed_floats]), v_packed(new float[packed_floats]);
  // Work items of the pre-pass: (chunk, KV head, panel).
  std::vector<std::array<int64_t, 3>> panels;
  for (size_t i = 0; i < cs.size(); ++i)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t p = 0; p < cs[i].packed_keys / kPanel; ++p) panels.push_back({static_cast<int64_t>(i), h, p});
  // Work items of the attention: (chunk, KV head, query tile), each chunk's tiles taken first,
  // last, second, second-last...: a causal tile's cost grows with its position, and the threads
  // split the list into equal runs, so each run gets equal work.
  std::vector<std::array<int64_t, 3>> items;
  for (size_t i = 0; i < cs.size(); ++i) {
    const int64_t tiles = (cs[i].query_len + kQueryTile - 1) / kQueryTile;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t a = 0, b = tiles - 1; a <= b; ++a, --b) {
        items.push_back({static_cast<int64_t>(i), h, a});
        if (b != a) items.push_back({static_cast<int64_t>(i), h, b});
      }
  }
  // The register tiles walk the head in 16-float slices (pv_tile); other head sizes take the loops.
  const bool vector_tiles = d % 16 == 0;
  TPSERVE_DISPATCH(q.scalar_type(), "paged_prefill_attention", [&] {
    AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_prefill_attention_index", [&] {
      const scalar_t* kc = k_cache.data_ptr<scalar_t>();
      const scalar_t* vc = v_cache.data_ptr<scalar_t>();
      const index_t* tables = block_tables.data_ptr<index_t>();
      at::parallel_for(0, static_cast<int64_t>(panels.size()), 8, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> rows;
        for (int64_t n = begin; n < end; ++n) {
          const auto [i, h, p] = panels[n];
          const Chunk& c = cs[i];
          const int64_t first = c.key_lo + p * kPanel;
          context_rows(rows, tables + i * width, first, std::min(first + kPanel, c.context_len), block_size,
                       strides, h);
          const int64_t offset = c.pack_offset + (h * c.packed_keys + p * kPanel) * d;
          pack_panel(k_packed.get() + offset, v_packed.get() + offset, kc, vc, rows, d);
        }
      });
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        Workspace ws;
        for (int64_t n = begin; n < end; ++n) {
          const auto [i, h, tile] = items[n];
          const int64_t i0 = tile * kQueryTile;
          attend_tile(op, qp, q.stride(0), cs[i], h, i0, std::min(kQueryTile, cs[i].query_len - i0), group, heads,
                      d, k_packed.get(), v_packed.get(), kv_heads, static_cast<float>(scale), sliding_window,
                      static_cast<float>(soft_cap), vector_tiles, ws);
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor chunks, float scale, int sliding_window, float soft_cap) -> ()",
        &paged_prefill_attention);
}
