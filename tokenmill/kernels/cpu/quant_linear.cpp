// Products with weights kept quantized in memory (quant_packed.h's layout).
//
// quantized_linear: y [M, N] = x [M, K] @ w^T (+ bias), x and y fp32 or bf16; the packed weight is
// never dequantized whole.
//   Panels layout, any rows: x is quantized per block to activation_passes int8 passes (two: value
//   and residual; one: the value) and multiplied in integers (quant_int8_dot.cpp; quant_int16_dot.cpp
//   on AVX2 without AVX512-VNNI).
//   Rows layout, few rows (M <= stream_max_rows), in fp32: threads split the output columns in
//   blocks of 4 weight rows, each 32-value run dequantized (times its scale) into registers and
//   multiplied against up to 4 rows of x at a time; an int4 group's min is added once per group as
//   min * sum(x over the group). With AVX2 alone (16 registers) the same for up to 2 rows, 2 at a
//   time; for more, each block of 4 weight rows is dequantized once into L1 and multiplied against
//   every row of x, taken ~128 KiB of x at a time. More rows than stream_max_rows: the weight is
//   dequantized to x's dtype a chunk of rows at a time and multiplied by torch's CPU BLAS.
// dequantize_weight: a weight (either layout) whole in `dtype` (fp32 or bf16), for the panels layout's
// many rows (kernels/quant_linear.py) and tests.
// int8_dot_isa: which panels-layout path this build has ("avx512-vnni", "avx2" or ""); int8_dot_tiles:
// whether that path uses AMX-INT8 tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_packed.h"
#include "simd.h"

namespace {

using tokenmill_quant::kBlock;
using tokenmill_quant::kRun;
using tokenmill_quant::Packed;
using tokenmill_quant::row_bytes;
using tokenmill_simd::bf16_t;
using tokenmill_simd::horizontal_sum4;
using tokenmill_simd::load16;
using tokenmill_simd::store16;
using tokenmill_simd::vec16;

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// 16 bytes widened to fp32, as unsigned values or (signed) as int8 ones. Through int32 vectors: a
// direct byte-to-float conversion compiles to scalar code with GCC 12; these are vpmovzxbd (plus
// a re-bias for signed bytes) and vcvtdq2ps.
inline vec16 widen_unsigned(u8x16 bytes) { return __builtin_convertvector(__builtin_convertvector(bytes, i32x16), vec16); }

inline vec16 widen_signed(u8x16 bytes) {
  const u8x16 biased = bytes ^ static_cast<uint8_t>(0x80);  // int8 v as the byte v + 128
  return __builtin_convertvector(__builtin_convertvector(biased, i32x16) - 128, vec16);
}


// The index into scale/min of value k of weight row n (no division on this hot path).
inline int64_t group_index(const Packed& p, int64_t n, int64_t k) {
  return n * p.groups_per_row + (p.group_shift >= 0 ? k >> p.group_shift : 0);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The 32 values of a run of a kBits-bit weight (its bytes from q) as q (unscaled) in four 8-wide
// vectors, in order.
template <int kBits>
__attribute__((always_inline)) inline void unpack_run_avx2(const uint8_t* q, __m256 w[4]) {
  if constexpr (kBits == 8) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
    }
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

inline void unpack_run_avx2(const Packed& p, const uint8_t* q, __m256 w[4]) {
  if (p.bits == 8) {
    unpack_run_avx2<8>(q, w);
  } else {
    unpack_run_avx2<4>(q, w);
  }
}
#endif

// The 32 values [k, k + 32) of weight row n as q (int8 weights: the signed value; int4: 0..15)
// times the group's scale, in two 16-wide halves; an int4 group's min is added per group by the
// caller (min * the sum of x over the group), not per value.
__attribute__((always_inline)) inline void scaled_run(const Packed& p, int64_t n, int64_t k, float scale, vec16& lo, vec16& hi) {
  const uint8_t* q = row_bytes(p, n, k);
#if defined(__AVX512F__)
  // the widening as the two instructions it needs (the generic path below is correct everywhere,
  // but GCC 12 moves its bytes through general registers first)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  if (p.bits == 8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) * scale;
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))) * scale;
  } else {
    const __m128i nibble = _mm_set1_epi8(15);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble))) * scale;
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble))) * scale;
  }
