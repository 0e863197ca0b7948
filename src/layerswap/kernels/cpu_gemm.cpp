// layerswap's hand-written CPU kernel: the skinny GEMM `out = x @ w.T` of an MoE expert with a few rows, in
// bf16 or fp32.
//
// Why: at 1-3 rows an expert's GEMM is a pure weight stream, and every engine torch has leaves some of the
// memory's bandwidth unused. Measured on a 2-core Sapphire Rapids, one 6.3 MB weight after another from memory:
// - bf16, 1 row: this loop 24.7 GB/s; torch.mv 21.4; stock's `x @ W.T` 17.7; a plain AVX-512 read of the same
//   bytes 25.5. At 2-3 rows 22.5 against 21 for oneDNN's weight-major GEMM.
// - fp32 on -quant's separate 768-row projections, 1-3 rows: 27.1 / 26.2 / 25.6 GB/s against MKL's
//   25.9 / 24.6 / 23.8 (a fused 1536-row projection, as stock runs it: 27.7 / 26.2 / 23.8).
// From ~4 rows on it is compute-bound (AVX512-BF16's dot product), where oneDNN's AMX path wins; the CPU
// dispatch (cpu_dispatch.py) measures which engine each row count gets on this machine, so this kernel only
// runs where it is faster there.
//
// Math: out[m, n] = sum_k x[m, k] * w[n, k] with fp32 accumulation; bf16 output rounded once at the end (to
// nearest even), like torch's bf16 GEMM. Only the order of the fp32 additions differs from torch's.
// Threads: an OpenMP loop over blocks of weight rows, as many threads as torch.get_num_threads() gives the
// calling thread, so torch.set_num_threads (and a single-threaded worker thread) applies; each output element is
// summed by one thread in a fixed order, whatever the thread count. Compiled with -fopenmp but not linked to an
// OpenMP runtime: GOMP_* resolve to the one torch itself loaded, so both share one thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kIsaAvx2 = 1;        // AVX2 + FMA (bf16 widened to fp32)
constexpr int64_t kIsaAvx512Bf16 = 2;  // AVX-512 with BF16: vdpbf16ps, two products per fp32 lane
constexpr int64_t kPrefetchBytes = 512;  // 8 cache lines ahead of each weight row's loads, into L1
// With at most kStreamRows input rows the GEMM is a weight stream: its rows are prefetched 32 lines ahead into L2
// instead of 8 lines ahead into L1 (with no software prefetch at all, the AVX2 one-row bf16 GEMM alone ran
// 0.86-0.97x the time it took with the near one, on one thread: that one held it back). On a 2-core Zen 4, one
// expert's gated MLP (32 experts a call, the same sums, old and new builds in turns) took, at 1 / 2 / 3 rows:
// - AVX2 bf16 0.80 / 0.90 / 0.93x the time (Qwen3-30B-A3B's shape; Qwen1.5-MoE's 0.77 / 0.88 / 0.93x), fp32
//   0.83 / 0.84 / 0.88x (0.84 / 0.83 / 0.94x), on the loops of then (8 weight rows at once for one row, 3 x 4
//   tiles for 2-3: since replaced by stream_rows_avx2, and for fp32 at 2-3 rows by columns_avx2_pairs);
// - AVX-512 bf16 0.94-0.95x (0.90-0.98x), fp32 0.98-0.99x (0.92-0.98x).
// From 4 rows on, where the tiles compute from L1, the near prefetch stays: AVX2's fp32 tiles took 1.03-1.07x the
// time at 8-32 rows with the far one. (AVX2 now streams far only in stream_rows_avx2.)
constexpr int64_t kStreamRows = 3;
constexpr int64_t kFarPrefetchBytes = 2048;

// Prefetches a weight row's stream `at` the current load: far into L2 (kFar: a few input rows), else near into L1.
// A compile-time choice: a run-time one in the tiles cost AVX2's fp32 tiles 1.1-1.5x the time at 8-32 rows.
template <bool kFar>
inline void prefetch_stream(const void* at) {
  const char* bytes = static_cast<const char*>(at);
  if constexpr (kFar) _mm_prefetch(bytes + kFarPrefetchBytes, _MM_HINT_T1);
  else _mm_prefetch(bytes + kPrefetchBytes, _MM_HINT_T0);
}

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == kIsaAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kIsaAvx512Bf16)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  return false;
}

inline uint16_t round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// out[m, n] = sum_k x[m, k] * w[n, k] for m < rows, n < columns, k < depth; Elem is uint16_t (bf16) or float.
// With `out_fp32` set, the sums are written there unrounded instead (same ldo): the gated MLP's gate and up.
template <class Elem>
struct Problem {
  const Elem* x;
  const Elem* w;
  Elem* out;
  int64_t ldx, ldw, ldo, rows, columns, depth;
  float* out_fp32 = nullptr;
  const float* x_fp32 = nullptr;  // x widened to fp32 (bf16 on AVX2 from kWidenRows rows: widen_x), ld depth
};

inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}
inline float to_float(float value) { return value; }
inline void store(uint16_t* target, float value) { *target = round_to_bf16(value); }
inline void store(float* target, float value) { *target = value; }

