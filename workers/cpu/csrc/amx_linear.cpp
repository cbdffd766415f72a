// amx_linear: y = x W^T (+ bias) in bfloat16 on AMX tiles (Intel Sapphire Rapids and later), over
// a copy of W packed once into the tiles' VNNI layout (amx_pack_weight).
//
// Why: a decode step at up to a few dozen requests multiplies that many rows by every weight of
// the model, so it is bound by how fast the weights stream from memory. oneDNN's prepacked AMX
// GEMM (workers/cpu/linear.py) streamed the default model's projections and LM head (269 MB) at
// 7-11 GB/s on a 2-core Xeon where a plain read of the same bytes runs at ~15 GB/s; this kernel
// loads each weight tile from memory once per call, prefetched, and streams them at the read rate
// up to 16 rows (amx_linear_max_rows gives the figures and where it stops). It also
// replaces skinny_linear's bf16 loop: as fast at 1-4 rows, 1.4x at 8 (24.1 -> 17.0 ms), and one
// copy of the weights in AMX tile order replaces the plain one skinny_linear kept.
//
// Layout: packed[nb][kb] is one 16 x 64-byte B tile: rows are pairs of K (k = 32 kb + 2 p + j),
// each row 16 output columns (n = 16 nb + c) of two bf16 each, i.e. tile[p][2 c + j] =
// W[16 nb + c][32 kb + 2 p + j]; K is zero-padded to a multiple of 32. One n block's tiles are
// contiguous, so each task streams one run of memory.
//
// Loop: x is packed per call into A-tile order (pack_rows), so its tiles stream from L1/L2.
// - 1-2 rows: no tiles; vdpbf16ps over the same packed weights (vector_rows_linear).
// - Up to 16 rows: per 16 output columns (one n block) one C tile (tmm0) accumulates while each B
//   tile (tmm6) is loaded once: the weight stream is the whole cost.
// - More rows: two n blocks at a time (n_pair), two 16-row blocks per pass, four C tiles (tmm0-3),
//   A tiles tmm4-5, B tiles tmm6-7: each tile loaded feeds two products. The first pass streams
//   the weights from memory, later passes (rows 33 on) read the same 32 columns' tiles again from
//   L1/L2. Against one n block with four row blocks per pass (five tile loads per four products,
//   which this kernel did until 2026-12-05) the default model's 30 layers and LM head took 12.0
//   instead of 13.9 ms at 32 rows, 14.3 instead of 20.1 at 48 and 16.1 instead of 24.2 at 64
//   (2-core Xeon, weights on 2 MB pages, the two builds alternated, three runs each). An earlier
//   try of this blocking, with prefetches into L1 only, had measured 1.0-1.3x slower.
// Prefetch: each B tile's 16 lines are prefetched into L1 kPrefetchTiles ahead and into L2
// kPrefetchL2Tiles ahead: the hardware's streamer alone left the tile loads waiting on memory.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>

#include "amx_permission.h"
#define TPSERVE_AMX 1
#endif

namespace {

constexpr int64_t kTileRows = 16;  // rows of x per A / C tile, pairs of K per B tile
constexpr int64_t kTileK = 32;     // bf16 values of K per A tile row
constexpr int64_t kTileN = 16;     // output columns per B / C tile
constexpr int64_t kMaxRowBlocks = 4;  // C tiles per n block: 64 rows of x per pass
// Each B tile's 16 lines are prefetched this many tiles ahead (into L1). Measured over the default
// model's projections and LM head (cache-cold, 2-core Xeon): without software prefetch 1 row took
// 23.0 ms and 32 rows 31.3; prefetching 2 of each tile's lines 4 tiles ahead 16.8 and 27.1; all 16
// lines 4-6 tiles ahead 15.8-18.5 and 19.5-22.8 (2 tiles: 18.1 and 23.3; into L2 only: no better).
constexpr int64_t kPrefetchTiles = 4;
// ... and into L2 this many tiles ahead as well. Measured over the default model's projections
// and LM head (2-core Xeon, 2 MB pages, arms alternated in one process): 1 row 11.0 -> 10.4 ms,
// 16 rows 11.3 -> 11.0, 32 rows 14.6 -> 13.5, 64 rows (one n block per pass) 24.2 -> 19.5; 16
// tiles ahead about the same as 8. A single-thread probe streaming 256 MB at 64 rows: 2.6 -> 1.8
// us per n block.
constexpr int64_t kPrefetchL2Tiles = 8;

#if defined(TPSERVE_AMX)
using tpserve::amx_usable;

// The 64-byte tile configuration (palette 1): tmm0-3 C (16 x 16 float32), tmm4-5 A (16 rows x 32
// bf16), tmm6-7 B (16 pairs x 16 columns x 2 bf16).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C tile `tile` (16 x 16 float32) to rows [row0, row0 + rows) and columns [n0, n0 + cols) of y,
// plus bias, rounded once to bf16 (round to nearest even, as c10::BFloat16 does): one vector per
// row, as a scalar loop here cost more than the tile work itself (measured: 30 layers at 64 rows).
// (GCC's tile intrinsics are macros that paste the tile number into the instruction: literals only.)
inline void store_c(int tile, float* scratch, c10::BFloat16* y, int64_t y_stride, int64_t row0, int64_t rows,
                    int64_t n0, int64_t cols, const float* bias) {
  switch (tile) {
    case 0: _tile_stored(0, scratch, 64); break;
    case 1: _tile_stored(1, scratch, 64); break;
    case 2: _tile_stored(2, scratch, 64); break;
    default: _tile_stored(3, scratch, 64); break;
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(scratch + r * kTileN), b);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(y + (row0 + r) * y_stride + n0, mask, h);
  }
}

