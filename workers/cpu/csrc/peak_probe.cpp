// peak_probe: the arithmetic peak this build's instructions reach on every OpenMP thread, the
// bound a compute-bound kernel of the same build is measured against (bench/kernels/isa_paths.py).
//
// Why a probe per build: each instruction-set variant (workers/cpu/kernels.py) has its own peak
// (256-bit FMAs, 512-bit FMAs, AVX512-BF16 dot products, AMX tiles), and a kernel is only as good
// as its share of the peak of the instructions its build may use. A datasheet figure would not do:
// these machines are VMs whose clocks and SMT neighbours we do not know.
//
// Kinds (peak_probe_kinds lists those this build has and the OS allows):
//   fp32_muladd128  128-bit multiply then add (GCC vector extensions: SSE2 / NEON), the width the
//                   portable loops are vectorised to where no wider instruction set is enabled;
//   fp32_fma256     AVX2 + FMA vfmadd on 8 floats;
//   fp32_fma512     AVX-512 vfmadd on 16 floats;
//   bf16_dot512     AVX512-BF16 vdpbf16ps: 16 float32 lanes, each += two bf16 products;
//   bf16_amx        AMX tdpbf16ps: a 16 x 16 float32 tile += 16 x 32 by 32 x 16 bf16 tiles.
//
// Loop: each thread runs independent accumulator chains (more than the FMA latency times the
// issue rate, so that only throughput bounds them), acc = acc * x + y with x = y = 1 held where
// the compiler cannot see them, or a dot product of all-ones bf16 operands. Every accumulator
// element therefore gains exactly `products per step` each step, and the checksum (the sum of all
// accumulators over all threads) is steps x accumulators x products: a loop the compiler shortened
// or dropped changes it. The float32 accumulators are emptied into a double every kBlockSteps
// steps, so the sum stays exact at any step count (at most 2^16 x 32 < 2^24 per block).
//
// The rate is each thread's FLOPs over its own CPU time (CLOCK_THREAD_CPUTIME_ID), summed: on a
// machine shared with other processes a thread that waits for its core does no work and is not
// charged for the wait, so the figure is what the cores reach, not what the scheduler left over
// (with as many threads as cores; more threads than cores would count a core twice).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx_permission.h"
#define TPSERVE_PROBE_AMX 1
#endif

namespace {

// Independent accumulator registers per thread: SPR and Zen issue two FMAs a cycle at a latency
// of 4-5 cycles, so at least 10 must be in flight; 12 leaves room and fits 16 ymm registers.
constexpr int kChains = 12;
// Steps between emptying the float32 accumulators into the exact double sum.
constexpr int64_t kBlockSteps = int64_t{1} << 16;

// 1.0f from memory the compiler must reread: a constant would let it fold acc * 1 into acc (or
// turn the FMA into an add), and the probe would time another instruction.
volatile float g_one = 1.0f;

// One instruction kind: its register type V and how one step updates one accumulator.
struct Muladd128 {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int64_t kLanes = 4, kProducts = 1;
  static V zero() { return V{0, 0, 0, 0}; }
  static V one() { const float o = g_one; return V{o, o, o, o}; }
  static V step(V acc, V x, V y) { return acc * x + y; }
  static double sum(V v) { return double(v[0]) + v[1] + v[2] + v[3]; }
};

#if defined(__AVX2__) && defined(__FMA__)
struct Fma256 {
  using V = __m256;
  static constexpr int64_t kLanes = 8, kProducts = 1;
  static V zero() { return _mm256_setzero_ps(); }
  static V one() { return _mm256_set1_ps(g_one); }
  static V step(V acc, V x, V y) { return _mm256_fmadd_ps(acc, x, y); }
  static double sum(V v) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    double s = 0;
    for (float e : f) s += e;
    return s;
  }
};
#endif

#if defined(__AVX512F__)
inline double sum512(__m512 v) {
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  double s = 0;
  for (float e : f) s += e;
  return s;
}

struct Fma512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16, kProducts = 1;
  static V zero() { return _mm512_setzero_ps(); }
  static V one() { return _mm512_set1_ps(g_one); }
  static V step(V acc, V x, V y) { return _mm512_fmadd_ps(acc, x, y); }
  static double sum(V v) { return sum512(v); }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
struct Dot512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16, kProducts = 2;
  static V zero() { return _mm512_setzero_ps(); }
  // Both operands are all-ones bf16 pairs; step() casts them back (x and y share one register).
  static V one() { const __m512 o = _mm512_set1_ps(g_one); return (__m512)_mm512_cvtne2ps_pbh(o, o); }
  static V step(V acc, V x, V y) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y); }
  static double sum(V v) { return sum512(v); }
};
#endif

// One thread's chains of instruction kind K for `steps` steps; returns the sum of its accumulators.
template <typename K>
double run_chains(int64_t steps) {
  typename K::V acc[kChains];
  for (auto& a : acc) a = K::zero();
  const typename K::V x = K::one(), y = K::one();
  double total = 0;
  for (int64_t done = 0; done < steps;) {
    const int64_t block = std::min(kBlockSteps, steps - done);
    for (int64_t i = 0; i < block; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = K::step(acc[c], x, y);
    }
    for (auto& a : acc) {
      total += K::sum(a);
      a = K::zero();
    }
    done += block;
  }
  return total;
}