// Finishes one output element: the vector lanes' sum, plus the depth past the last full vector (real layers
// have none; odd test shapes do).
template <class Elem>
inline void finish(const Problem<Elem>& p, int64_t m, int64_t n, int64_t k, float lanes_sum) {
  for (; k < p.depth; ++k) lanes_sum += to_float(p.x[m * p.ldx + k]) * to_float(p.w[n * p.ldw + k]);
  if (p.out_fp32) p.out_fp32[m * p.ldo + n] = lanes_sum;
  else store(p.out + m * p.ldo + n, lanes_sum);
}

// --- AVX-512 (bf16 through AVX512-BF16's vdpbf16ps, fp32 through FMA) ---------------------------------------

// The lane sums of four vectors, [sum(a), sum(b), sum(c), sum(d)], in 14 shuffles and adds where summing each
// alone takes 8. With store4 (one store of four outputs), on a Zen 4, a bf16 GEMM of 8-32 rows against 768-deep
// weights (an expert's down projection) took 0.83-0.84x the time, 2048-deep 0.92x; a whole bf16 expert at 16-47
// rows 0.92-0.94x, fp32 at 32 rows 0.94x, 1-8 rows unchanged (memory-bound).
__attribute__((target("avx512f"))) inline __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit quarters: [a0+a2, a1+a3, b0+b2, b1+b3] and the same of c and d, then [a, b, c, d] summed to 4 lanes.
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 quarters = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  quarters = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, 0xB1));  // neighbouring lanes
  quarters = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, 0x4E));  // neighbouring pairs
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, quarters));
}

// Four finished sums (no depth remainder) stored at once: fp32, or rounded to bf16 as round_to_bf16 does
// (to nearest even, NaN kept quiet).
template <class Elem>
__attribute__((target("avx512f"))) inline void store4(const Problem<Elem>& p, int64_t m, int64_t n, __m128 sums) {
  if (p.out_fp32) {
    _mm_storeu_ps(p.out_fp32 + m * p.ldo + n, sums);
  } else if constexpr (std::is_same_v<Elem, float>) {
    _mm_storeu_ps(p.out + m * p.ldo + n, sums);
  } else {
    const __m128i bits = _mm_castps_si128(sums);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
    __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(bits, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    const __m128i quiet = _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40));
    rounded = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
    const __m128i packed = _mm_packus_epi32(rounded, rounded);  // values < 65536: unsigned saturation keeps them
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p.out + m * p.ldo + n), packed);
  }
}

// An MB x NB tile of `out`: MB input rows against NB weight rows, one 64-byte vector of depth per step. The first
// tile of a block (`stream`) reads the weight rows from memory or L2 and prefetches them into L1; each tile also
// prefetches `ahead_rows` rows of the next block (from `ahead`, row `ahead_first` on) into L2, one line a step.
// That prefetch made one expert's gated MLP take 0.62-0.86x the time in bf16 at 1-32 rows, 0.74-0.93x in fp32,
// on a 2-core Zen 4 (Qwen3-30B-A3B's shape, 32 experts a call, the same sums): at 4-6 rows 24.8 GB/s against
// 16.4, where only the current rows were prefetched, 512 bytes ahead.
template <class Elem, int MB, int NB, bool kFar>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void tile_avx512(
    const Problem<Elem>& p, int64_t m, int64_t n, bool stream, const Elem* ahead, int ahead_first,
    int ahead_rows) {
  constexpr bool kBf16 = std::is_same_v<Elem, uint16_t>;
  constexpr int64_t kStep = 64 / sizeof(Elem);
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const Elem* x = p.x + m * p.ldx;
  const Elem* w = p.w + n * p.ldw;
  if (!ahead) ahead_rows = 0;
  int64_t k = 0;
  for (; k + kStep <= p.depth; k += kStep) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(w + j * p.ldw + k);
      if (stream) prefetch_stream<kFar>(w + j * p.ldw + k);
    }
    for (int j = ahead_first; j < ahead_first + ahead_rows; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + j * p.ldw + k), _MM_HINT_T1);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * p.ldx + k);
      for (int j = 0; j < NB; ++j) {
        if constexpr (kBf16)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        else
          acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(xv), _mm512_castsi512_ps(wv[j]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB % 4 == 0) {
      for (int j = 0; j < NB; j += 4) {
        const __m128 sums = sum_lanes4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
        if (k == p.depth) store4(p, m + i, n + j, sums);
        else {
          alignas(16) float lanes[4];
          _mm_store_ps(lanes, sums);
          for (int q = 0; q < 4; ++q) finish(p, m + i, n + j + q, k, lanes[q]);
        }
      }
    } else {
      for (int j = 0; j < NB; ++j) finish(p, m + i, n + j, k, _mm512_reduce_add_ps(acc[i][j]));
    }
  }
}

// tile_avx512 for `rows` (at most R) input rows.
template <class Elem, int R, int NB, bool kFar, class... Args>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void tile_rows_avx512(const Problem<Elem>& p,
                                                                                    int64_t rows, Args... args) {
  if constexpr (R > 0) {
    if (rows == R) tile_avx512<Elem, R, NB, kFar>(p, args...);
    else tile_rows_avx512<Elem, R - 1, NB, kFar>(p, rows, args...);
  }
}

