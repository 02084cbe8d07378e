// Products with a panels-layout quantized weight on CPUs with AVX2 (and FMA, F16C) but without
// AVX512-VNNI: quant_packed.h's int8_dot_product, with the same activations and the same results as
// quant_int8_dot.cpp's. Each block of a row of x gets the step s = absmax / 127 and the two int8
// passes hi = round(x / s) and lo = round((x - hi s) / (s / 254)), as there (or hi alone, with one
// pass: below, read "254 hi + lo" as hi). The weight is read a panel of 16 rows at a time, a quad of
// K (4 values) per row:
// - int4: a quad's bytes (0..15) as they unpack, 8 rows to a vector, against each pass's 4 bytes
//   (broadcast) by vpmaddubsw, whose int16 pair sums (at most 2 x 15 x 127) are added for up to 8
//   quads (at most 30480, no saturation) before vpmaddwd joins them into int32 as 254 hi + lo;
// - int8: the passes are kept joined, 254 hi + lo, one int16 per value (|.| <= 32385), and a quad
//   of weights widened to int16, 4 rows to a vector, is multiplied by a row's 4 joined values
//   (broadcast) by vpmaddwd, which adds pairs into int32 (vpmaddubsw would saturate on int8 weights).
// Either way a block's int32 sums are exactly the sums of weight times (254 hi + lo), which the
// VNNI path forms from its two passes' sums, and the fp32 epilogue is that path's, lane for lane
// (s / 254 x the weight's scale, then for int4 its min x the block's dequantized x sum; then the
// bias, rounded once to y's dtype), so each result has its bits.
//   Work split: x is taken kChunkRows rows at a time; for each chunk threads take panels, running
//   the chunk's rows kTileRows at a time against the panel's packed bytes (read from memory by the
//   first row tile, which also fetches the next panel's bytes and scales, from cache by the others).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_packed.h"
#include "simd.h"

#if defined(TOKENMILL_INT8_DOT_AVX2)
#include <immintrin.h>

namespace tokenmill_quant {

namespace {

constexpr int kTileRows = 2;  // rows of x per tile (AVX2 has 16 vector registers)
constexpr int64_t kChunkRows = 192;  // rows of x per pass over the weight

constexpr int64_t kInt16Quads = 8;  // int4: quads whose int16 pair sums are added before joining

// x quantized per block: int4 weights, the int8 passes [M, n_passes, K] (row m's hi, then its lo if
// two); int8 weights, the joined values 254 hi + lo (one pass: hi) [M, K]; per block its scale and
// the dequantized block's sum.
struct QuantizedRows {
  std::vector<int8_t> passes;
  std::vector<int16_t> joined;
  std::vector<float> scale, x_sum;
  int64_t block, blocks_per_row, k_dim, n_passes;
  const int8_t* hi(int64_t row) const { return passes.data() + n_passes * row * k_dim; }
  const int8_t* lo(int64_t row) const { return hi(row) + k_dim; }
};

inline __m256 load8_ps(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8_ps(const tokenmill_simd::bf16_t* p) {
  const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}

inline int32_t lane_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

inline float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Stores 8 int32 values (each within int8, or int16 when T is) as T.
inline void store8(int8_t* out, __m256i v) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
}

inline void store8(int16_t* out, __m256i v) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), words);
}

