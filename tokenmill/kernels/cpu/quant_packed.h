// A quantized weight as the CPU kernels read it (kernels/quant_format.py's layouts), a scale (and
// int4 min) per group of `group` values along K (a multiple of 32 that divides K; int8 in the panels
// layout may also have groups of kPanelInt8Group), fp32 (the panels layout: fp32 or fp16):
//   rows layout, qweight 2-D: int8 [N, K] (w = q * scale) or uint8 [N, K / 2] (int4: w = q * scale
//     + min, q in 0..15; the 16 bytes of each run of 32 values along K hold value j in byte j's low
//     nibble and value 16 + j in its high one); scale/min [N, K / group].
//   panels layout, qweight 3-D [N / 16, K / 4, 64 | 32]: each panel of 16 weight rows, per quad of
//     4 values along K, as the 64 bytes of one 16-lane int32 vector (lane r: row r's 4 values;
//     int8: the signed values; int4: 32 bytes a quad, quads in pairs: the 64 bytes of quads 2 j and
//     2 j + 1 hold quad 2 j's values in their low nibbles and quad 2 j + 1's in their high ones, byte
//     b lane b / 4's value b % 4 in both); scale/min [N / 16, K / group, 16] (a panel's scales group
//     after group).
// Shared by quant_linear.cpp (fp32 products on the rows layout, dequantization, the op) and the
// panels layout's products with activations quantized to one or two int8 passes: quant_int8_dot.cpp
// (AVX512-VNNI, and AMX-INT8 tiles) or, where the CPU has AVX2 but not AVX512-VNNI,
// quant_int16_dot.cpp (the passes joined into one int16); the build compiles in at most one of them.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define TOKENMILL_INT8_DOT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_INT8_DOT_AVX2 1
#endif

namespace tokenmill_quant {

constexpr int64_t kRun = 32;  // values per packed run (and the smallest group)
constexpr int64_t kBlock = 4;  // weight rows per work item of the rows layout
constexpr int64_t kPanel = 16;  // weight rows per panel
constexpr int64_t kPanelInt8Group = 16;  // the group below kRun an int8 panels-layout weight may have
constexpr float kResidualSteps = 254.f;  // the activations' second int8 pass: in 254ths of the first's step

struct Packed {
  const void* q;
  const float* scale;  // fp32 scales, or nullptr where scale_fp16 holds them
  const float* min;  // fp32 mins; nullptr for int8 or where min_fp16 holds them
  const at::Half* scale_fp16;  // fp16 scales (panels layout only), or nullptr
  const at::Half* min_fp16;  // fp16 mins (int4 with fp16 scales), or nullptr
  bool has_min;  // int4: a min per group (in min or min_fp16)
  int64_t bits, group, n_out, k_dim;
  int64_t groups_per_row;  // k_dim / group
  int64_t group_shift;  // log2(group) when group is a power of two; else -1 (then group == k_dim)
  bool panels;
  int64_t activation_passes = 2;  // panels layout: int8 passes of x per product (int8_dot_product), 1 or 2
};

// The operands checked (layout, shapes, dtypes, contiguity, group) and gathered; raises on any mismatch.
Packed packed_operands(const at::Tensor& qweight, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                       int64_t bits, int64_t group);

// Rows layout: the bytes of weight row n from value k on (k a multiple of 32).
inline const uint8_t* row_bytes(const Packed& p, int64_t n, int64_t k) {
  return static_cast<const uint8_t*>(p.q) + (p.bits == 8 ? n * p.k_dim + k : n * (p.k_dim >> 1) + (k >> 1));
}

// Panels layout: the bytes of panel `panel`'s quad of values [4 t, 4 t + 4): int8, its 64 bytes;
// int4, t even: the 64 bytes of quads t (low nibbles) and t + 1 (high nibbles).
inline const uint8_t* quad_bytes(const Packed& p, int64_t panel, int64_t t) {
  const int64_t quad = p.bits == 8 ? 64 : 32;
  return static_cast<const uint8_t*>(p.q) + (panel * (p.k_dim / 4) + t) * quad;
}

// Panels layout: scale (or min, if `mins`) number `at` of [N / 16, K / group, 16] in fp32, whichever
// width the weight keeps.
inline float panel_scale(const Packed& p, int64_t at, bool mins = false) {
  if (mins) return p.min_fp16 != nullptr ? static_cast<float>(p.min_fp16[at]) : p.min[at];
  return p.scale_fp16 != nullptr ? static_cast<float>(p.scale_fp16[at]) : p.scale[at];
}

// The sum of an activation block's dequantized values from its passes' sums (hi_sum s + lo_sum s /
// 254; lo_sum 0 with one pass), computed one way wherever it is (an explicit fma: the compiler would
// contract the plain expression differently in different builds).
inline float dequantized_block_sum(float scale, int32_t hi_sum, int32_t lo_sum) {
  return std::fma(scale, static_cast<float>(hi_sum), scale / kResidualSteps * static_cast<float>(lo_sum));
}

// Panels layout: fetches the scales (and int4 mins) of `panels` panels from panel0 (past the last
// panel: harmless, a prefetch does not fault).
inline void prefetch_scales(const Packed& p, int64_t panel0, int64_t panels) {
  const int64_t at = panel0 * p.groups_per_row * kPanel, values = panels * p.groups_per_row * kPanel;
  const bool half = p.scale_fp16 != nullptr;
  const int64_t bytes = values * (half ? 2 : 4);
  tokenmill_simd::prefetch_range(half ? static_cast<const void*>(p.scale_fp16 + at) : p.scale + at, bytes);
  if (p.has_min) tokenmill_simd::prefetch_range(half ? static_cast<const void*>(p.min_fp16 + at) : p.min + at, bytes);
}

// Which int8_dot_product this build has: "avx512-vnni" (quant_int8_dot.cpp), "avx2"
// (quant_int16_dot.cpp), or "" (none: the panels layout cannot run).
std::string int8_dot_isa();

// True where int8_dot_product multiplies with AMX-INT8 tiles from a few rows on (the CPU has them
// and the kernel lets this process use them).
bool int8_dot_tiles();

// The activation block of int8_dot_product for a weight of K values in groups of `group`: the
// group when it is at most 128 (16 included), else the largest of 128, 64, 32 dividing K.
int64_t activation_block(int64_t group, int64_t k_dim);

// y [M, N] = x [M, K] @ w^T (+ bias [N], if not null) for a panels-layout weight, x and y fp32 or
// both bf16, with x first quantized per block of activation_block values of a row to
// p.activation_passes int8 passes (step s = absmax / 127, hi = round-half-even(x / s), and with two
// passes lo = round-half-even((x - hi s) / (s / 254)); an all-zero block has s = 0), then integer
// dot products per block scaled in fp32: the fp32 product of the dequantized x (hi s + lo s / 254,
// or hi s) with the dequantized weight, up to summation order, plus the bias, rounded once to y's
// dtype (bf16: to nearest even). Both builds' integer sums are exact and their fp32 epilogue the
// same, so a result has the same bits on either.
// Only where int8_dot_isa() is not empty.
void int8_dot_product(const Packed& p, const float* x, int64_t m_rows, const float* bias, float* y);
void int8_dot_product(const Packed& p, const tokenmill_simd::bf16_t* x, int64_t m_rows, const float* bias,
                      tokenmill_simd::bf16_t* y);

}  // namespace tokenmill_quant