// Every input row against NB weight rows: MB rows at a time, the weight rows staying in L1 between them. The
// next block's rows (`ahead`) are prefetched across the tiles, so that memory works while the later tiles
// compute from L1.
template <class Elem, int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void columns_avx512(const Problem<Elem>& p, int64_t n,
                                                                            const Elem* ahead) {
  static_assert(MB >= kStreamRows);
  if (p.rows <= kStreamRows) {  // one tile, a weight stream
    tile_rows_avx512<Elem, kStreamRows, NB, true>(p, p.rows, int64_t{0}, n, true, ahead, 0, NB);
    return;
  }
  const int64_t tiles = (p.rows + MB - 1) / MB;
  const int per_tile = static_cast<int>((NB + tiles - 1) / tiles);  // next-block rows each tile prefetches
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (p.rows - m) / (tiles - t) + ((p.rows - m) % (tiles - t) != 0);  // balanced tiles
    const int first = static_cast<int>(std::min<int64_t>(NB, t * per_tile));
    const int count = std::min(NB - first, per_tile);
    tile_rows_avx512<Elem, MB, NB, false>(p, rows, m, n, t == 0, ahead, first, count);
    m += rows;
  }
}

// --- AVX2 + FMA (bf16 widened to fp32 in registers) ---------------------------------------------------------

template <class Elem>
__attribute__((target("avx2,fma"))) inline __m256 load8(const Elem* source) {
  if constexpr (std::is_same_v<Elem, float>) {
    return _mm256_loadu_ps(source);
  } else {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
}

__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// An MB x NB tile of `out` from Src rows: the problem's own (Src = Elem), or fp32 copies of bf16 rows (x and w at
// the tile's first rows, ldx and ldw their strides); `p` gives the depth, the output and the depth remainder.
// With fp32 copies, the tile also prefetches `ahead_rows` rows of the next block (from `ahead`, row `ahead_first`
// on) into L2, one line a row per line of depth, for the widening that reads them next.
template <class Elem, class Src, int MB, int NB>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const Problem<Elem>& p, const Src* x, int64_t ldx,
                                                          const Src* w, int64_t ldw, int64_t m, int64_t n,
                                                          const Elem* ahead = nullptr, int ahead_first = 0,
                                                          int ahead_rows = 0) {
  constexpr bool kStream = std::is_same_v<Src, Elem>;  // weights from memory (fp32 copies sit in cache)
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= p.depth; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = load8(w + j * ldw + k);
      if constexpr (kStream) prefetch_stream<false>(w + j * ldw + k);
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = load8(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
    if (ahead && k % (64 / sizeof(Elem)) == 0)
      for (int j = ahead_first; j < ahead_first + ahead_rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * p.ldw + k), _MM_HINT_T1);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) finish(p, m + i, n + j, k, sum_lanes(acc[i][j]));
}

// Every input row against NB weight rows (Src as in tile_avx2; x and w at row 0 and row n).
template <class Elem, class Src, int NB>
__attribute__((target("avx2,fma"))) void columns_avx2(const Problem<Elem>& p, const Src* x, int64_t ldx,
                                                      const Src* w, int64_t ldw, int64_t n,
                                                      const Elem* ahead = nullptr) {
  constexpr int MB = 3;  // 3 x 4 accumulators + 4 weight vectors + 1 input vector fit the 16 ymm registers
  const int64_t tiles = std::max<int64_t>(1, p.rows / MB);
  const int per_tile = static_cast<int>((NB + tiles - 1) / tiles);  // next-block rows each whole tile prefetches
  int64_t m = 0;
  for (int64_t t = 0; m + MB <= p.rows; m += MB, ++t) {
    const int first = static_cast<int>(std::min<int64_t>(NB, t * per_tile));
    tile_avx2<Elem, Src, MB, NB>(p, x + m * ldx, ldx, w, ldw, m, n, ahead, first, std::min(NB - first, per_tile));
  }
  switch (p.rows - m) {
    case 2: tile_avx2<Elem, Src, 2, NB>(p, x + m * ldx, ldx, w, ldw, m, n); break;
    case 1: tile_avx2<Elem, Src, 1, NB>(p, x + m * ldx, ldx, w, ldw, m, n); break;
    default: break;
  }
}

// bf16 from kPairRows input rows (x_fp32 in order): widening each weight vector in every tile
// costs two integer operations per MB = 3 FMAs, on the ports the FMAs use. So NB weight rows are widened once
// into `scratch` (in cache), and every tile runs in fp32 on them and on x widened once per call. The tiles also
// prefetch the next block's weight rows (`ahead`) into L2, each whole tile its share, so that the widening
// does not wait for memory. Against the first tile prefetching them all into L1, one expert's gated MLP on a
// Zen 4's AVX2 instructions (Qwen3-30B-A3B's shape, 32 experts a call, the same sums) took 0.77-0.81x the time at
// 4-8 rows, 0.91-0.92x at 16-23, 0.95-0.97x at 47-95; Qwen1.5-MoE's 0.79-0.84x at 4-8 rows.
template <class Elem, int NB>
__attribute__((target("avx2,fma"))) void columns_avx2_widened(const Problem<Elem>& p, float* scratch, int64_t n,
                                                               const Elem* ahead) {
  const int64_t depth8 = p.depth / 8 * 8;
  for (int j = 0; j < NB; ++j) {
    const Elem* row = p.w + (n + j) * p.ldw;
    for (int64_t k = 0; k < depth8; k += 8) {
      _mm256_storeu_ps(scratch + j * depth8 + k, load8(row + k));
      prefetch_stream<true>(row + k);  // from L2 (the tiles' prefetch) or memory: at 4 rows 0.92x the time
    }
  }
  columns_avx2<Elem, float, NB>(p, p.x_fp32, p.depth, scratch, depth8, n, ahead);
}

