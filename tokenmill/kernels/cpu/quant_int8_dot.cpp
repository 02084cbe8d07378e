// Products with a panels-layout quantized weight whose activations are quantized to int8 first
// (quant_packed.h's int8_dot_product). Each row of x is cut into blocks (a weight group, or 128
// values of a per-channel int8 row), each block gets one fp32 scale s = absmax / 127 and two int8
// passes: hi = round(x / s) and lo = round((x - hi s) / (s / 254)), the residual in 254ths of a step
// (|lo| <= 127), so x is represented to s / 508 (about 15 bits of the block's range, finer than
// bf16's 8). The weight is read a panel of 16 rows at a time, one quad of K (4 values) per 16-lane
// vector, so one vpdpbusd multiplies the panel's quad (unsigned bytes) by a row's 4 activation bytes
// broadcast (signed), summing into the panel's 16 int32 outputs: no horizontal sums; each quad
// runs against both passes. An int4 byte is its value 0..15 as is; an int8 weight v is fed as the
// unsigned byte v + 128 and 128 x the block's sum of activation bytes is taken off again, in int32.
// Once per block the two sums are joined exactly in int32 (254 hi + lo), converted and scaled by
// s / 254 (an int4 group's min multiplies the block's dequantized activation sum). The integer sums
// are exact, so the result is the fp32 product of the dequantized activations with the dequantized
// weight up to summation order.
//   Work split: x is taken kChunkRows rows at a time (its int8 bytes stay in cache); for each chunk
//   threads take pairs of panels (32 output columns), running the chunk's rows 4 at a time (the
//   tile: 4 x 2 x 2 int32 and 4 x 2 fp32 accumulators in registers) against the pair's packed
//   bytes, read from memory once per chunk and from cache for the further row tiles.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define TOKENMILL_INT8_DOT 1
#include <immintrin.h>
#endif

#include "quant_packed.h"
#include "simd.h"

namespace tokenmill_quant {

int64_t activation_block(int64_t group, int64_t k_dim) {
  if (group <= 128) return group;
  for (int64_t block : {128, 64, 32}) {
    if (k_dim % block == 0) return block;
  }
  return k_dim;
}

#if defined(TOKENMILL_INT8_DOT)

namespace {

constexpr int kTileRows = 4;  // rows of x per tile
constexpr int kTilePanels = 2;  // panels per tile (and per work item)
constexpr int64_t kChunkRows = 192;  // rows of x per pass over the weight

constexpr float kResidualSteps = 254.f;  // lo's unit: a 254th of hi's step

// x quantized per block: hi and lo int8 [M, K]; per block its scale, the sums of hi's and lo's
// bytes, and the dequantized block's sum.
struct QuantizedRows {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale, x_sum;
  std::vector<int32_t> hi_sum, lo_sum;
  int64_t block, blocks_per_row;
};

template <typename In>
QuantizedRows quantize_rows(const In* x, int64_t m_rows, int64_t k_dim, int64_t block) {
  QuantizedRows a;
  a.block = block;
  a.blocks_per_row = k_dim / block;
  a.hi.resize(m_rows * k_dim);
  a.lo.resize(m_rows * k_dim);
  a.scale.resize(m_rows * a.blocks_per_row);
  a.x_sum.resize(a.scale.size());
  a.hi_sum.resize(a.scale.size());
  a.lo_sum.resize(a.scale.size());
  at::parallel_for(0, m_rows * a.blocks_per_row, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const In* xb = x + b * block;  // rows are contiguous: block b of the whole [M, K]
      __m512 absmax = _mm512_setzero_ps();
      for (int64_t k = 0; k < block; k += 16) absmax = _mm512_max_ps(absmax, _mm512_abs_ps(tokenmill_simd::load16(xb + k)));
      const float scale = _mm512_reduce_max_ps(absmax) / 127.f;
      const float step = scale == 0.f ? 1.f : scale;
      const __m512 divisor = _mm512_set1_ps(step), lo_divisor = _mm512_set1_ps(step / kResidualSteps);
      __m512i hi_total = _mm512_setzero_si512(), lo_total = _mm512_setzero_si512();
      for (int64_t k = 0; k < block; k += 16) {
        // IEEE division and the default rounding (to nearest, ties to even), as torch.round(x / scale);
        // the residual x - hi s exactly (one rounding, fma)
        const __m512 xv = tokenmill_simd::load16(xb + k);
        const __m512 hi_f = _mm512_roundscale_ps(_mm512_div_ps(xv, divisor), _MM_FROUND_TO_NEAREST_INT);
        const __m512 residual = _mm512_fnmadd_ps(hi_f, divisor, xv);
        const __m512i hi = _mm512_cvtps_epi32(hi_f);
        const __m512i lo = _mm512_cvtps_epi32(_mm512_div_ps(residual, lo_divisor));
        hi_total = _mm512_add_epi32(hi_total, hi);
        lo_total = _mm512_add_epi32(lo_total, lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.hi.data() + b * block + k), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.lo.data() + b * block + k), _mm512_cvtepi32_epi8(lo));
      }
      a.scale[b] = scale;
      a.hi_sum[b] = _mm512_reduce_add_epi32(hi_total);
      a.lo_sum[b] = _mm512_reduce_add_epi32(lo_total);
      a.x_sum[b] = scale * static_cast<float>(a.hi_sum[b]) + scale / kResidualSteps * static_cast<float>(a.lo_sum[b]);
    }
  });
  return a;
}