// One n block (16 output columns) for R row blocks of x: C tiles 0..R-1 over all K, each B tile
// loaded once. `a` is x in A-tile order (pack_rows): the R tiles of one k block lie together,
// `kb_stride` bytes from the next k block's.
// B tile `b`'s successors into L1 and L2 (kPrefetchTiles, kPrefetchL2Tiles).
inline void prefetch_b(const char* b) {
  for (int line = 0; line < 16; ++line) {
    _mm_prefetch(b + kPrefetchTiles * 1024 + line * 64, _MM_HINT_T0);
    _mm_prefetch(b + kPrefetchL2Tiles * 1024 + line * 64, _MM_HINT_T1);
  }
}

template <int R>
void n_block(const char* a, int64_t kb_stride, const char* b, int64_t k_blocks) {
  if (R > 0) _tile_zero(0);
  if (R > 1) _tile_zero(1);
  if (R > 2) _tile_zero(2);
  if (R > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < k_blocks; ++kb, a += kb_stride, b += 1024) {
    prefetch_b(b);
    _tile_loadd(6, b, 64);
    _tile_loadd(4, a, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (R > 1) {
      _tile_loadd(5, a + 1024, 64);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (R > 2) {
      _tile_loadd(4, a + 2048, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (R > 3) {
      _tile_loadd(5, a + 3072, 64);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
}

#if defined(__AVX512BF16__)
// The most rows of x that take vector_rows_linear instead of the tiles. Measured on the 2-core
// Xeon (2026-12-07, the default model's 30 layers of projections and LM head, packed on 2 MB
// pages, cold, the two builds alternated in their own processes, three runs each): 1 row 8.7-9.0
// ms against 9.5-10.1 on the tiles, 2 rows 8.8-10.0 against 9.3-9.7 (3 rows, on the tiles in
// both builds, 9.4-9.5 in both); a decode step of one request, in process, 9.8-10.6 ms against
// 10.7-11.1. At 3 and 4 rows this path took 11.2-11.9 ms against 9.6-10.0 (two or more
// vdpbf16ps per weight vector cost more than a tile's product there).
constexpr int64_t kVectorRows = 2;

// M rows (1 or 2) of one n block's 16 outputs, from its packed B tiles with vdpbf16ps instead of
// the tile unit: each 64-byte row of a B tile holds one pair of K for the block's 16 columns,
// which is the operand vdpbf16ps multiplies against a broadcast pair of x. Why: at one or two
// rows a tile product does 16x the arithmetic the rows need, and its loads stream the weights
// more slowly than vector loads do. xp: each row's K pairs zero-padded to the packed K (row m at
// xp + m * pairs). Four accumulators per row, for the instruction's latency; the same prefetches
// as the tiles' (prefetch_b), which the stream needs here too.
template <int M>
void n_block_vector(const uint32_t* xp, int64_t pairs, const char* b, int64_t k_blocks, float* out) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k_blocks; ++kb, b += 1024) {
    prefetch_b(b);
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(b + p * 64);
#pragma GCC unroll 2
      for (int m = 0; m < M; ++m)
        acc[m][p % 4] = _mm512_dpbf16_ps(acc[m][p % 4], w, (__m512bh)_mm512_set1_epi32(xp[m * pairs + kb * 16 + p]));
    }
  }
  for (int m = 0; m < M; ++m)
    _mm512_storeu_ps(out + m * kTileN,
                     _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

// y [M, N] = x W^T + bias for M <= kVectorRows (x's rows contiguous), the n blocks split between
// the threads; each sum rounded once to bf16 after the bias, as store_c does.
void vector_rows_linear(const at::Tensor& x, const char* wp, int64_t nbs, int64_t kbs, const float* bias,
                        c10::BFloat16* y) {
  const int64_t M = x.size(0), K = x.size(1), N = nbs * kTileN, pairs = kbs * kTileK / 2;
  std::vector<uint32_t> xpairs(M * pairs, 0u);
  for (int64_t m = 0; m < M; ++m) std::memcpy(xpairs.data() + m * pairs, x.data_ptr<c10::BFloat16>() + m * x.stride(0), K * 2);
  at::parallel_for(0, nbs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kVectorRows * kTileN];
    for (int64_t nb = begin; nb < end; ++nb) {
      const char* bt = wp + nb * kbs * 1024;
      if (M == 1) n_block_vector<1>(xpairs.data(), pairs, bt, kbs, sums);
      else n_block_vector<2>(xpairs.data(), pairs, bt, kbs, sums);
      const __m512 bv = bias ? _mm512_loadu_ps(bias + nb * kTileN) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + m * kTileN), bv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + nb * kTileN), h);
      }
    }
  });
}
#endif