#elif defined(__AVX2__)
  __m256 w[4];
  unpack_run_avx2(p, q, w);
  const __m256 s = _mm256_set1_ps(scale);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], s);
  std::memcpy(&lo, &w[0], sizeof(w[0]));
  std::memcpy(reinterpret_cast<char*>(&lo) + sizeof(w[0]), &w[1], sizeof(w[1]));
  std::memcpy(&hi, &w[2], sizeof(w[2]));
  std::memcpy(reinterpret_cast<char*>(&hi) + sizeof(w[2]), &w[3], sizeof(w[3]));
#else
  u8x16 bytes;
  std::memcpy(&bytes, q, sizeof(bytes));
  if (p.bits == 8) {
    lo = widen_signed(bytes) * scale;
    std::memcpy(&bytes, q + 16, sizeof(bytes));
    hi = widen_signed(bytes) * scale;
  } else {
    lo = widen_unsigned(bytes & 15) * scale;
    hi = widen_unsigned(bytes >> 4) * scale;
  }
#endif
}

// y[m, n0 + j] for the kRows rows m of x (fp32 [*, K], from row m0) and the weight rows n0 + j < n0 +
// valid: every run is dequantized into registers once and multiplied against the kRows rows of x
// with kRows x 4 vector accumulators. xsum[m * groups_per_row + g]: the sum of x's row m over
// group g (int4's min term).
template <int kRows>
void tile_product(const Packed& p, const float* x, const float* xsum, int64_t m0, int64_t n0, int64_t valid,
                  float* y) {
  vec16 acc[kRows][kBlock] = {};
  float min_terms[kRows][kBlock] = {};
  const int64_t k_dim = p.k_dim, runs_per_group = p.group / kRun;
  // rows past the last (N not a multiple of 4) repeat the last one: computed, never stored
  int64_t rows[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) rows[j] = n0 + std::min(j, valid - 1);
  if (n0 + kBlock < p.n_out) {  // the next block's rows: rows are short streams the hardware does not prefetch
    const int64_t stride = p.bits == 8 ? k_dim : k_dim / 2;
    const int64_t next_rows = std::min(kBlock, p.n_out - n0 - kBlock);
    tokenmill_simd::prefetch_range(row_bytes(p, n0 + kBlock, 0), next_rows * stride);
  }
  for (int64_t g = 0; g < p.groups_per_row; ++g) {
    float scale[kBlock];
#pragma GCC unroll 4
    for (int64_t j = 0; j < kBlock; ++j) scale[j] = p.scale[rows[j] * p.groups_per_row + g];
    if (p.has_min) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlock; ++j) {
        const float min = p.min[rows[j] * p.groups_per_row + g];
        for (int m = 0; m < kRows; ++m) min_terms[m][j] += min * xsum[(m0 + m) * p.groups_per_row + g];
      }
    }
    for (int64_t r = 0; r < runs_per_group; ++r) {
      const int64_t k = g * p.group + r * kRun;
      vec16 lo[kBlock], hi[kBlock];
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlock; ++j) scaled_run(p, rows[j], k, scale[j], lo[j], hi[j]);
#pragma GCC unroll 4
      for (int m = 0; m < kRows; ++m) {
        const vec16 x_lo = load16(x + (m0 + m) * k_dim + k), x_hi = load16(x + (m0 + m) * k_dim + k + 16);
#pragma GCC unroll 4
        for (int64_t j = 0; j < kBlock; ++j) {
          acc[m][j] += lo[j] * x_lo;  // two statements: two fused multiply-adds
          acc[m][j] += hi[j] * x_hi;
        }
      }
    }
  }
  for (int m = 0; m < kRows; ++m) {
    const tokenmill_simd::vec4 s = horizontal_sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    for (int64_t j = 0; j < valid; ++j) y[(m0 + m) * p.n_out + n0 + j] = s[j] + min_terms[m][j];
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The sums of the 8 lanes of acc[0..3], in order: lanes 0-3 of `both` sum their low halves pairwise,
// lanes 4-7 their high ones.
inline __m128 horizontal_sums_avx2(const __m256 acc[kBlock]) {
  const __m256 both = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  return _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
}

// The first `valid` of the 4 sums to y (the block's last rows past the weight's end are dropped).
inline void store_valid(__m128 sums, int64_t valid, float* y) {
  alignas(16) float s[kBlock];
  _mm_store_ps(s, sums);
  for (int64_t j = 0; j < valid; ++j) y[j] = s[j];
}

// tile_product for AVX2's 16 registers: the same sums, ordered to fit kRows (<= 2) x 4 8-wide
// accumulators: each run of each of the 4 weight rows is unpacked once and dotted with every row of x
// unscaled, the run's sum then added times its group's scale; an int4 weight's min terms (min times
// the sum of x over the group) are one dot product per weight row and row of x over the groups, last.
template <int kRows, int kBits>
void tile_product_avx2(const Packed& p, const float* x, const float* xsum, int64_t m0, int64_t n0, int64_t valid,
                       float* y) {
  __m256 acc[kRows][kBlock];
  for (int m = 0; m < kRows; ++m) {
    for (int64_t j = 0; j < kBlock; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  const int64_t k_dim = p.k_dim, groups = p.groups_per_row, runs_per_group = p.group / kRun;
  int64_t rows[kBlock];  // as in tile_product: rows past the last repeat it, never stored
  const uint8_t* bytes[kBlock];
  const float* scales[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) {
    rows[j] = n0 + std::min(j, valid - 1);
    bytes[j] = row_bytes(p, rows[j], 0);
    scales[j] = p.scale + rows[j] * groups;
  }
  if (n0 + kBlock < p.n_out) {
    const int64_t stride = kBits == 8 ? k_dim : k_dim / 2;
    tokenmill_simd::prefetch_range(row_bytes(p, n0 + kBlock, 0), std::min(kBlock, p.n_out - n0 - kBlock) * stride);
  }
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < runs_per_group; ++r) {
      const int64_t k = g * p.group + r * kRun;
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlock; ++j) {
        __m256 w[4];
        unpack_run_avx2<kBits>(bytes[j] + (kBits == 8 ? k : k / 2), w);
        const __m256 scale = _mm256_broadcast_ss(scales[j] + g);
#pragma GCC unroll 2
        for (int m = 0; m < kRows; ++m) {
          const float* xr = x + (m0 + m) * k_dim + k;
          __m256 run = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
#pragma GCC unroll 3
          for (int i = 1; i < 4; ++i) run = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), run);
          acc[m][j] = _mm256_fmadd_ps(run, scale, acc[m][j]);
        }
      }
    }
  }
  float min_terms[kRows][kBlock] = {};
  if (p.has_min) {
    for (int m = 0; m < kRows; ++m) {
      const float* xs = xsum + (m0 + m) * groups;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float* mins = p.min + rows[j] * groups;
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) total += mins[g] * xs[g];
        min_terms[m][j] = total;
      }
    }
  }
  for (int m = 0; m < kRows; ++m) {
    const __m128 s = _mm_add_ps(horizontal_sums_avx2(acc[m]), _mm_loadu_ps(min_terms[m]));
    store_valid(s, valid, y + (m0 + m) * p.n_out + n0);
  }
}