// Several input rows on AVX2 (kFirstPairRows to kPairRows, below): an MB x NB tile (MB <= 4 input rows, NB <= 2 weight
// rows), 16 values of depth a step as two vectors of 8, "even" and "odd". fp32: the two halves of the 16 values,
// so the sums are those of columns_avx2. bf16: one 32-byte load of the raw weights, split even/odd as in
// stream_rows_avx2 (two integer operations per 16 values), against the input rows split alike once a call
// (widen_x): no fp32 copy of the weights. Both products go to one accumulator; the two x vectors stay in
// registers (folded into each FMA, as GCC had them, they were loaded NB times; pinned, 0.83-0.97x the time at 7 of
// 8 row counts). The tile covers the depth from k_begin to k_end: it starts from the sums in `partial` where
// k_begin > 0, and leaves its sums there where k_end falls short of the depth (else it finishes them).
template <class Elem, int MB, int NB>
__attribute__((target("avx2,fma"))) inline void tile_avx2_pairs(const Problem<Elem>& p, int64_t m, int64_t n,
                                                                bool stream, const Elem* ahead, int ahead_first,
                                                                int ahead_rows, int64_t k_begin, int64_t k_end,
                                                                __m256* partial) {
  constexpr bool kBf16 = std::is_same_v<Elem, uint16_t>;
  constexpr int64_t kLine = 64 / sizeof(Elem);  // values a cache line holds
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = k_begin ? partial[i * NB + j] : _mm256_setzero_ps();
  const float* x = kBf16 ? p.x_fp32 + m * p.depth : reinterpret_cast<const float*>(p.x + m * p.ldx);
  const int64_t ldx = kBf16 ? p.depth : p.ldx;
  const Elem* w = p.w + n * p.ldw;
  if (!ahead) ahead_rows = 0;
  int64_t k = k_begin;
  for (; k + 16 <= k_end; k += 16) {
    __m256 even[NB], odd[NB];
    for (int j = 0; j < NB; ++j) {
      if constexpr (kBf16) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * p.ldw + k));
        even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        odd[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      } else {
        even[j] = _mm256_loadu_ps(w + j * p.ldw + k);
        odd[j] = _mm256_loadu_ps(w + j * p.ldw + k + 8);
      }
      if (stream && k % kLine == 0) prefetch_stream<false>(w + j * p.ldw + k);
    }
    if (k % kLine == 0)
      for (int j = ahead_first; j < ahead_first + ahead_rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * p.ldw + k), _MM_HINT_T1);
    for (int i = 0; i < MB; ++i) {
      __m256 x_even = _mm256_loadu_ps(x + i * ldx + k);
      __m256 x_odd = _mm256_loadu_ps(x + i * ldx + k + 8);
      asm("" : "+x"(x_even), "+x"(x_odd));  // in registers, not folded into the FMAs
      for (int j = 0; j < NB; ++j) {
        acc[i][j] = _mm256_fmadd_ps(x_even, even[j], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(x_odd, odd[j], acc[i][j]);
      }
    }
  }
  if (k_end < p.depth) {  // a part of the depth: the sums go on in the next
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) partial[i * NB + j] = acc[i][j];
    return;
  }
  if (k + 8 <= p.depth) {  // one more vector of 8, in order (real layers' depths need none)
    for (int j = 0; j < NB; ++j) {
      const __m256 wv = load8(w + j * p.ldw + k);
      for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), wv, acc[i][j]);
    }
    k += 8;
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) finish(p, m + i, n + j, k, sum_lanes(acc[i][j]));
}

// tile_avx2_pairs for `rows` (at most R) input rows.
template <class Elem, int R, int NB, class... Args>
__attribute__((target("avx2,fma"))) inline void tile_rows_avx2_pairs(const Problem<Elem>& p, int64_t rows,
                                                                     Args... args) {
  if constexpr (R > 0) {
    if (rows == R) tile_avx2_pairs<Elem, R, NB>(p, args...);
    else tile_rows_avx2_pairs<Elem, R - 1, NB>(p, rows, args...);
  }
}