// Two n blocks (b0: columns n0..n0+15, b1: the next 16) for RB (1 or 2) row blocks of x: C tiles
// 0 / 1 hold the row blocks' sums for b0, 2 / 3 for b1. Only the first pass over a pair streams
// the weights from memory, so only it prefetches.
template <int RB>
void n_pair(const char* a, int64_t kb_stride, const char* b0, const char* b1, int64_t k_blocks, bool prefetch) {
  _tile_zero(0);
  _tile_zero(2);
  if (RB > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_blocks; ++kb, a += kb_stride, b0 += 1024, b1 += 1024) {
    if (prefetch) {
      prefetch_b(b0);
      prefetch_b(b1);
    }
    _tile_loadd(6, b0, 64);
    _tile_loadd(4, a, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (RB > 1) {
      _tile_loadd(5, a + 1024, 64);
      _tile_dpbf16ps(1, 5, 6);
    }
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(2, 4, 7);
    if (RB > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

// Columns [n0, n0 + 32) of every row of y from the pair of n blocks at b0 (n_pair per two row
// blocks), stored as each pass ends.
void n_pair_and_store(const char* a, int64_t kb_stride, const char* b0, int64_t k_blocks, int64_t row_blocks,
                      float* scratch, c10::BFloat16* y, int64_t N, int64_t M, int64_t n0, const float* bias) {
  const char* b1 = b0 + k_blocks * 1024;
  for (int64_t rb = 0; rb < row_blocks; rb += 2) {
    const int64_t row0 = rb * kTileRows, rows0 = std::min(kTileRows, M - row0);
    if (rb + 1 < row_blocks) {
      n_pair<2>(a + rb * 1024, kb_stride, b0, b1, k_blocks, rb == 0);
      const int64_t rows1 = std::min(kTileRows, M - row0 - kTileRows);
      store_c(0, scratch, y, N, row0, rows0, n0, kTileN, bias);
      store_c(1, scratch, y, N, row0 + kTileRows, rows1, n0, kTileN, bias);
      store_c(2, scratch, y, N, row0, rows0, n0 + kTileN, kTileN, bias);
      store_c(3, scratch, y, N, row0 + kTileRows, rows1, n0 + kTileN, kTileN, bias);
    } else {
      n_pair<1>(a + rb * 1024, kb_stride, b0, b1, k_blocks, rb == 0);
      store_c(0, scratch, y, N, row0, rows0, n0, kTileN, bias);
      store_c(2, scratch, y, N, row0, rows0, n0 + kTileN, kTileN, bias);
    }
  }
}

template <int R>
void n_block_and_store(const char* a, int64_t kb_stride, const char* b, int64_t k_blocks, float* scratch,
                       c10::BFloat16* y, int64_t N, int64_t row0, int64_t M, int64_t n0, const float* bias) {
  n_block<R>(a, kb_stride, b, k_blocks);
  const int64_t cols = std::min(kTileN, N - n0);
  auto rows_of = [&](int64_t block) { return std::min(kTileRows, M - row0 - block * kTileRows); };
  for (int t = 0; t < R; ++t) store_c(t, scratch, y, N, row0 + t * kTileRows, rows_of(t), n0, cols, bias);
}

// x [M, K] into A-tile order [k_blocks][row_blocks][16][32], zero-padded: each tile's 1 KB
// contiguous and one k block's tiles side by side, so that the tile loads stream from L1 (rows of
// x 2 K bytes apart, 64 rows at K = 576 already spill L1; measured 1.2-1.6x slower at 64 rows).
at::Tensor pack_rows(const at::Tensor& x, int64_t row_blocks, int64_t k_blocks) {
  // Only the padding is zeroed (rows past M, K past its last multiple of 32): a zero-filled
  // buffer cost one more pass over it per projection.
  at::Tensor out = at::empty({k_blocks, row_blocks, kTileRows, kTileK}, x.options());
  const int64_t M = x.size(0), K = x.size(1), stride = x.stride(0);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t m = 0; m < row_blocks * kTileRows; ++m) {
    const int64_t rb = m / kTileRows, r = m % kTileRows;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      uint16_t* row = dst + ((kb * row_blocks + rb) * kTileRows + r) * kTileK;
      const int64_t k0 = kb * kTileK, n = m < M ? std::min(kTileK, K - k0) : 0;
      if (n > 0) std::memcpy(row, src + m * stride + k0, n * 2);
      if (n < kTileK) std::memset(row + n, 0, (kTileK - n) * 2);
    }
  }
  return out;
}
#endif

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// W [N, K] bf16 -> the B-tile layout in the header, [N/16, ceil(K/32), 16, 32] bf16. N must be a
// multiple of 16 (so amx_linear reads N off the packed shape; every projection of the supported
// models is, TP shards included), K is zero-padded.
at::Tensor amx_pack_weight(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16,
              "amx_pack_weight: a 2-D bfloat16 weight [N, K]");
  TORCH_CHECK(weight_in.size(0) % kTileN == 0, "amx_pack_weight: N (", weight_in.size(0), ") must be a multiple of ",
              kTileN);
  const at::Tensor w = weight_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t nbs = round_up(N, kTileN) / kTileN, kbs = round_up(K, kTileK) / kTileK;
  at::Tensor packed = at::zeros({nbs, kbs, kTileRows, kTileK}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, nbs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < kbs; ++kb) {
        uint16_t* tile = dst + (nb * kbs + kb) * kTileRows * kTileK;
        for (int64_t c = 0; c < kTileN && nb * kTileN + c < N; ++c)
          for (int64_t kk = 0; kk < kTileK && kb * kTileK + kk < K; ++kk)
            tile[(kk / 2) * kTileK + 2 * c + (kk % 2)] = src[(nb * kTileN + c) * K + kb * kTileK + kk];
      }
  });
  return packed;
}