#if defined(TPSERVE_PROBE_AMX)
using tpserve::amx_usable;

// C tiles accumulating at once (tmm0-5); A is tmm6, B tmm7. tdpbf16ps issues every 16 cycles with a
// latency of ~50 on Sapphire Rapids: four in flight would do, six leave room.
constexpr int kAmxTiles = 6;
constexpr int64_t kAmxTileElements = 16 * 16, kAmxProducts = 32;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Empty C tile `t` into the double sum and zero it (tile numbers must be literals: GCC's
// intrinsics paste them into the instruction).
#define TPSERVE_DRAIN_TILE(t)                                            \
  _tile_stored(t, scratch, 64);                                          \
  for (int64_t e = 0; e < kAmxTileElements; ++e) total += scratch[e];  \
  _tile_zero(t);

double run_amx(int64_t steps) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t ones[16 * 32];
  std::fill(std::begin(ones), std::end(ones), static_cast<uint16_t>(0x3F80));  // bf16 1.0
  alignas(64) float scratch[kAmxTileElements];
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  double total = 0;
  for (int64_t done = 0; done < steps;) {
    const int64_t block = std::min(kBlockSteps, steps - done);
    for (int64_t i = 0; i < block; ++i) {
      _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
      _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
    }
    TPSERVE_DRAIN_TILE(0) TPSERVE_DRAIN_TILE(1) TPSERVE_DRAIN_TILE(2)
    TPSERVE_DRAIN_TILE(3) TPSERVE_DRAIN_TILE(4) TPSERVE_DRAIN_TILE(5)
    done += block;
  }
  _tile_release();
  return total;
}
#undef TPSERVE_DRAIN_TILE
#endif

// How one kind runs: a thread's loop, its accumulator elements per thread and products per step.
struct Kind {
  std::string name;
  double (*run)(int64_t steps);
  int64_t accumulators;
  int64_t products;
};

template <typename K>
Kind chains_kind(const char* name) {
  return {name, &run_chains<K>, kChains * K::kLanes, K::kProducts};
}

// Best first, as kernels.py orders the variants.
std::vector<Kind> available_kinds() {
  std::vector<Kind> kinds;
#if defined(TPSERVE_PROBE_AMX)
  if (amx_usable()) kinds.push_back({"bf16_amx", &run_amx, kAmxTiles * kAmxTileElements, kAmxProducts});
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  kinds.push_back(chains_kind<Dot512>("bf16_dot512"));
#endif
#if defined(__AVX512F__)
  kinds.push_back(chains_kind<Fma512>("fp32_fma512"));
#endif
#if defined(__AVX2__) && defined(__FMA__)
  kinds.push_back(chains_kind<Fma256>("fp32_fma256"));
#endif
  kinds.push_back(chains_kind<Muladd128>("fp32_muladd128"));
  return kinds;
}

std::vector<std::string> peak_probe_kinds() {
  std::vector<std::string> names;
  for (const Kind& kind : available_kinds()) names.push_back(kind.name);
  return names;
}

double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// `steps` steps of every accumulator of `kind` on every thread of torch's OpenMP team. Returns
// (FLOP/s: the sum of each thread's FLOPs over its CPU time, FLOPs, wall seconds of the parallel
// region, checksum, accumulator elements in all threads).
std::tuple<double, double, double, double, int64_t> peak_probe(const std::string& kind, int64_t steps) {
  TORCH_CHECK(steps > 0, "peak_probe: steps must be positive, not ", steps);
  const std::vector<Kind> kinds = available_kinds();
  const auto found = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) { return k.name == kind; });
  TORCH_CHECK(found != kinds.end(), "peak_probe: this build has no kind '", kind, "' (peak_probe_kinds() lists them)");
  const int64_t threads = at::get_num_threads();
  std::vector<double> sums(threads, 0.0), cpu_seconds(threads, 0.0);
  const auto start = std::chrono::steady_clock::now();
  // Grain 1 over one index per thread: each thread of the team runs one set of chains.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const double cpu_start = thread_cpu_seconds();
      sums[t] = found->run(steps);
      cpu_seconds[t] = thread_cpu_seconds() - cpu_start;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double flops_per_thread = 2.0 * static_cast<double>(found->products) * static_cast<double>(steps) *
                                  static_cast<double>(found->accumulators);
  double checksum = 0, flops_per_second = 0;
  for (int64_t t = 0; t < threads; ++t) {
    checksum += sums[t];
    // A loop shorter than the clock's resolution counts at the wall time instead.
    flops_per_second += flops_per_thread / (cpu_seconds[t] > 0 ? cpu_seconds[t] : seconds);
  }
  return {flops_per_second, flops_per_thread * threads, seconds, checksum, threads * found->accumulators};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("peak_probe_kinds() -> str[]", &peak_probe_kinds);
  m.def("peak_probe(str kind, int steps) -> (float, float, float, float, int)", &peak_probe);
}