// Weight rows rows[0..3] dequantized whole into block [4][K] (q * scale + min, the values
// dequantize_into writes).
void dequantize_block_avx2(const Packed& p, const int64_t rows[kBlock], float* block) {
  for (int64_t j = 0; j < kBlock; ++j) {
    for (int64_t k = 0; k < p.k_dim; k += kRun) {
      const int64_t g = group_index(p, rows[j], k);
      __m256 w[4];
      unpack_run_avx2(p, row_bytes(p, rows[j], k), w);
      const __m256 scale = _mm256_set1_ps(p.scale[g]), min = _mm256_set1_ps(p.has_min ? p.min[g] : 0.f);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(block + j * p.k_dim + k + 8 * i, _mm256_fmadd_ps(w[i], scale, min));
    }
  }
}

// y[m, n0 + j] for kRows (<= 2) rows of x from m0 and the 4 dequantized weight rows of `block`: an
// fp32 product, kRows x 4 accumulators.
template <int kRows>
void block_tile_avx2(const float* block, int64_t k_dim, const float* x, int64_t m0, int64_t n0, int64_t valid,
                     int64_t n_out, float* y) {
  __m256 acc[kRows][kBlock];
  for (int m = 0; m < kRows; ++m) {
    for (int64_t j = 0; j < kBlock; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_dim; k += 8) {
    __m256 w[kBlock];
#pragma GCC unroll 4
    for (int64_t j = 0; j < kBlock; ++j) w[j] = _mm256_loadu_ps(block + j * k_dim + k);
#pragma GCC unroll 2
    for (int m = 0; m < kRows; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * k_dim + k);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlock; ++j) acc[m][j] = _mm256_fmadd_ps(w[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < kRows; ++m) store_valid(horizontal_sums_avx2(acc[m]), valid, y + (m0 + m) * n_out + n0);
}

constexpr int64_t kStreamRowsAvx2 = 2;  // measured: from 3 rows on, the buffered product is faster

// One block of 4 weight rows against all m_rows rows of x: up to kStreamRowsAvx2 rows, each run
// unpacked into registers (tile_product_avx2); more, the block dequantized once into a buffer the
// thread keeps (in L1) and multiplied in fp32 against every row, two at a time.
void block_product(const Packed& p, const float* x, const float* xsum, int64_t m_rows, int64_t n0, float* y) {
  const int64_t valid = std::min(kBlock, p.n_out - n0);
  int64_t m0 = 0;
  if (m_rows <= kStreamRowsAvx2) {
    const auto tile = [&](auto rows_of_x, int64_t m) {
      if (p.bits == 8) {
        tile_product_avx2<decltype(rows_of_x)::value, 8>(p, x, xsum, m, n0, valid, y);
      } else {
        tile_product_avx2<decltype(rows_of_x)::value, 4>(p, x, xsum, m, n0, valid, y);
      }
    };
    for (; m0 + 2 <= m_rows; m0 += 2) tile(std::integral_constant<int, 2>(), m0);
    if (m0 < m_rows) tile(std::integral_constant<int, 1>(), m0);
    return;
  }
  thread_local std::vector<float> block;
  if (static_cast<int64_t>(block.size()) < kBlock * p.k_dim) block.resize(kBlock * p.k_dim);
  int64_t rows[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) rows[j] = n0 + std::min(j, valid - 1);
  dequantize_block_avx2(p, rows, block.data());
  for (; m0 + 2 <= m_rows; m0 += 2) block_tile_avx2<2>(block.data(), p.k_dim, x, m0, n0, valid, p.n_out, y);
  if (m0 < m_rows) block_tile_avx2<1>(block.data(), p.k_dim, x, m0, n0, valid, p.n_out, y);
}
#else
// tile_product over all m_rows rows of x, four at a time.
void block_product(const Packed& p, const float* x, const float* xsum, int64_t m_rows, int64_t n0, float* y) {
  const int64_t valid = std::min(kBlock, p.n_out - n0);
  int64_t m0 = 0;
  for (; m0 + 4 <= m_rows; m0 += 4) tile_product<4>(p, x, xsum, m0, n0, valid, y);
  switch (m_rows - m0) {
    case 3: tile_product<3>(p, x, xsum, m0, n0, valid, y); break;
    case 2: tile_product<2>(p, x, xsum, m0, n0, valid, y); break;
    case 1: tile_product<1>(p, x, xsum, m0, n0, valid, y); break;
    default: break;
  }
}
#endif


// Weight rows [row_begin, row_end) of a rows-layout weight into `out` (row-major, from row_begin's).
template <typename T>
void dequantize_into(const Packed& p, int64_t row_begin, int64_t row_end, T* out) {
  at::parallel_for(row_begin, row_end, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < p.k_dim; k += kRun) {
        const int64_t g = group_index(p, n, k);
        vec16 lo, hi;
        scaled_run(p, n, k, p.scale[g], lo, hi);
        const float min = p.has_min ? p.min[g] : 0.f;
        store16(out + (n - row_begin) * p.k_dim + k, lo + min);
        store16(out + (n - row_begin) * p.k_dim + k + 16, hi + min);
      }
    }
  });
}