// Every input row against NB weight rows, two at a time, in balanced tiles of at most 4 input rows (8 rows: two
// tiles of 4, where 3 x 4 tiles leave one of 2); the first tile of each pair streams its weight rows, and the
// next block's rows (`ahead`) are prefetched across all tiles. Against columns_avx2 (fp32) and
// columns_avx2_widened (bf16), one expert's gated MLP on a 2-core Zen 4's AVX2 instructions (8 experts a call,
// Qwen3-30B-A3B's and Qwen1.5-MoE's shapes, old and new builds in turns) took, at 4-16 rows, bf16 0.61-0.96x the
// time (0.77-0.84x at 8), fp32 0.74-0.99x at 4-8 rows and 0.85-1.07x at 10-16, the same sums in fp32. From 20
// rows (fp32) and 32 (bf16) it took up to 1.14x and 1.23x, as each input row is read once per weight pair, not
// per 4 weight rows: those keep the tiles they had (kPairRows).
template <class Elem, int NB>
__attribute__((target("avx2,fma"))) void columns_avx2_pairs(const Problem<Elem>& p, int64_t n, const Elem* ahead) {
  constexpr int kPair = NB >= 2 ? 2 : 1;
  const int64_t tiles = (p.rows + 3) / 4;
  const int64_t all_tiles = tiles * (NB / kPair);
  const int per_tile = static_cast<int>((NB + all_tiles - 1) / all_tiles);  // next-block rows each prefetches
  // fp32 runs the depth in chunks of 512 values, each through every tile, so that a tile's input rows (8 KiB) and
  // weight rows (4 KiB) stay in L1 for the next pair: one expert 0.79-0.97x the time at 4-16 rows, the same sums
  // (skinny_mm at 8 rows, weights from memory: 126 GFLOP/s at a depth of 512, 81 at 2048). bf16, with half the
  // weight bytes, took 0.96-1.12x the time chunked, and runs its whole depth at once.
  constexpr int64_t kChunk = std::is_same_v<Elem, float> ? 512 : int64_t{1} << 40;
  __m256 partial[8 * 2 * 8];  // the sums of each tile between chunks: 8 tiles (31 rows) x 2 pairs x 4 x 2
  for (int64_t k = 0; k < p.depth; k += kChunk) {
    const int64_t k_end = k + kChunk < p.depth / 16 * 16 ? k + kChunk : p.depth;
    int64_t t_all = 0;
    for (int pair = 0; pair < NB; pair += kPair) {
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t, ++t_all) {
        const int64_t rows = (p.rows - m) / (tiles - t) + ((p.rows - m) % (tiles - t) != 0);  // balanced tiles
        const int first = static_cast<int>(std::min<int64_t>(NB, t_all * per_tile));
        const int count = std::min(NB - first, per_tile);
        tile_rows_avx2_pairs<Elem, 4, kPair>(p, rows, m, n + pair, t == 0, ahead, first, count, k, k_end,
                                             partial + t_all * 8);
        m += rows;
      }
    }
    if (k_end == p.depth) break;
  }
}

// 1-2 input rows on AVX2 (rows_of: bf16 at 1-2 rows, fp32 at one): one weight row at a time, each a sequential
// stream, 128 bytes a step, prefetched far once a step (prefetch_stream; once per cache line took 1.17x the time at
// one row). bf16 is split even/odd: a 32-byte load holds 16 values, the even ones the low halves of its 32-bit
// lanes (shifted up), the odd ones the high halves (masked), and each x row is split alike so that the products
// pair up; two integer operations per 16 values. Against the blocks of 8 weight rows (one row, as AVX-512 runs
// them) or the 3 x 4 tiles (2-3 rows) before, one expert's gated MLP on a 2-core Zen 4 (32 experts a call) took,
// in bf16, 0.81-0.83x the time at one row (Qwen3-30B-A3B's and Qwen1.5-MoE's shapes; 0.62-0.65x on one thread;
// 0.83-0.91x the time of three torch.mv per expert on the same AVX2 instructions), 0.68-0.79x at 2 rows and
// 0.83-0.91x at 3; fp32 0.91-0.92x at one row (at 2-3 rows its tiles stay: this loop took 1.08-1.12x their time).
// Since then bf16 at 3 rows and fp32 at 2-3 run the pair tiles (columns_avx2_pairs): 0.70-0.91x this loop's time
// at bf16's 3 rows, 0.97-1.01x at its 2.
template <class Elem, int R>
__attribute__((target("avx2,fma"), noinline)) void stream_rows_avx2(const Problem<Elem>& p, int64_t first,
                                                                    int64_t last) {
  constexpr bool kBf16 = std::is_same_v<Elem, uint16_t>;
  constexpr int64_t kVector = 32 / sizeof(Elem);  // values a 32-byte load holds
  constexpr int kAcc = R == 1 ? 8 : 4;            // accumulators a row: 8 in all, of the 16 registers
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t n = first; n < last; ++n) {
    const Elem* w = p.w + n * p.ldw;
    __m256 acc[R][kAcc];
    for (auto& row : acc)
      for (__m256& a : row) a = _mm256_setzero_ps();
    // acc[m][a] (and acc[m][a + 1] in bf16) += the products of the 32 bytes at k of w and of x's row m
    const auto step = [&](int64_t k, int a) __attribute__((target("avx2,fma"), always_inline)) {
      const __m256i w_raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      for (int m = 0; m < R; ++m) {
        const __m256i x_raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x + m * p.ldx + k));
        if constexpr (kBf16) {
          acc[m][a] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(x_raw, 16)),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(w_raw, 16)), acc[m][a]);
          acc[m][a + 1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(x_raw, high)),
                                          _mm256_castsi256_ps(_mm256_and_si256(w_raw, high)), acc[m][a + 1]);
        } else {
          acc[m][a] = _mm256_fmadd_ps(_mm256_castsi256_ps(x_raw), _mm256_castsi256_ps(w_raw), acc[m][a]);
        }
      }
    };
    constexpr int kPerLoad = kBf16 ? 2 : 1;  // accumulators a load feeds
    int64_t k = 0;
    for (; k + 4 * kVector <= p.depth; k += 4 * kVector) {
      prefetch_stream<true>(w + k);
      for (int q = 0; q < 4; ++q) step(k + q * kVector, q * kPerLoad % kAcc);
    }
    for (; k + kVector <= p.depth; k += kVector) step(k, 0);
    for (int m = 0; m < R; ++m) {
      __m256 sum = acc[m][0];
      for (int a = 1; a < kAcc; ++a) sum = _mm256_add_ps(sum, acc[m][a]);
      finish(p, m, n, k, sum_lanes(sum));
    }
  }
}