// Panel `panel`'s quad t as 64 unsigned bytes, lane r holding row r's 4 values (int4: 0..15; int8: v + 128).
__attribute__((always_inline)) inline __m512i panel_quad(const Packed& p, int64_t panel, int64_t t) {
  const uint8_t* q = quad_bytes(p, panel, t);
  if (p.bits == 8) return _mm512_xor_si512(_mm512_loadu_si512(q), _mm512_set1_epi8(-128));
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), nibble = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// y[m0 + m, 16 panel0 ...) (+ bias, if not null) for kRows rows of x and kPanels panels.
template <int kRows, int kPanels, typename Out>
void panel_tile(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m0, int64_t panel0, Out* y) {
  __m512 acc[kRows][kPanels];
  for (int m = 0; m < kRows; ++m) {
    for (int j = 0; j < kPanels; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  const int64_t quads_per_row = p.k_dim / 4, quads_per_block = a.block / 4, blocks_per_group = p.group / a.block;
  const int32_t* hi_quads = reinterpret_cast<const int32_t*>(a.hi.data());  // a row's 4 bytes of one quad
  const int32_t* lo_quads = reinterpret_cast<const int32_t*>(a.lo.data());
  for (int64_t b = 0; b < a.blocks_per_row; ++b) {
    __m512i hi_dots[kRows][kPanels], lo_dots[kRows][kPanels];
    for (int m = 0; m < kRows; ++m) {
      for (int j = 0; j < kPanels; ++j) hi_dots[m][j] = lo_dots[m][j] = _mm512_setzero_si512();
    }
    for (int64_t t = b * quads_per_block; t < (b + 1) * quads_per_block; ++t) {
      __m512i w[kPanels];
      for (int j = 0; j < kPanels; ++j) w[j] = panel_quad(p, panel0 + j, t);
#pragma GCC unroll 4
      for (int m = 0; m < kRows; ++m) {
        const __m512i hi = _mm512_set1_epi32(hi_quads[(m0 + m) * quads_per_row + t]);
        const __m512i lo = _mm512_set1_epi32(lo_quads[(m0 + m) * quads_per_row + t]);
        for (int j = 0; j < kPanels; ++j) {
          hi_dots[m][j] = _mm512_dpbusd_epi32(hi_dots[m][j], w[j], hi);
          lo_dots[m][j] = _mm512_dpbusd_epi32(lo_dots[m][j], w[j], lo);
        }
      }
    }
    const int64_t g = p.groups_per_row == 1 ? 0 : b / blocks_per_group;
    __m512 w_scale[kPanels], w_min[kPanels];
    for (int j = 0; j < kPanels; ++j) {
      const int64_t at = ((panel0 + j) * p.groups_per_row + g) * kPanel;
      w_scale[j] = _mm512_loadu_ps(p.scale + at);
      if (p.min != nullptr) w_min[j] = _mm512_loadu_ps(p.min + at);
    }
    const __m512i residual_steps = _mm512_set1_epi32(static_cast<int32_t>(kResidualSteps));
#pragma GCC unroll 4
    for (int m = 0; m < kRows; ++m) {
      const int64_t ab = (m0 + m) * a.blocks_per_row + b;
      const __m512 x_scale = _mm512_set1_ps(a.scale[ab] / kResidualSteps);
      for (int j = 0; j < kPanels; ++j) {
        const __m512 scale = _mm512_mul_ps(w_scale[j], x_scale);
        __m512i hi = hi_dots[m][j], lo = lo_dots[m][j];
        if (p.min == nullptr) {  // int8: the bytes were v + 128
          hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(128 * a.hi_sum[ab]));
          lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(128 * a.lo_sum[ab]));
        }
        const __m512i joined = _mm512_add_epi32(_mm512_mullo_epi32(hi, residual_steps), lo);  // exact: < 2^30
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), scale, acc[m][j]);
        if (p.min != nullptr) acc[m][j] = _mm512_fmadd_ps(w_min[j], _mm512_set1_ps(a.x_sum[ab]), acc[m][j]);
      }
    }
  }
  for (int j = 0; j < kPanels; ++j) {
    const int64_t n0 = (panel0 + j) * kPanel;
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < kRows; ++m) tokenmill_simd::store16(y + (m0 + m) * p.n_out + n0, _mm512_add_ps(acc[m][j], b));
  }
}