// A panels-layout weight whole into row-major `out` [N, K]: per panel, each row's values 16 at a time
// (four quads: lane r's 4 bytes of each), scaled (and shifted by the min) per group.
template <typename T>
void dequantize_panels_into(const Packed& p, T* out) {
  const int64_t quads = p.k_dim / 4;
  at::parallel_for(0, p.n_out / tokenmill_quant::kPanel, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float values[16];
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t r = 0; r < tokenmill_quant::kPanel; ++r) {
        T* row = out + (panel * tokenmill_quant::kPanel + r) * p.k_dim;
        for (int64_t t0 = 0; t0 < quads; t0 += 4) {
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t t = t0 + j;
            const uint8_t* q = tokenmill_quant::quad_bytes(p, panel, p.bits == 8 ? t : t & ~int64_t{1});
            for (int64_t i = 0; i < 4; ++i) {
              values[4 * j + i] = p.bits == 8 ? static_cast<float>(static_cast<int8_t>(q[4 * r + i]))
                                  : t % 2 == 0 ? static_cast<float>(q[4 * r + i] & 15)
                                               : static_cast<float>(q[4 * r + i] >> 4);
            }
          }
          const int64_t at = (panel * p.groups_per_row + 4 * t0 / p.group) * tokenmill_quant::kPanel + r;
          vec16 v = load16(values) * tokenmill_quant::panel_scale(p, at);
          if (p.has_min) v += tokenmill_quant::panel_scale(p, at, true);
          store16(row + 4 * t0, v);
        }
      }
    }
  });
}