// x quantized to `n_passes` passes for a weight of `bits`: the passes apart (4) or joined (8).
template <typename In>
QuantizedRows quantize_rows(const In* x, int64_t m_rows, int64_t k_dim, int64_t block, int64_t bits,
                            int64_t n_passes) {
  QuantizedRows a;
  a.block = block;
  a.blocks_per_row = k_dim / block;
  a.k_dim = k_dim;
  a.n_passes = n_passes;
  if (bits == 8) {
    a.joined.resize(m_rows * k_dim);
  } else {
    a.passes.resize(n_passes * m_rows * k_dim);
  }
  a.scale.resize(m_rows * a.blocks_per_row);
  a.x_sum.resize(a.scale.size());
  at::parallel_for(0, m_rows * a.blocks_per_row, 256, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i residual_steps = _mm256_set1_epi32(static_cast<int32_t>(kResidualSteps));
    for (int64_t b = begin; b < end; ++b) {
      const In* xb = x + b * block;  // rows are contiguous: block b of the whole [M, K]
      const int64_t row = b / a.blocks_per_row, at = (b % a.blocks_per_row) * block;
      __m256 absmax = _mm256_setzero_ps();
      for (int64_t k = 0; k < block; k += 8) absmax = _mm256_max_ps(absmax, _mm256_andnot_ps(sign, load8_ps(xb + k)));
      const float scale = lane_max(absmax) / 127.f;
      const float step = scale == 0.f ? 1.f : scale;
      const __m256 divisor = _mm256_set1_ps(step), lo_divisor = _mm256_set1_ps(step / kResidualSteps);
      __m256i hi_total = _mm256_setzero_si256(), lo_total = _mm256_setzero_si256();
      for (int64_t k = 0; k < block; k += 8) {
        // as quant_int8_dot.cpp: IEEE division, rounding to nearest even, the residual by one fma
        const __m256 xv = load8_ps(xb + k);
        const __m256 hi_f = _mm256_round_ps(_mm256_div_ps(xv, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 residual = _mm256_fnmadd_ps(hi_f, divisor, xv);
        const __m256i hi = _mm256_cvtps_epi32(hi_f);
        const __m256i lo =
            n_passes == 2 ? _mm256_cvtps_epi32(_mm256_div_ps(residual, lo_divisor)) : _mm256_setzero_si256();
        hi_total = _mm256_add_epi32(hi_total, hi);
        lo_total = _mm256_add_epi32(lo_total, lo);
        if (bits == 8) {
          const __m256i joined = n_passes == 2 ? _mm256_add_epi32(_mm256_mullo_epi32(hi, residual_steps), lo) : hi;
          store8(a.joined.data() + b * block + k, joined);
        } else {
          store8(a.passes.data() + n_passes * row * k_dim + at + k, hi);
          if (n_passes == 2) store8(a.passes.data() + (2 * row + 1) * k_dim + at + k, lo);
        }
      }
      a.scale[b] = scale;
      a.x_sum[b] = dequantized_block_sum(scale, lane_sum(hi_total), lane_sum(lo_total));
    }
  });
  return a;
}

// An int8 weight's panel: quad t + s (s 0 or 1, t even; `q` = quad_bytes(p, panel, t)), rows 4 g ...
// 4 g + 3 widened to 16 int16: row r's 4 values at 4 (r - 4 g).
__attribute__((always_inline)) inline __m256i widened_quad(const uint8_t* q, int s, int g) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 64 * s + 16 * g)));
}

// The block's int32 sums of one row against an int8 weight's panel, 16 rows' as two vectors of 8
// (rows 0-7, 8-15), from the four vpmaddwd accumulators (rows 4 g ... 4 g + 3, each row's two pair
// sums side by side).
__attribute__((always_inline)) inline void panel_sums(const __m256i* dots, __m256i* halves) {
  // hadd gives rows (0 1 4 5 | 2 3 6 7) per 128-bit half; the permute puts them in order
  halves[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(dots[0], dots[1]), 0xd8);
  halves[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(dots[2], dots[3]), 0xd8);
}

// The scales (and int4 mins; else zeros) of group g of panel `panel`, rows 0-7 and 8-15.
__attribute__((always_inline)) inline void load_group(const Packed& p, int64_t panel, int64_t g, __m256* w_scale,
                                                      __m256* w_min) {
  if (p.groups_per_row == 1) g = 0;
  const int64_t at = (panel * p.groups_per_row + g) * kPanel;
  for (int h = 0; h < 2; ++h) {
    if (p.scale_fp16 != nullptr) {
      w_scale[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scale_fp16 + at + 8 * h)));
      w_min[h] = p.has_min ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.min_fp16 + at + 8 * h)))
                           : _mm256_setzero_ps();
    } else {
      w_scale[h] = _mm256_loadu_ps(p.scale + at + 8 * h);
      w_min[h] = p.has_min ? _mm256_loadu_ps(p.min + at + 8 * h) : _mm256_setzero_ps();
    }
  }
}

// Fetches the bytes of panel `panel`'s quads t and t + 1 (past the weight's end: harmless).
inline void prefetch_quads(const Packed& p, int64_t panel, int64_t t) {
  const char* bytes = reinterpret_cast<const char*>(quad_bytes(p, panel, t));
  _mm_prefetch(bytes, _MM_HINT_T0);
  if (p.bits == 8) _mm_prefetch(bytes + 64, _MM_HINT_T0);
}

