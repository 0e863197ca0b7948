// layerswap's hand-written CPU kernel: the skinny bf16 GEMM `out = x @ w.T` of an MoE expert with a few rows.
//
// Why: at 1-3 rows an expert's GEMM is a pure weight stream. torch's bf16 engines (oneDNN's GEMM either way
// round, torch.mv) read the weight at 70-85% of what the memory delivers; this loop reads it at 95%+ of a plain
// AVX-512 read of the same bytes (measured on a 2-core Sapphire Rapids: 24.7 GB/s against 25.5 for the read,
// 21.4 for torch.mv, 17.7 for stock's `x @ W.T`). From ~4 rows on it is compute-bound on AVX512-BF16's dot
// product, where oneDNN's AMX path wins; the CPU dispatch (cpu_dispatch.py) measures which engine each row count
// gets on this machine, so this kernel only runs where it is faster.
//
// Math: out[m, n] = sum_k x[m, k] * w[n, k], bf16 operands, fp32 accumulation, one rounding to bf16 at the
// end (round to nearest even), like torch's bf16 GEMM; only the order of the fp32 additions differs.
// Threads: at::parallel_for over blocks of weight rows, so torch.set_num_threads (and a single-threaded worker
// thread) applies. Compiled with -fopenmp but not linked to an OpenMP runtime: GOMP_* resolve to the one
// torch itself loaded, so both share one thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kIsaAvx2 = 1;        // AVX2 + FMA: bf16 widened to fp32, fused multiply-add
constexpr int64_t kIsaAvx512Bf16 = 2;  // AVX512-BF16: vdpbf16ps, two products per fp32 lane
constexpr int64_t kPrefetchElements = 256;  // 512 bytes (8 cache lines) ahead of each weight row's loads

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

struct Problem {
  const uint16_t* x;
  const uint16_t* w;
  uint16_t* out;
  int64_t ldx, ldw, ldo, rows, columns, depth;  // M, N, K
};

// --- AVX512-BF16 --------------------------------------------------------------------------------------------

// An MB x NB tile of `out`: MB input rows against NB weight rows, 32 bf16 of depth per step.
template <int MB, int NB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void tile_avx512(
    const Problem& p, int64_t m, int64_t n) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m * p.ldx;
  const uint16_t* w = p.w + n * p.ldw;
  int64_t k = 0;
  for (; k + 32 <= p.depth; k += 32) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(w + j * p.ldw + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * p.ldw + k + kPrefetchElements), _MM_HINT_T0);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * p.ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  if (k < p.depth) {  // depth not a multiple of 32: masked loads read zeros past the end
    const __mmask32 mask = static_cast<__mmask32>((1ull << (p.depth - k)) - 1);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * p.ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + i * p.ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      p.out[(m + i) * p.ldo + n + j] = round_to_bf16(_mm512_reduce_add_ps(acc[i][j]));
}

// Every input row against NB weight rows: MB rows at a time, the weight rows staying in L1 between them.
template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void columns_avx512(const Problem& p, int64_t n) {
  int64_t m = 0;
  for (; m + MB <= p.rows; m += MB) tile_avx512<MB, NB>(p, m, n);
  switch (p.rows - m) {  // the remaining rows (fewer than MB <= 6)
    case 5: tile_avx512<5, NB>(p, m, n); break;
    case 4: tile_avx512<4, NB>(p, m, n); break;
    case 3: tile_avx512<3, NB>(p, m, n); break;
    case 2: tile_avx512<2, NB>(p, m, n); break;
    case 1: tile_avx512<1, NB>(p, m, n); break;
    default: break;
  }
}

// --- AVX2 + FMA ---------------------------------------------------------------------------------------------

__attribute__((target("avx2,fma"))) inline __m256 widen_bf16(const uint16_t* source) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