// y [M, N] = x [M, K] @ w^T in fp32, streaming the packed weight (the header's few-rows fp32 path).
void fp32_product(const Packed& p, const float* xp, int64_t m_rows, float* y) {
  std::vector<float> xsum;  // int4: each row of x summed over each group (the min terms)
  if (p.has_min) {
    xsum.resize(m_rows * p.groups_per_row);
    for (int64_t m = 0; m < m_rows; ++m) {
      for (int64_t g = 0; g < p.groups_per_row; ++g) {
        const float* xg = xp + m * p.k_dim + g * p.group;
        vec16 total = {};
        for (int64_t k = 0; k < p.group; k += 16) total += load16(xg + k);
        xsum[m * p.groups_per_row + g] = tokenmill_simd::horizontal_sum(total);
      }
    }
  }
  // rows of x a thread takes through its blocks at a time: ~128 KiB of x, kept in L2 while its weight
  // rows stream past
  const int64_t chunk_rows = std::max<int64_t>(8, (int64_t{32} << 10) / p.k_dim);
  at::parallel_for(0, (p.n_out + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += chunk_rows) {
      const int64_t count = std::min(chunk_rows, m_rows - m0);
      const float* chunk_xsum = p.has_min ? xsum.data() + m0 * p.groups_per_row : nullptr;
      for (int64_t block = begin; block < end; ++block) {
        block_product(p, xp + m0 * p.k_dim, chunk_xsum, count, block * kBlock, y + m0 * p.n_out);
      }
    }
  });
}