// --- the operator -------------------------------------------------------------------------------------------

// AVX2 runs the pair tiles (columns_avx2_pairs) from kFirstPairRows to kPairRows input rows: bf16 from kWidenRows,
// on its input rows split to fp32 once a call (below, stream_rows_avx2), fp32 from 2 rows (one: stream_rows_avx2;
// at 2-3 rows the pairs took 0.83-0.97x the time of columns_avx2 with the far prefetch). From kPairRows on, fp32
// runs columns_avx2, bf16 columns_avx2_widened (on its input rows widened to fp32 in order).
constexpr int64_t kWidenRows = 3;
template <class Elem>
constexpr int64_t kFirstPairRows = std::is_same_v<Elem, uint16_t> ? kWidenRows : 2;
template <class Elem>
constexpr int64_t kPairRows = std::is_same_v<Elem, uint16_t> ? 32 : 17;

// Weight rows per block: on AVX-512, 8 streams keep more loads in flight for 1-3 input rows (~4% more bandwidth
// measured); from 4 rows on, 4 weight rows x 6 input rows keep the 24 accumulators in registers. AVX2 has 16
// registers: 4 weight rows x 3 input rows (one input row, and two of bf16: stream_rows_avx2), in pairs of weight
// rows from kFirstPairRows to kPairRows input rows (columns_avx2_pairs), and bf16 from kPairRows rows on fp32 copies
// (columns_avx2_widened). Those copies, against widening in every tile, on a Zen 3, one expert's gated MLP side
// by side (the same sums, but for a last 1-row tile, which that summed even/odd): Qwen3-30B-A3B's at 8 / 16 / 32
// rows 0.86-0.92 / 0.53 / 0.67x the time (115 GFLOP/s at 32 rows, was 77); Qwen1.5-MoE's at 8 / 16 / 34 rows
// 0.94 / 0.53 / 0.48x.
template <class Elem, int NB>
void run_block(const Problem<Elem>& p, int64_t isa, int64_t n, float* scratch, const Elem* ahead) {
  if (isa == kIsaAvx512Bf16) {
    if constexpr (NB == 8) columns_avx512<Elem, NB, 3>(p, n, ahead);
    else columns_avx512<Elem, NB, 6>(p, n, ahead);
  } else if constexpr (NB > 4) {
    TORCH_CHECK(false, "skinny_mm: AVX2 runs blocks of at most 4 weight rows, got ", NB);  // run_rows never asks
  } else if (p.rows >= kFirstPairRows<Elem> && p.rows < kPairRows<Elem>) {
    columns_avx2_pairs<Elem, NB>(p, n, ahead);
  } else if (p.x_fp32) {
    columns_avx2_widened<Elem, NB>(p, scratch, n, ahead);
  } else {
    columns_avx2<Elem, Elem, NB>(p, p.x, p.ldx, p.w + n * p.ldw, p.ldw, n);
  }
}

// Weight rows [first_row, last_row) of `p`, in blocks: `block` rows (a multiple of 4: 8 or 4), then one by one.
template <class Elem>
void run_rows(const Problem<Elem>& p, int64_t isa, int64_t first_row, int64_t last_row) {
  const int64_t block = isa == kIsaAvx512Bf16 && p.rows <= kStreamRows ? 8 : 4;
  // fp32 copies of a block of weight rows: bf16 on AVX2 from kPairRows rows (columns_avx2_widened) only
  std::vector<float> scratch(p.x_fp32 && p.rows >= kPairRows<Elem> ? block * (p.depth / 8 * 8) : 0);
  int64_t n = first_row;
  for (; n + block <= last_row; n += block) {
    const Elem* ahead = n + 2 * block <= last_row ? p.w + (n + block) * p.ldw : nullptr;
    if (block == 8) run_block<Elem, 8>(p, isa, n, scratch.data(), ahead);
    else run_block<Elem, 4>(p, isa, n, scratch.data(), ahead);
  }
  for (; n < last_row; ++n) run_block<Elem, 1>(p, isa, n, scratch.data(), nullptr);
}

// run_rows, or on AVX2 stream_rows_avx2 for one input row, and for two of bf16. Chosen here, not in run_rows:
// the same branch at the top of run_rows (or a call from there) made AVX2's bf16 expert MLPs of 4-8 rows take
// 1.02-1.16x the time (four runs, both orders, no change to their code but run_rows'), here 0.94-1.03x.
template <class Elem>
void rows_of(const Problem<Elem>& p, int64_t isa, int64_t first_row, int64_t last_row) {
  if (isa == kIsaAvx2 && p.rows == 1) {
    stream_rows_avx2<Elem, 1>(p, first_row, last_row);
    return;
  }
  if constexpr (std::is_same_v<Elem, uint16_t>) {
    if (isa == kIsaAvx2 && p.rows == 2) {
      stream_rows_avx2<Elem, 2>(p, first_row, last_row);
      return;
    }
  }
  run_rows(p, isa, first_row, last_row);
}