// acc[m] (rows 0-7 and 8-15 of the panel) plus block b's product for kRows rows from m0, from the
// block's exact int32 sums `joined` [m][half]: (254 hi + lo) (x scale / 254) (weight scale), or hi
// (x scale) (weight scale) with one pass, then, for int4, the weight's min times the block's
// dequantized x sum.
template <int kRows>
__attribute__((always_inline)) inline void add_block(const Packed& p, const QuantizedRows& a, int64_t m0, int64_t panel,
                                                     int64_t b, const __m256i (*joined)[2], __m256 (*acc)[2]) {
  __m256 w_scale[2], w_min[2];
  load_group(p, panel, b / (p.group / a.block), w_scale, w_min);
  for (int m = 0; m < kRows; ++m) {
    const int64_t ab = (m0 + m) * a.blocks_per_row + b;
    const __m256 x_scale = _mm256_set1_ps(a.n_passes == 2 ? a.scale[ab] / kResidualSteps : a.scale[ab]);
    const __m256 x_sum = _mm256_set1_ps(a.x_sum[ab]);
    for (int h = 0; h < 2; ++h) {
      acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined[m][h]), _mm256_mul_ps(w_scale[h], x_scale), acc[m][h]);
      if (p.has_min) acc[m][h] = _mm256_fmadd_ps(w_min[h], x_sum, acc[m][h]);
    }
  }
}

// Block b's int32 sums for kRows rows from m0 against an int8 weight's panel (joined activations).
template <int kRows>
__attribute__((always_inline)) inline void int8_block_sums(const Packed& p, const QuantizedRows& a, int64_t m0,
                                                           int64_t panel, int64_t b, bool prefetch_next,
                                                           __m256i (*joined)[2]) {
  __m256i dots[kRows][4];
  for (int m = 0; m < kRows; ++m) {
    for (int g = 0; g < 4; ++g) dots[m][g] = _mm256_setzero_si256();
  }
  const int64_t quads_per_block = a.block / 4;
  for (int64_t t = b * quads_per_block; t < (b + 1) * quads_per_block; t += 2) {  // a block's quads: even
    const uint8_t* q = quad_bytes(p, panel, t);
    if (prefetch_next) prefetch_quads(p, panel + 1, t);
    for (int s = 0; s < 2; ++s) {
      __m256i x_quad[kRows];  // each row's 4 joined values of quad t + s, in every 64-bit lane
      for (int m = 0; m < kRows; ++m) {
        int64_t values;
        std::memcpy(&values, a.joined.data() + (m0 + m) * a.k_dim + 4 * (t + s), sizeof(values));
        x_quad[m] = _mm256_set1_epi64x(values);
      }
      for (int g = 0; g < 4; ++g) {
        const __m256i w = widened_quad(q, s, g);
        for (int m = 0; m < kRows; ++m) dots[m][g] = _mm256_add_epi32(dots[m][g], _mm256_madd_epi16(w, x_quad[m]));
      }
    }
  }
  for (int m = 0; m < kRows; ++m) panel_sums(dots[m], joined[m]);
}

// Block b's int32 sums for kRows rows from m0 in kPasses passes against an int4 weight's panel (the
// passes apart).
template <int kRows, int kPasses>
__attribute__((always_inline)) inline void int4_block_sums(const Packed& p, const QuantizedRows& a, int64_t m0,
                                                           int64_t panel, int64_t b, bool prefetch_next,
                                                           __m256i (*joined)[2]) {
  const __m256i nibble = _mm256_set1_epi8(15), residual_steps = _mm256_set1_epi16(static_cast<int16_t>(kResidualSteps));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < kRows; ++m) joined[m][0] = joined[m][1] = _mm256_setzero_si256();
  const int64_t quads_per_block = a.block / 4, end = (b + 1) * quads_per_block;
  for (int64_t t0 = b * quads_per_block; t0 < end; t0 += kInt16Quads) {
    __m256i sums[kRows][kPasses][2];  // [row][pass][half]: int16 pair sums
    for (int m = 0; m < kRows; ++m) {
      for (int pass = 0; pass < kPasses; ++pass) sums[m][pass][0] = sums[m][pass][1] = _mm256_setzero_si256();
    }
    for (int64_t t = t0; t < std::min(end, t0 + kInt16Quads); t += 2) {  // quads in pairs: t even
      const uint8_t* q = quad_bytes(p, panel, t);
      if (prefetch_next) prefetch_quads(p, panel + 1, t);
      const __m256i bytes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))};
      for (int s = 0; s < 2; ++s) {
        __m256i w[2];  // quad t + s, rows 0-7 and 8-15: 4 bytes a row
        for (int h = 0; h < 2; ++h) w[h] = _mm256_and_si256(s == 0 ? bytes[h] : _mm256_srli_epi16(bytes[h], 4), nibble);
        for (int m = 0; m < kRows; ++m) {
          for (int pass = 0; pass < kPasses; ++pass) {
            int32_t bytes4;
            std::memcpy(&bytes4, (pass == 0 ? a.hi(m0 + m) : a.lo(m0 + m)) + 4 * (t + s), sizeof(bytes4));
            const __m256i x_pass = _mm256_set1_epi32(bytes4);
            for (int h = 0; h < 2; ++h) {
              sums[m][pass][h] = _mm256_add_epi16(sums[m][pass][h], _mm256_maddubs_epi16(w[h], x_pass));
            }
          }
        }
      }
    }
    for (int m = 0; m < kRows; ++m) {  // a row's int16 pair sums in order, so vpmaddwd gives rows 0-7 (8-15)
      for (int h = 0; h < 2; ++h) {
        if (kPasses == 2) {
          const __m256i hi = _mm256_madd_epi16(sums[m][0][h], residual_steps);
          const __m256i lo = _mm256_madd_epi16(sums[m][1][h], ones);
          joined[m][h] = _mm256_add_epi32(joined[m][h], _mm256_add_epi32(hi, lo));
        } else {
          joined[m][h] = _mm256_add_epi32(joined[m][h], _mm256_madd_epi16(sums[m][0][h], ones));
        }
      }
    }
  }
}