constexpr int64_t kChunkValues = int64_t{1} << 20;  // weight values dequantized at a time (4 MB in fp32)

// y [M, N] = x [M, K] @ w^T for a rows-layout weight and many rows of x (fp32 or bf16): the weight
// is dequantized to x's dtype a chunk of rows at a time into a buffer the calling thread keeps (no
// weight-sized temporary, with its page faults, per call; the chunk still in cache for its product),
// each chunk multiplied into its columns of y by at::mm_out (torch's CPU BLAS).
at::Tensor dequantized_product(const Packed& p, const at::Tensor& x) {
  const int64_t chunk = std::min(p.n_out, std::max(kBlock, kChunkValues / p.k_dim / kBlock * kBlock));
  thread_local at::Tensor buffer_f32, buffer_bf16;
  at::Tensor& buffer = x.scalar_type() == at::kFloat ? buffer_f32 : buffer_bf16;
  if (!buffer.defined() || buffer.numel() < chunk * p.k_dim) buffer = at::empty({chunk * p.k_dim}, x.options());
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({x.size(0), p.n_out}, x.options());
  for (int64_t n0 = 0; n0 < p.n_out; n0 += chunk) {
    const int64_t count = std::min(chunk, p.n_out - n0);
    const at::Tensor w = buffer.narrow(0, 0, count * p.k_dim).view({count, p.k_dim});
    if (x.scalar_type() == at::kFloat) {
      dequantize_into(p, n0, n0 + count, w.data_ptr<float>());
    } else {
      dequantize_into(p, n0, n0 + count, reinterpret_cast<bf16_t*>(w.data_ptr()));
    }
    at::Tensor columns = out.narrow(1, n0, count);
    at::mm_out(columns, rows, w.t());
  }
  return out;
}

}  // namespace

namespace tokenmill_quant {

Packed packed_operands(const at::Tensor& qweight, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                       int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK((qweight.dim() == 2 || qweight.dim() == 3) && qweight.is_contiguous() && scale.is_contiguous(),
              "contiguous operands, qweight 2-D (rows layout) or 3-D (panels)");
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "int8 weights are int8, int4 uint8");
  const bool panels = qweight.dim() == 3;
  if (panels) {
    TORCH_CHECK(qweight.size(2) == (bits == 8 ? 64 : 32), "a panels-layout quad is 64 (int8) or 32 (int4) bytes");
  }
  const int64_t n_out = panels ? qweight.size(0) * kPanel : qweight.size(0);
  const int64_t k_dim = panels ? 4 * qweight.size(1) : bits == 8 ? qweight.size(1) : 2 * qweight.size(1);
  const bool panel_int8_group = panels && bits == 8 && group == tokenmill_quant::kPanelInt8Group;
  TORCH_CHECK((group % kRun == 0 || panel_int8_group) && group > 0 && k_dim % group == 0, "group ", group,
              " must be a multiple of 32 (16: int8 in the panels layout) dividing K=", k_dim);
  const bool fp16_scales = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((scale.scalar_type() == at::kFloat || (panels && fp16_scales)) && scale.numel() == n_out * (k_dim / group),
              "scale: fp32 (the panels layout: fp32 or fp16), one per group");
  const bool has_min = min.has_value() && min->defined();
  TORCH_CHECK(has_min == (bits == 4), "int4 weights need mins, int8 weights have none");
  if (has_min) {
    TORCH_CHECK(min->scalar_type() == scale.scalar_type() && min->is_contiguous() && min->numel() == scale.numel(),
                "min: the dtype and size of scale");
  }
  int64_t shift = 0;
  while ((int64_t{1} << shift) < group) ++shift;
  if ((int64_t{1} << shift) != group) shift = -1;
  TORCH_CHECK(shift >= 0 || group == k_dim, "a group size that is not a power of two must be all of K");
  Packed p{qweight.data_ptr()};
  if (fp16_scales) {
    p.scale_fp16 = scale.data_ptr<at::Half>();
    p.min_fp16 = has_min ? min->data_ptr<at::Half>() : nullptr;
  } else {
    p.scale = scale.data_ptr<float>();
    p.min = has_min ? min->data_ptr<float>() : nullptr;
  }
  p.has_min = has_min;
  p.bits = bits;
  p.group = group;
  p.n_out = n_out;
  p.k_dim = k_dim;
  p.groups_per_row = k_dim / group;
  p.group_shift = shift;
  p.panels = panels;
  return p;
}

}  // namespace tokenmill_quant