// Sets p.x_fp32 where bf16 runs on AVX2's tiles, to the returned copy (which must outlive the calls): for the pair
// tiles, each 16 values of depth as the 8 even ones, then the 8 odd ones (a last part under 16 as it is).
template <class Elem>
std::vector<float> widen_x(Problem<Elem>& p, int64_t isa) {
  std::vector<float> widened;
  if (std::is_same_v<Elem, uint16_t> && isa == kIsaAvx2 && p.rows >= kWidenRows) {
    widened.resize(p.rows * p.depth);
    const int64_t split = p.rows < kPairRows<Elem> ? p.depth / 16 * 16 : 0;  // the values split even/odd
    for (int64_t m = 0; m < p.rows; ++m)
      for (int64_t k = 0; k < p.depth; ++k) {
        const int64_t at = k < split ? k / 16 * 16 + k % 2 * 8 + k % 16 / 2 : k;
        widened[m * p.depth + at] = to_float(p.x[m * p.ldx + k]);
      }
    p.x_fp32 = widened.data();
  }
  return widened;
}

// 128 weight rows per task at least: a thread's share is then worth waking it for. Tasks start at multiples of
// 8 rows, so every block but the last is whole.
constexpr int64_t kRowsPerTask = 128;
constexpr int64_t kRowAlignment = 8;

// f(first, last) over [0, units) in one contiguous share per thread, `grain` units per thread at least.
// Not at::parallel_for: that is header code, and compiled into this library its once-per-thread set-up keeps a
// flag of its own, so its first call on each thread resets that thread's count to the process-wide one, which
// turned a single-threaded worker (kernels/_workers.py) into a 2-thread one for good. at::get_num_threads is
// torch's own exported function: it reads the calling thread's count and changes nothing.
template <class F>
void parallel_units(int64_t units, int64_t grain, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    f(int64_t{0}, units);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t share = (units + omp_get_num_threads() - 1) / omp_get_num_threads();
    const int64_t first = omp_get_thread_num() * share, last = std::min(units, first + share);
    if (first < last) f(first, last);
  }
}

template <class Elem>
void run(Problem<Elem> p, int64_t isa) {
  if (p.rows == 0 || p.columns == 0) return;
  const std::vector<float> widened = widen_x(p, isa);
  const int64_t units = (p.columns + kRowAlignment - 1) / kRowAlignment;
  parallel_units(units, kRowsPerTask / kRowAlignment, [&](int64_t first, int64_t last) {
    rows_of(p, isa, first * kRowAlignment, std::min(last * kRowAlignment, p.columns));
  });
}

template <class Elem>
Problem<Elem> problem(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) {
  return Problem<Elem>{reinterpret_cast<const Elem*>(x.data_ptr()),
                       reinterpret_cast<const Elem*>(w.data_ptr()),
                       reinterpret_cast<Elem*>(out.data_ptr()),
                       x.stride(0), w.stride(0), out.stride(0), x.size(0), w.size(0), x.size(1)};
}

inline float silu(float value) { return value / (1.0f + std::exp(-value)); }

// out = down(silu(gate(x)) * up(x)): gate and up rows are computed by the same thread, block by block, so the
// SiLU product is formed from their fp32 sums in cache (one rounding to Elem, where torch's separate calls round
// gate, up, SiLU and the product each), then the down projection reads the [M, I] hidden rows. `first_row` and
// `rows` select the rows of x and out.
template <class Elem>
void run_silu_mlp(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                  const at::Tensor& out, int64_t first_row, int64_t rows, int64_t isa) {
  if (rows == 0) return;
  const int64_t intermediate = gate.size(0);
  std::vector<float> gate_sums(rows * intermediate), up_sums(rows * intermediate);
  std::vector<Elem> hidden(rows * intermediate);
  Problem<Elem> gate_problem = problem<Elem>(x, gate, out);
  gate_problem.x += first_row * gate_problem.ldx;
  gate_problem.rows = rows;
  const std::vector<float> widened = widen_x(gate_problem, isa);  // read by gate and up
  Problem<Elem> up_problem = gate_problem;
  up_problem.w = reinterpret_cast<const Elem*>(up.data_ptr());
  up_problem.ldw = up.stride(0);
  gate_problem.out_fp32 = gate_sums.data();
  up_problem.out_fp32 = up_sums.data();
  gate_problem.ldo = up_problem.ldo = intermediate;
  const int64_t units = (intermediate + kRowAlignment - 1) / kRowAlignment;
  // Half the rows per task of a plain GEMM: each task streams two weights.
  parallel_units(units, kRowsPerTask / kRowAlignment / 2, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kRowAlignment, end = std::min(last * kRowAlignment, intermediate);
    rows_of(gate_problem, isa, begin, end);
    rows_of(up_problem, isa, begin, end);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = begin; n < end; ++n) {
        const int64_t at = m * intermediate + n;
        store(hidden.data() + at, silu(gate_sums[at]) * up_sums[at]);
      }
  });
  const Problem<Elem> down_problem{hidden.data(),
                                   reinterpret_cast<const Elem*>(down.data_ptr()),
                                   reinterpret_cast<Elem*>(out.data_ptr()) + first_row * out.stride(0),
                                   intermediate, down.stride(0), out.stride(0), rows, down.size(0), intermediate};
  run(down_problem, isa);
}