// Rows [m_begin, m_end) of x against kPanels panels from panel0, kTileRows rows at a time.
template <int kPanels, typename Out>
void panel_rows(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m_begin, int64_t m_end,
                int64_t panel0, Out* y) {
  int64_t m0 = m_begin;
  for (; m0 + kTileRows <= m_end; m0 += kTileRows) panel_tile<kTileRows, kPanels>(p, a, bias, m0, panel0, y);
  switch (m_end - m0) {
    case 3: panel_tile<3, kPanels>(p, a, bias, m0, panel0, y); break;
    case 2: panel_tile<2, kPanels>(p, a, bias, m0, panel0, y); break;
    case 1: panel_tile<1, kPanels>(p, a, bias, m0, panel0, y); break;
    default: break;
  }
}

template <typename T>
void product(const Packed& p, const T* x, int64_t m_rows, const float* bias, T* y) {
  const QuantizedRows a = quantize_rows(x, m_rows, p.k_dim, activation_block(p.group, p.k_dim));
  const int64_t n_panels = p.n_out / kPanel;
  for (int64_t m_begin = 0; m_begin < m_rows; m_begin += kChunkRows) {
    const int64_t m_end = std::min(m_rows, m_begin + kChunkRows);
    at::parallel_for(0, (n_panels + kTilePanels - 1) / kTilePanels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t panel0 = item * kTilePanels;
        if (panel0 + kTilePanels <= n_panels) {
          panel_rows<kTilePanels>(p, a, bias, m_begin, m_end, panel0, y);
        } else {
          panel_rows<1>(p, a, bias, m_begin, m_end, panel0, y);
        }
      }
    });
  }
}

}  // namespace

bool int8_dot_available() { return true; }

void int8_dot_product(const Packed& p, const float* x, int64_t m_rows, const float* bias, float* y) {
  product(p, x, m_rows, bias, y);
}

void int8_dot_product(const Packed& p, const tokenmill_simd::bf16_t* x, int64_t m_rows, const float* bias,
                      tokenmill_simd::bf16_t* y) {
  product(p, x, m_rows, bias, y);
}

#else

bool int8_dot_available() { return false; }

void int8_dot_product(const Packed&, const float*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "int8 dot products need AVX512-VNNI (with AVX512-VL/BW)");
}

void int8_dot_product(const Packed&, const tokenmill_simd::bf16_t*, int64_t, const float*, tokenmill_simd::bf16_t*) {
  TORCH_CHECK(false, "int8 dot products need AVX512-VNNI (with AVX512-VL/BW)");
}

#endif

}  // namespace tokenmill_quant