// y[m0 + m, 16 panel ...) (+ bias, if not null) for kRows rows of x. With `prefetch_next`, the next
// panel's scales are fetched first and its bytes as these are read, at the same offsets.
template <int kRows, typename Out>
void panel_tile(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m0, int64_t panel,
                bool prefetch_next, Out* y) {
  __m256 acc[kRows][2];
  for (int m = 0; m < kRows; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  if (prefetch_next) prefetch_scales(p, panel + 1, 1);
  for (int64_t b = 0; b < a.blocks_per_row; ++b) {
    __m256i joined[kRows][2];
    if (p.bits == 8) {
      int8_block_sums<kRows>(p, a, m0, panel, b, prefetch_next, joined);
    } else if (a.n_passes == 2) {
      int4_block_sums<kRows, 2>(p, a, m0, panel, b, prefetch_next, joined);
    } else {
      int4_block_sums<kRows, 1>(p, a, m0, panel, b, prefetch_next, joined);
    }
    add_block<kRows>(p, a, m0, panel, b, joined, acc);
  }
  for (int m = 0; m < kRows; ++m) {
    const int64_t n0 = panel * kPanel;
    __m256 sum[2];
    for (int h = 0; h < 2; ++h) {
      sum[h] = bias != nullptr ? _mm256_add_ps(acc[m][h], _mm256_loadu_ps(bias + n0 + 8 * h)) : acc[m][h];
    }
    tokenmill_simd::store16(y + (m0 + m) * p.n_out + n0, tokenmill_simd::join16(sum[0], sum[1]));
  }
}

// Rows [m_begin, m_end) of x against panel `panel`, kTileRows rows at a time.
template <typename Out>
void panel_rows(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m_begin, int64_t m_end,
                int64_t panel, Out* y) {
  int64_t m0 = m_begin;
  for (; m0 + kTileRows <= m_end; m0 += kTileRows) panel_tile<kTileRows>(p, a, bias, m0, panel, m0 == m_begin, y);
  if (m0 < m_end) panel_tile<1>(p, a, bias, m0, panel, m0 == m_begin, y);
}

template <typename T>
void product(const Packed& p, const T* x, int64_t m_rows, const float* bias, T* y) {
  const QuantizedRows a =
      quantize_rows(x, m_rows, p.k_dim, activation_block(p.group, p.k_dim), p.bits, p.activation_passes);
  const int64_t n_panels = p.n_out / kPanel;
  for (int64_t m_begin = 0; m_begin < m_rows; m_begin += kChunkRows) {
    const int64_t m_end = std::min(m_rows, m_begin + kChunkRows);
    at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel) panel_rows(p, a, bias, m_begin, m_end, panel, y);
    });
  }
}

}  // namespace

std::string int8_dot_isa() { return "avx2"; }

void int8_dot_product(const Packed& p, const float* x, int64_t m_rows, const float* bias, float* y) {
  product(p, x, m_rows, bias, y);
}

void int8_dot_product(const Packed& p, const tokenmill_simd::bf16_t* x, int64_t m_rows, const float* bias,
                      tokenmill_simd::bf16_t* y) {
  product(p, x, m_rows, bias, y);
}

}  // namespace tokenmill_quant

#endif