void check_operands(const char* op, const std::vector<const at::Tensor*>& tensors, int64_t isa) {
  const auto dtype = tensors.front()->scalar_type();
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && t->scalar_type() == dtype, op,
                ": every operand must be bfloat16, or every one float32; got ", dtype, " and ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU tensors only, got one on ", t->device());
    TORCH_CHECK(t->dim() == 2, op, ": every operand must be 2-D, got one of shape ", t->sizes());
    TORCH_CHECK(t->stride(1) == 1, op, ": the last dimension of every operand must be contiguous");
  }
  TORCH_CHECK(isa_supported(isa), op, ": instruction set ", isa, " is not supported by this CPU");
}

void skinny_mm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t isa) {
  check_operands("skinny_mm", {&x, &w, &out}, isa);
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_mm: x is ", x.sizes(), " but w is ", w.sizes(),
              ": their last dimensions must match");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "skinny_mm: out must be [", x.size(0), ", ",
              w.size(0), "], got ", out.sizes());
  if (x.scalar_type() == at::kBFloat16) run(problem<uint16_t>(x, w, out), isa);
  else run(problem<float>(x, w, out), isa);
}

void check_expert(const char* op, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down) {
  const int64_t hidden = x.size(1), intermediate = gate.size(0);
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.size(1) == hidden && down.size(0) == hidden &&
                  down.size(1) == intermediate,
              op, ": expected gate and up [I, H] and down [H, I] for x [M, H] = ", x.sizes(), ", got gate ",
              gate.sizes(), ", up ", up.sizes(), ", down ", down.sizes());
}

void skinny_silu_mlp(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                     at::Tensor out, int64_t isa) {
  check_operands("skinny_silu_mlp", {&x, &gate, &up, &down, &out}, isa);
  check_expert("skinny_silu_mlp", x, gate, up, down);
  TORCH_CHECK(out.sizes() == x.sizes(), "skinny_silu_mlp: out must be ", x.sizes(), ", got ", out.sizes());
  if (x.scalar_type() == at::kBFloat16) run_silu_mlp<uint16_t>(x, gate, up, down, out, 0, x.size(0), isa);
  else run_silu_mlp<float>(x, gate, up, down, out, 0, x.size(0), isa);
}

// Several experts in one call (no Python between them): expert j runs on rows [bounds[2j], bounds[2j + 1]) of x
// and writes the same rows of out.
void skinny_silu_experts(const at::Tensor& x, at::TensorList gates, at::TensorList ups, at::TensorList downs,
                         at::IntArrayRef bounds, at::Tensor out, int64_t isa) {
  const size_t experts = gates.size();
  TORCH_CHECK(ups.size() == experts && downs.size() == experts && bounds.size() == 2 * experts,
              "skinny_silu_experts: expected as many gates, ups and downs as experts and two row bounds each, got ",
              gates.size(), ", ", ups.size(), ", ", downs.size(), " and ", bounds.size());
  TORCH_CHECK(out.sizes() == x.sizes(), "skinny_silu_experts: out must be ", x.sizes(), ", got ", out.sizes());
  std::vector<const at::Tensor*> operands{&x, &out};
  for (size_t j = 0; j < experts; ++j) {
    operands.insert(operands.end(), {&gates[j], &ups[j], &downs[j]});
    check_expert("skinny_silu_experts", x, gates[j], ups[j], downs[j]);
    TORCH_CHECK(0 <= bounds[2 * j] && bounds[2 * j] <= bounds[2 * j + 1] && bounds[2 * j + 1] <= x.size(0),
                "skinny_silu_experts: expert ", j, "'s rows [", bounds[2 * j], ", ", bounds[2 * j + 1],
                ") are not within the ", x.size(0), " rows of x");
  }
  check_operands("skinny_silu_experts", operands, isa);
  for (size_t j = 0; j < experts; ++j) {
    const int64_t first = bounds[2 * j], rows = bounds[2 * j + 1] - bounds[2 * j];
    if (x.scalar_type() == at::kBFloat16) run_silu_mlp<uint16_t>(x, gates[j], ups[j], downs[j], out, first, rows, isa);
    else run_silu_mlp<float>(x, gates[j], ups[j], downs[j], out, first, rows, isa);
  }
}

}  // namespace

// The namespace is the extension's name, which carries a digest of this file: an edited kernel is a new op.
// (TORCH_LIBRARY pastes its argument as written; one more macro level expands TORCH_EXTENSION_NAME first.)
#define LAYERSWAP_LIBRARY(name, module) TORCH_LIBRARY(name, module)
LAYERSWAP_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_mm(Tensor x, Tensor w, Tensor(a!) out, int isa) -> ()", &skinny_mm);
  m.def("skinny_silu_mlp(Tensor x, Tensor gate, Tensor up, Tensor down, Tensor(a!) out, int isa) -> ()",
        &skinny_silu_mlp);
  m.def("skinny_silu_experts(Tensor x, Tensor[] gates, Tensor[] ups, Tensor[] downs, int[] bounds, "
        "Tensor(a!) out, int isa) -> ()",
        &skinny_silu_experts);
  m.def("isa_supported(int isa) -> bool", &isa_supported);
}