inline float widen_one(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

template <int MB, int NB>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const Problem& p, int64_t m, int64_t n) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* x = p.x + m * p.ldx;
  const uint16_t* w = p.w + n * p.ldw;
  int64_t k = 0;
  for (; k + 8 <= p.depth; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = widen_bf16(w + j * p.ldw + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * p.ldw + k + kPrefetchElements), _MM_HINT_T0);
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = widen_bf16(x + i * p.ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float total = sum_lanes(acc[i][j]);
      for (int64_t t = k; t < p.depth; ++t)  // depth not a multiple of 8
        total += widen_one(x[i * p.ldx + t]) * widen_one(w[j * p.ldw + t]);
      p.out[(m + i) * p.ldo + n + j] = round_to_bf16(total);
    }
}

template <int NB>
__attribute__((target("avx2,fma"))) void columns_avx2(const Problem& p, int64_t n) {
  constexpr int MB = 3;  // 3 x 4 accumulators + 4 weight vectors + 1 input vector fit the 16 ymm registers
  int64_t m = 0;
  for (; m + MB <= p.rows; m += MB) tile_avx2<MB, NB>(p, m, n);
  switch (p.rows - m) {
    case 2: tile_avx2<2, NB>(p, m, n); break;
    case 1: tile_avx2<1, NB>(p, m, n); break;
    default: break;
  }
}

// --- the operator -------------------------------------------------------------------------------------------

// Weight rows per block: 8 streams keep more loads in flight for 1-3 input rows (~4% more bandwidth measured);
// from 4 rows on, 4 weight rows x 6 input rows keep the 24 accumulators in registers.
template <int NB>
void run_block(const Problem& p, int64_t isa, int64_t n) {
  if (isa == kIsaAvx512Bf16) {
    if constexpr (NB == 8) columns_avx512<NB, 3>(p, n);
    else columns_avx512<NB, 6>(p, n);
  } else {
    columns_avx2<NB>(p, n);
  }
}

void skinny_mm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "skinny_mm: x, w and out must be bfloat16, got ", x.scalar_type(), ", ", w.scalar_type(), ", ",
              out.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "skinny_mm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "skinny_mm: x, w and out must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_mm: x is ", x.sizes(), " but w is ", w.sizes(),
              ": their last dimensions must match");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "skinny_mm: out must be [", x.size(0), ", ",
              w.size(0), "], got ", out.sizes());
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1,
              "skinny_mm: the last dimension of x, w and out must be contiguous");
  TORCH_CHECK(isa_supported(isa), "skinny_mm: instruction set ", isa, " is not supported by this CPU");
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()),
                  reinterpret_cast<const uint16_t*>(w.data_ptr()),
                  reinterpret_cast<uint16_t*>(out.data_ptr()),
                  x.stride(0), w.stride(0), out.stride(0), x.size(0), w.size(0), x.size(1)};
  if (p.rows == 0 || p.columns == 0) return;
  const int64_t block = (isa == kIsaAvx512Bf16 && p.rows <= 3) ? 8 : 4;
  const int64_t blocks = p.columns / block;
  // 16 blocks (64-128 weight rows) per task at least: a thread's share is then worth waking it for.
  at::parallel_for(0, blocks + 1, 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      if (b < blocks) {
        if (block == 8) run_block<8>(p, isa, b * block);
        else run_block<4>(p, isa, b * block);
      } else {  // the last columns % block weight rows, one at a time
        for (int64_t n = blocks * block; n < p.columns; ++n) run_block<1>(p, isa, n);
      }
    }
  });
}

}  // namespace

// The namespace is the extension's name, which carries a digest of this file: an edited kernel is a new op.
// (TORCH_LIBRARY pastes its argument as written; one more macro level expands TORCH_EXTENSION_NAME first.)
#define LAYERSWAP_LIBRARY(name, module) TORCH_LIBRARY(name, module)
LAYERSWAP_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_mm(Tensor x, Tensor w, Tensor(a!) out, int isa) -> ()", &skinny_mm);
  m.def("isa_supported(int isa) -> bool", &isa_supported);
}