// y [M, N] = x [M, K] W^T + bias, W given packed (amx_pack_weight).
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "amx_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kTileRows && packed.size(3) == kTileK,
              "amx_linear: the weight must come from amx_pack_weight");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t nbs = packed.size(0), kbs = packed.size(1), N = nbs * kTileN;
  TORCH_CHECK(kbs == round_up(K, kTileK) / kTileK, "amx_linear: x [", M, ", ", K,
              "] does not fit the packed weight's K (", kbs * kTileK, " padded)");
  at::Tensor b;  // float32, added to the float32 sums before the one rounding
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "amx_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x_in.options());
#if defined(TPSERVE_AMX)
  TORCH_CHECK(amx_usable(), "amx_linear: the OS did not grant this process the AMX tile state");
  if (M == 0 || N == 0) return y;
  TORCH_CHECK(x_in.stride(1) == 1, "amx_linear: x's rows must be contiguous");
#if defined(__AVX512BF16__)
  if (M <= kVectorRows) {
    vector_rows_linear(x_in, reinterpret_cast<const char*>(packed.data_ptr<c10::BFloat16>()), nbs, kbs,
                       b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  const int64_t row_blocks = round_up(M, kTileRows) / kTileRows;
  const at::Tensor xt = pack_rows(x_in, row_blocks, kbs);
  const char* ap = reinterpret_cast<const char*>(xt.data_ptr<c10::BFloat16>());
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<c10::BFloat16>());
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t kb_stride = row_blocks * 1024;
  // Work is handed out in pairs of n blocks (n_pair); a pair past N is one n block.
  at::parallel_for(0, (nbs + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float scratch[kTileRows * kTileN];
    for (int64_t nb = 2 * begin; nb < std::min(2 * end, nbs); ++nb) {
      const char* bt = wp + nb * kbs * 1024;
      if (row_blocks > 1 && nb + 1 < nbs) {
        n_pair_and_store(ap, kb_stride, bt, kbs, row_blocks, scratch, yp, N, M, nb * kTileN, bias_ptr);
        ++nb;
        continue;
      }
      for (int64_t rb = 0; rb < row_blocks; rb += kMaxRowBlocks) {
        const char* a = ap + rb * 1024;
        const int64_t row0 = rb * kTileRows, n0 = nb * kTileN;
        switch (std::min(kMaxRowBlocks, row_blocks - rb)) {
          case 1: n_block_and_store<1>(a, kb_stride, bt, kbs, scratch, yp, N, row0, M, n0, bias_ptr); break;
          case 2: n_block_and_store<2>(a, kb_stride, bt, kbs, scratch, yp, N, row0, M, n0, bias_ptr); break;
          case 3: n_block_and_store<3>(a, kb_stride, bt, kbs, scratch, yp, N, row0, M, n0, bias_ptr); break;
          default: n_block_and_store<4>(a, kb_stride, bt, kbs, scratch, yp, N, row0, M, n0, bias_ptr); break;
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "amx_linear: built without AMX (amx_linear_max_rows() is 0)");
#endif
  return y;
}

// The most x rows for which the engine should call amx_linear instead of oneDNN's packed GEMM; 0
// where it cannot run (built without AMX, or the OS refused the tile state). Measured on a 2-core
// Xeon over the default model's 30 layers of projections and its LM head (269 MB, cache-cold,
// bf16), oneDNN -> amx_linear, two runs each (this VM's speed drifts by up to 1.6x between runs):
// 1 row 32.1 -> 18.5 and 20.0 -> 15.8 ms; 32 rows 41.4 -> 22.3 and 22.7 -> 19.5; 48 rows
// 29.7 -> 25.7 and 28.3 -> 22.1; 64 rows 25.4 -> 24.7 and 25.8 -> 23.6; 96 rows 55.2 -> 54.5 and
// 32.1 -> 34.5; 128 rows 61.6 -> 68.2 and 35.6 -> 42.8. From ~64 rows the tile products, not the
// weights, bound it, and oneDNN's blocking does better there.
// Before n_pair, re-measured with torch 2.13's oneDNN (same Xeon, the 4 projections x 30 layers
// without the LM head, arms alternated): oneDNN then won the projections alone from ~40 rows (64
// rows 16.3-17.0 vs 21.0 ms), but in an engine's decode step, the limit toggled between steps of one process,
// 32 instead of 64 changed nothing (64 requests 56.3 vs 57.2 ms, 40 requests 41.1 vs 39.6), and
// a limit timed at load the way panel_linear's is picked 8-16 rows on a loaded machine, where
// oneDNN is 1.3x slower. So the limit stays fixed.
// Tried at 64 rows with one n block per pass and dropped (no change beyond +-5%): B tiles
// double-buffered in tmm6 / tmm7, A tiles prefetched into L1 a k block ahead, B prefetched 1-16
// tiles ahead into L1 or into L2 alone (what won, above, is both at once). With the loads left out
// the tile products alone ran at 2.0-2.4 TFLOP/s against peak_probe's 7.6, and the weight stream
// did not overlap them.
// With n_pair and both prefetches (2026-12-05, same Xeon, cold weights on 2 MB pages, against
// oneDNN's packed GEMM on the 4 projections x 30 layers): 16 rows 1.46x oneDNN's speed, 64 rows
// 1.20x, 96-128 rows 1.03-1.04x, 256-2048 rows 0.87-0.45x (oneDNN's blocking keeps x in cache
// there); so the limit stays at 64.
int64_t amx_linear_max_rows() {
#if defined(TPSERVE_AMX)
  return amx_usable() ? 64 : 0;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("amx_pack_weight(Tensor weight) -> Tensor", &amx_pack_weight);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear);
  m.def("amx_linear_max_rows() -> int", &amx_linear_max_rows);
}