at::Tensor dequantize_weight(const at::Tensor& qweight, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                             int64_t bits, int64_t group, at::ScalarType dtype) {
  const Packed p = tokenmill_quant::packed_operands(qweight, scale, min, bits, group);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to fp32 or bf16");
  at::Tensor out = at::empty({p.n_out, p.k_dim}, qweight.options().dtype(dtype));
  if (p.panels && dtype == at::kFloat) {
    dequantize_panels_into(p, out.data_ptr<float>());
  } else if (p.panels) {
    dequantize_panels_into(p, reinterpret_cast<bf16_t*>(out.data_ptr()));
  } else if (dtype == at::kFloat) {
    dequantize_into(p, 0, p.n_out, out.data_ptr<float>());
  } else {
    dequantize_into(p, 0, p.n_out, reinterpret_cast<bf16_t*>(out.data_ptr()));
  }
  return out;
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& min, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, int64_t stream_max_rows, int64_t activation_passes) {
  TORCH_CHECK(activation_passes == 1 || activation_passes == 2, "activation_passes must be 1 or 2, got ",
              activation_passes);
  Packed p = tokenmill_quant::packed_operands(qweight, scale, min, bits, group);
  p.activation_passes = activation_passes;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k_dim, "x must be [M, ", p.k_dim, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x fp32 or bf16");
  const int64_t m_rows = x.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == p.n_out, "bias must have ", p.n_out, " values");
  if (!p.panels && m_rows > stream_max_rows) {
    at::Tensor out = dequantized_product(p, x);
    if (has_bias) out.add_(*bias);
    return out;
  }
  if (p.panels) {
    TORCH_CHECK(!tokenmill_quant::int8_dot_isa().empty(),
                "the panels layout needs AVX2 (with FMA and F16C) or AVX512-VNNI; this build has neither");
    const at::Tensor rows = x.contiguous(), bias_f = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const float* b = has_bias ? bias_f.data_ptr<float>() : nullptr;
    at::Tensor out = at::empty({m_rows, p.n_out}, x.options());
    if (x.scalar_type() == at::kFloat) {
      tokenmill_quant::int8_dot_product(p, rows.data_ptr<float>(), m_rows, b, out.data_ptr<float>());
    } else {
      tokenmill_quant::int8_dot_product(p, reinterpret_cast<const bf16_t*>(rows.data_ptr()), m_rows, b,
                                        reinterpret_cast<bf16_t*>(out.data_ptr()));
    }
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m_rows, p.n_out}, xf.options());
  fp32_product(p, xf.data_ptr<float>(), m_rows, out.data_ptr<float>());
  if (has_bias) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? min, int bits, int group, Tensor? bias, "
        "int stream_max_rows, int activation_passes=2) -> Tensor");
  m.def("dequantize_weight(Tensor qweight, Tensor scale, Tensor? min, int bits, int group, ScalarType dtype) -> Tensor");
  m.impl("quantized_linear", c10::DispatchKey::CPU, &quantized_linear);
  m.impl("dequantize_weight", c10::DispatchKey::CPU, &dequantize_weight);
  m.def("int8_dot_isa() -> str", &tokenmill_quant::int8_dot_isa);
  m.def("int8_dot_tiles() -> bool", &tokenmill_quant::int8_dot_tiles);
}
