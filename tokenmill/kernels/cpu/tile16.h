// The fp32 register tile shared by panel_linear.cpp (x rows against a packed weight panel) and, with
// AVX2 alone, prefill_attention.cpp (query rows against a transposed block of 16 keys): kRows rows of
// x against a [depth, 16] panel, two 256-bit accumulators a row, one broadcast and two FMAs per row
// and k, the sums taken in k order.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace tokenmill_tile {

constexpr int64_t kWidth = 16;  // panel columns: one tile row's outputs

// out[i * ld_out + j] (+)= sum_k x[i * ld_x + k] * panel[k * 16 + j] for i < kRows, j < n_valid.
template <int kRows>
inline void tile16(const float* x, int64_t ld_x, const float* panel, int64_t depth, float* out, int64_t ld_out,
                   bool accumulate, int64_t n_valid) {
  __m256 acc[kRows][2];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kWidth), b1 = _mm256_loadu_ps(panel + k * kWidth + 8);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ld_x + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  alignas(32) float row[kWidth];
#pragma GCC unroll 8  // every acc index must be constant, or the accumulators live in memory
  for (int i = 0; i < kRows; ++i) {
    float* o = out + i * ld_out;
    if (n_valid == kWidth) {
      if (accumulate) {
        acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_loadu_ps(o));
        acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_loadu_ps(o + 8));
      }
      _mm256_storeu_ps(o, acc[i][0]);
      _mm256_storeu_ps(o + 8, acc[i][1]);
    } else {
      _mm256_store_ps(row, acc[i][0]);
      _mm256_store_ps(row + 8, acc[i][1]);
      for (int64_t j = 0; j < n_valid; ++j) o[j] = accumulate ? o[j] + row[j] : row[j];
    }
  }
}

}  // namespace tokenmill_tile

#endif
