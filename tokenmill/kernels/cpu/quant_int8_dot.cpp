// Products with a panels-layout quantized weight whose activations are quantized to int8 first
// (quant_packed.h's int8_dot_product). Each row of x is cut into blocks (a weight group, or 128
// values of a per-channel int8 row), each block gets one fp32 scale s = absmax / 127 and two int8
// passes: hi = round(x / s) and lo = round((x - hi s) / (s / 254)), the residual in 254ths of a step
// (|lo| <= 127), so x is represented to s / 508 (about 15 bits of the block's range, finer than
// bf16's 8); or, with one pass, hi alone (to s / 2, as llama.cpp's int8 activations; half the
// integer work). The weight is read a panel of 16 rows at a time, one quad of K (4 values) per 16-lane
// vector, so one vpdpbusd multiplies the panel's quad (unsigned bytes) by a row's 4 activation bytes
// broadcast (signed), summing into the panel's 16 int32 outputs: no horizontal sums; each quad
// runs against each pass. An int4 byte is its value 0..15 as is; an int8 weight v is fed as the
// unsigned byte v + 128 and 128 x the block's sum of activation bytes is taken off again, in int32.
// Once per block the two sums are joined exactly in int32 (254 hi + lo), converted and scaled by
// s / 254 (one pass: hi by s; an int4 group's min multiplies the block's dequantized activation sum). The integer sums
// are exact, so the result is the fp32 product of the dequantized activations with the dequantized
// weight up to summation order.
//   Work split: x is taken kChunkRows rows at a time (its int8 bytes stay in cache); for each chunk
//   threads take pairs of panels (32 output columns), running the chunk's rows 4 at a time (the
//   tile: 4 x 2 x 2 int32 and 4 x 2 fp32 accumulators in registers) against the pair's packed
//   bytes, read from memory once per chunk and from cache for the further row tiles.
//   With AMX-INT8 (and the kernel's permission to use tiles), from kTileMinRows rows on, two passes: the same
//   integer sums by tile dot products. x's two passes are stored row by row interleaved (row m's
//   hi, then its lo), so one A tile holds up to 8 rows' hi and lo as 16 tile rows; a panel's quads
//   of one block are its B tile as stored (int8, signed x signed) or unpacked to bytes into the
//   thread's buffer, a block at a time as the first rows run (int4, signed x unsigned); each block's
//   int32 sums go through memory to the same fp32 epilogue in the same order, so every row's result
//   is bit-equal to the vector path's.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant_packed.h"
#include "simd.h"

#if defined(TOKENMILL_INT8_DOT_VNNI)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TOKENMILL_INT8_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace tokenmill_quant {

int64_t activation_block(int64_t group, int64_t k_dim) {
  if (group <= 128) return group;
  for (int64_t block : {128, 64, 32}) {
    if (k_dim % block == 0) return block;
  }
  return k_dim;
}

#if defined(TOKENMILL_INT8_DOT_VNNI)

namespace {

constexpr int kTileRows = 4;  // rows of x per tile
constexpr int kTilePanels = 2;  // panels per tile (and per work item)
constexpr int64_t kChunkRows = 192;  // rows of x per pass over the weight

// x quantized per block: int8 passes [M, n_passes, K] (row m's hi, then its lo if two); per block
// its scale, the factor of its joined integer sums (sum_scale: scale / 254 with two passes, scale
// with one), the sums of hi's and lo's bytes (lo's: 0 with one pass), and the dequantized block's sum.
struct QuantizedRows {
  std::vector<int8_t> passes;
  std::vector<float> scale, sum_scale, x_sum;
  std::vector<int32_t> hi_sum, lo_sum;
  int64_t block, blocks_per_row, k_dim, n_passes;
  const int8_t* hi(int64_t row) const { return passes.data() + n_passes * row * k_dim; }
  const int8_t* lo(int64_t row) const { return hi(row) + k_dim; }
};

template <typename In>
QuantizedRows quantize_rows(const In* x, int64_t m_rows, int64_t k_dim, int64_t block, int64_t n_passes) {
  QuantizedRows a;
  a.block = block;
  a.blocks_per_row = k_dim / block;
  a.k_dim = k_dim;
  a.n_passes = n_passes;
  a.passes.resize(n_passes * m_rows * k_dim);
  a.scale.resize(m_rows * a.blocks_per_row);
  a.sum_scale.resize(a.scale.size());
  a.x_sum.resize(a.scale.size());
  a.hi_sum.resize(a.scale.size());
  a.lo_sum.resize(a.scale.size());
  at::parallel_for(0, m_rows * a.blocks_per_row, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const In* xb = x + b * block;  // rows are contiguous: block b of the whole [M, K]
      const int64_t row = b / a.blocks_per_row, at = (b % a.blocks_per_row) * block;
      int8_t* hi_out = a.passes.data() + n_passes * row * k_dim + at;
      int8_t* lo_out = hi_out + k_dim;  // (two passes)
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
        hi_total = _mm512_add_epi32(hi_total, hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi_out + k), _mm512_cvtepi32_epi8(hi));
        if (n_passes == 2) {
          const __m512i lo = _mm512_cvtps_epi32(_mm512_div_ps(residual, lo_divisor));
          lo_total = _mm512_add_epi32(lo_total, lo);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo_out + k), _mm512_cvtepi32_epi8(lo));
        }
      }
      a.scale[b] = scale;
      a.sum_scale[b] = n_passes == 2 ? scale / kResidualSteps : scale;
      a.hi_sum[b] = _mm512_reduce_add_epi32(hi_total);
      a.lo_sum[b] = _mm512_reduce_add_epi32(lo_total);
      a.x_sum[b] = dequantized_block_sum(scale, a.hi_sum[b], a.lo_sum[b]);
    }
  });
  return a;
}

// Panel `panel`'s quads t and t + 1 (t even) as 64 unsigned bytes each, lane r holding row r's 4
// values (int4: 0..15, a pair's low and high nibbles; int8: v + 128).
template <int kBits>
__attribute__((always_inline)) inline void panel_quads(const Packed& p, int64_t panel, int64_t t, __m512i* first,
                                                       __m512i* second) {
  const uint8_t* q = quad_bytes(p, panel, t);
  if (kBits == 8) {
    *first = _mm512_xor_si512(_mm512_loadu_si512(q), _mm512_set1_epi8(-128));
    *second = _mm512_xor_si512(_mm512_loadu_si512(q + 64), _mm512_set1_epi8(-128));
    return;
  }
  const __m512i bytes = _mm512_loadu_si512(q), nibble = _mm512_set1_epi8(15);
  *first = _mm512_and_si512(bytes, nibble);
  *second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
}

// acc plus one block's product for one row of x and one panel, from its exact int32 sums of the hi
// and lo passes (the weight's own values): (254 hi + lo) (x scale / 254) (weight scale), or with
// one pass hi (x scale) (weight scale), then, for int4 (has_min), the weight's min times the block's
// dequantized x sum. Both paths run this, so a row's result does not depend on which did.
template <int kPasses, bool kHasMin>
__attribute__((always_inline)) inline __m512 add_block(__m512 acc, __m512i hi, __m512i lo, __m512 w_scale, __m512 w_min,
                                                       const QuantizedRows& a, int64_t ab) {
  const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(a.sum_scale[ab]));
  __m512i joined = hi;
  if (kPasses == 2) {
    const __m512i residual_steps = _mm512_set1_epi32(static_cast<int32_t>(kResidualSteps));
    joined = _mm512_add_epi32(_mm512_mullo_epi32(hi, residual_steps), lo);  // exact: < 2^30
  }
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), scale, acc);
  if (kHasMin) acc = _mm512_fmadd_ps(w_min, _mm512_set1_ps(a.x_sum[ab]), acc);
  return acc;
}

// The scales (and int4 mins; else zeros) of group g of kPanels panels from panel0.
template <int kPanels>
__attribute__((always_inline)) inline void load_group(const Packed& p, int64_t panel0, int64_t g, __m512* w_scale,
                                                      __m512* w_min) {
  if (p.groups_per_row == 1) g = 0;
  for (int j = 0; j < kPanels; ++j) {
    const int64_t at = ((panel0 + j) * p.groups_per_row + g) * kPanel;
    if (p.scale_fp16 != nullptr) {
      w_scale[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scale_fp16 + at)));
      w_min[j] = p.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.min_fp16 + at)))
                           : _mm512_setzero_ps();
    } else {
      w_scale[j] = _mm512_loadu_ps(p.scale + at);
      w_min[j] = p.has_min ? _mm512_loadu_ps(p.min + at) : _mm512_setzero_ps();
    }
  }
}

// y[row, 16 panel0 ...) = acc (one vector per panel) + bias (if not null), rounded to y's dtype.
template <typename Out>
inline void store_row(const Packed& p, const __m512* acc, int panels, const float* bias, int64_t row, int64_t panel0,
                      Out* y) {
  for (int j = 0; j < panels; ++j) {
    const int64_t n0 = (panel0 + j) * kPanel;
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    tokenmill_simd::store16(y + row * p.n_out + n0, _mm512_add_ps(acc[j], b));
  }
}

// y[m0 + m, 16 panel0 ...) (+ bias, if not null) for kRows rows of x (in kPasses passes) and
// kPanels panels of a weight of kBits (p.bits: the compiler keeps the loops free of its tests). With
// `prefetch_next`, the next kPanels panels' scales are fetched first and their bytes as these are
// read, at the same offsets (a work item's panels are short streams, and the hardware's
// prefetchers stop at each page).
template <int kRows, int kPanels, int kPasses, int kBits, typename Out>
void panel_tile(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m0, int64_t panel0,
                bool prefetch_next, Out* y) {
  __m512 acc[kRows][kPanels];
  for (int m = 0; m < kRows; ++m) {
    for (int j = 0; j < kPanels; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  const int64_t quads_per_block = a.block / 4, blocks_per_group = p.group / a.block;
  if (prefetch_next) prefetch_scales(p, panel0 + kPanels, kPanels);
  const int32_t* hi_quads[kRows];  // each row's 4 bytes of one quad
  const int32_t* lo_quads[kRows];
  for (int m = 0; m < kRows; ++m) {
    hi_quads[m] = reinterpret_cast<const int32_t*>(a.hi(m0 + m));
    lo_quads[m] = reinterpret_cast<const int32_t*>(a.lo(m0 + m));
  }
  for (int64_t b = 0; b < a.blocks_per_row; ++b) {
    __m512i hi_dots[kRows][kPanels], lo_dots[kRows][kPanels];
    for (int m = 0; m < kRows; ++m) {
      for (int j = 0; j < kPanels; ++j) hi_dots[m][j] = lo_dots[m][j] = _mm512_setzero_si512();
    }
    for (int64_t t = b * quads_per_block; t < (b + 1) * quads_per_block; t += 2) {  // a block's quads: even
      __m512i w[2][kPanels];
      for (int j = 0; j < kPanels; ++j) panel_quads<kBits>(p, panel0 + j, t, &w[0][j], &w[1][j]);
      if (prefetch_next) {  // past the weight's end (the last item) is harmless
        for (int j = 0; j < kPanels; ++j) {
          const char* next = reinterpret_cast<const char*>(quad_bytes(p, panel0 + kPanels + j, t));
          _mm_prefetch(next, _MM_HINT_T0);
          if (kBits == 8) _mm_prefetch(next + 64, _MM_HINT_T0);
        }
      }
      for (int s = 0; s < 2; ++s) {
#pragma GCC unroll 4
        for (int m = 0; m < kRows; ++m) {
          const __m512i hi = _mm512_set1_epi32(hi_quads[m][t + s]);
          for (int j = 0; j < kPanels; ++j) hi_dots[m][j] = _mm512_dpbusd_epi32(hi_dots[m][j], w[s][j], hi);
          if (kPasses == 2) {
            const __m512i lo = _mm512_set1_epi32(lo_quads[m][t + s]);
            for (int j = 0; j < kPanels; ++j) lo_dots[m][j] = _mm512_dpbusd_epi32(lo_dots[m][j], w[s][j], lo);
          }
        }
      }
    }
    __m512 w_scale[kPanels], w_min[kPanels];
    load_group<kPanels>(p, panel0, b / blocks_per_group, w_scale, w_min);
#pragma GCC unroll 4
    for (int m = 0; m < kRows; ++m) {
      const int64_t ab = (m0 + m) * a.blocks_per_row + b;
      for (int j = 0; j < kPanels; ++j) {
        __m512i hi = hi_dots[m][j], lo = lo_dots[m][j];
        if (kBits == 8) {  // the bytes were v + 128
          hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(128 * a.hi_sum[ab]));
          if (kPasses == 2) lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(128 * a.lo_sum[ab]));
        }
        acc[m][j] = add_block<kPasses, kBits == 4>(acc[m][j], hi, lo, w_scale[j], w_min[j], a, ab);
      }
    }
  }
  for (int m = 0; m < kRows; ++m) store_row(p, acc[m], kPanels, bias, m0 + m, panel0, y);
}

// Rows [m_begin, m_end) of x (in kPasses passes) against kPanels panels from panel0, kTileRows rows at a time.
template <int kPanels, int kPasses, int kBits, typename Out>
void panel_rows(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m_begin, int64_t m_end,
                int64_t panel0, Out* y) {
  int64_t m0 = m_begin;
  for (; m0 + kTileRows <= m_end; m0 += kTileRows) {
    panel_tile<kTileRows, kPanels, kPasses, kBits>(p, a, bias, m0, panel0, m0 == m_begin, y);
  }
  const bool first = m0 == m_begin;
  switch (m_end - m0) {
    case 3: panel_tile<3, kPanels, kPasses, kBits>(p, a, bias, m0, panel0, first, y); break;
    case 2: panel_tile<2, kPanels, kPasses, kBits>(p, a, bias, m0, panel0, first, y); break;
    case 1: panel_tile<1, kPanels, kPasses, kBits>(p, a, bias, m0, panel0, first, y); break;
    default: break;
  }
}

// Rows [m_begin, m_end) of x against the work item of kTilePanels panels (fewer at the end) from panel0.
template <int kPasses, int kBits, typename Out>
void item_rows(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m_begin, int64_t m_end,
               int64_t panel0, Out* y) {
  if (panel0 + kTilePanels <= p.n_out / kPanel) {
    panel_rows<kTilePanels, kPasses, kBits>(p, a, bias, m_begin, m_end, panel0, y);
  } else {
    panel_rows<1, kPasses, kBits>(p, a, bias, m_begin, m_end, panel0, y);
  }
}

#if defined(TOKENMILL_INT8_TILES)

constexpr int64_t kTileMinRows = 6;  // fewer rows: the vector path, as fast or faster (README's measurements)
constexpr int kTileXRows = 8;  // rows of x per A tile (their hi and lo: 16 tile rows)
constexpr int kTileBytes = 64;  // bytes of a tile row (the most values along K of one dot product)
constexpr int64_t kPrefetchQuads = 64;  // int4: how far ahead of the unpacking its weight bytes are fetched

// Tile registers (macros: GCC's tile intrinsics take the register's number as a literal): A holds
// x's passes, B0 and B1 the B tiles of a pair's two panels, C0 and C1 their int32 sums.
#define TOKENMILL_TILE_A 0
#define TOKENMILL_TILE_B0 1
#define TOKENMILL_TILE_B1 2
#define TOKENMILL_TILE_C0 3
#define TOKENMILL_TILE_C1 4

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use AMX tiles (Linux grants them on request, once per process).
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Blocks whose dot products fit whole tile rows: 16 or 32 values, or a multiple of 64.
bool tiles_fit(int64_t block) { return block == 16 || block == 32 || block % kTileBytes == 0; }

// Values along K of one tile dot product for activation blocks of `block` values.
int tile_k_step(int64_t block) { return static_cast<int>(std::min<int64_t>(block, kTileBytes)); }

// This thread's tile shapes for `x_rows` rows of x per A tile and dot products over `k_step` values.
void configure_tiles(int x_rows, int k_step) {
  TileConfig config;
  config.rows[TOKENMILL_TILE_A] = static_cast<uint8_t>(2 * x_rows);
  config.colsb[TOKENMILL_TILE_A] = static_cast<uint16_t>(k_step);
  for (int t : {TOKENMILL_TILE_B0, TOKENMILL_TILE_B1}) {
    config.rows[t] = static_cast<uint8_t>(k_step / 4);
    config.colsb[t] = kTileBytes;
  }
  for (int t : {TOKENMILL_TILE_C0, TOKENMILL_TILE_C1}) {
    config.rows[t] = static_cast<uint8_t>(2 * x_rows);
    config.colsb[t] = kTileBytes;
  }
  _tile_loadconfig(&config);
}

// C tile `c_tile` += A times the B tile loaded into `b_tile` from `quads` (k_step / 4 quads of 64
// bytes): signed x signed bytes for int8 weights, signed x unsigned for int4.
#define TOKENMILL_TILE_DOT(b_tile, c_tile, quads, int8) \
  do {                                                  \
    _tile_loadd(b_tile, quads, kTileBytes);             \
    if (int8) {                                         \
      _tile_dpbssd(c_tile, TOKENMILL_TILE_A, b_tile);   \
    } else {                                            \
      _tile_dpbsud(c_tile, TOKENMILL_TILE_A, b_tile);   \
    }                                                   \
  } while (0)

// Rows [m0, m0 + x_rows) of x against kPanels panels from panel0, their quads at quads[j] (panel
// j's quad t at quads[j] + 64 t), tiles configured for x_rows.
// With `unpack` (int4, the first rows against this pair), each block's quads are first unpacked to
// bytes at quads[j] (a block at a time, so the weight's loads overlap the tile work).
template <int kPanels, typename Out>
void tile_rows(const Packed& p, const QuantizedRows& a, const float* bias, int64_t m0, int x_rows, int64_t panel0,
               const uint8_t* const* quads, bool unpack, Out* y) {
  const int k_step = tile_k_step(a.block);
  const int64_t blocks_per_group = p.group / a.block, pass_stride = a.k_dim;
  alignas(64) int32_t sums[kPanels][2 * kTileXRows][kPanel];
  __m512 acc[kTileXRows][kPanels];
  for (int m = 0; m < x_rows; ++m) {
    for (int j = 0; j < kPanels; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < a.blocks_per_row; ++b) {
    if (unpack) {
      for (int j = 0; j < kPanels; ++j) {
        uint8_t* bytes = const_cast<uint8_t*>(quads[j]);
        const int64_t t0 = b * a.block / 4, t1 = t0 + a.block / 4;
        for (int64_t t = t0; t < t1; t += 2) {  // a prefetch past the weight's end is harmless
          _mm_prefetch(reinterpret_cast<const char*>(quad_bytes(p, panel0 + j, t + kPrefetchQuads)), _MM_HINT_T0);
        }
        for (int64_t t = t0; t < t1; t += 2) {
          __m512i first, second;
          panel_quads<4>(p, panel0 + j, t, &first, &second);
          _mm512_storeu_si512(bytes + t * 64, first);
          _mm512_storeu_si512(bytes + t * 64 + 64, second);
        }
      }
    }
    _tile_zero(TOKENMILL_TILE_C0);
    if (kPanels > 1) _tile_zero(TOKENMILL_TILE_C1);
    for (int64_t k = b * a.block; k < (b + 1) * a.block; k += k_step) {
      // tile row 2 m: row m0 + m's hi, 2 m + 1: its lo; a panel's quad t = k / 4 at 64 t bytes
      _tile_loadd(TOKENMILL_TILE_A, a.hi(m0) + k, pass_stride);
      TOKENMILL_TILE_DOT(TOKENMILL_TILE_B0, TOKENMILL_TILE_C0, quads[0] + k * 16, p.bits == 8);
      if (kPanels > 1) TOKENMILL_TILE_DOT(TOKENMILL_TILE_B1, TOKENMILL_TILE_C1, quads[1] + k * 16, p.bits == 8);
    }
    _tile_stored(TOKENMILL_TILE_C0, sums[0], kTileBytes);
    if (kPanels > 1) _tile_stored(TOKENMILL_TILE_C1, sums[kPanels - 1], kTileBytes);
    __m512 w_scale[kPanels], w_min[kPanels];
    load_group<kPanels>(p, panel0, b / blocks_per_group, w_scale, w_min);
    for (int m = 0; m < x_rows; ++m) {
      const int64_t ab = (m0 + m) * a.blocks_per_row + b;
      for (int j = 0; j < kPanels; ++j) {
        const __m512i hi = _mm512_load_si512(sums[j][2 * m]), lo = _mm512_load_si512(sums[j][2 * m + 1]);
        acc[m][j] = p.has_min ? add_block<2, true>(acc[m][j], hi, lo, w_scale[j], w_min[j], a, ab)
                              : add_block<2, false>(acc[m][j], hi, lo, w_scale[j], w_min[j], a, ab);
      }
    }
  }
  for (int m = 0; m < x_rows; ++m) store_row(p, acc[m], kPanels, bias, m0 + m, panel0, y);
}

// The tile path of product: threads take pairs of panels and run every row of x against a pair,
// kTileXRows at a time (an int4 pair's quads unpacked into the thread's buffer by the first rows,
// read from it by the others).
template <typename T>
void tile_product(const Packed& p, const QuantizedRows& a, int64_t m_rows, const float* bias, T* y) {
  const int64_t n_panels = p.n_out / kPanel, quads_per_panel = p.k_dim / 4;
  const int k_step = tile_k_step(a.block);
  at::parallel_for(0, (n_panels + kTilePanels - 1) / kTilePanels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> unpacked;
    int configured_rows = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel0 = item * kTilePanels;
      const int panels = static_cast<int>(std::min<int64_t>(kTilePanels, n_panels - panel0));
      const uint8_t* quads[kTilePanels];
      if (p.bits == 8) {
        for (int j = 0; j < panels; ++j) quads[j] = quad_bytes(p, panel0 + j, 0);
      } else {
        unpacked.resize(static_cast<size_t>(kTilePanels * quads_per_panel * 64));
        for (int j = 0; j < panels; ++j) quads[j] = unpacked.data() + j * quads_per_panel * 64;
      }
      for (int64_t m0 = 0; m0 < m_rows; m0 += kTileXRows) {
        const int x_rows = static_cast<int>(std::min<int64_t>(kTileXRows, m_rows - m0));
        if (x_rows != configured_rows) {
          configure_tiles(x_rows, k_step);
          configured_rows = x_rows;
        }
        const bool unpack = p.bits == 4 && m0 == 0;
        if (panels == kTilePanels) {
          tile_rows<kTilePanels>(p, a, bias, m0, x_rows, panel0, quads, unpack, y);
        } else {
          tile_rows<1>(p, a, bias, m0, x_rows, panel0, quads, unpack, y);
        }
      }
    }
    if (configured_rows != 0) _tile_release();
  });
}

#endif

template <typename T>
void product(const Packed& p, const T* x, int64_t m_rows, const float* bias, T* y) {
  const QuantizedRows a = quantize_rows(x, m_rows, p.k_dim, activation_block(p.group, p.k_dim), p.activation_passes);
#if defined(TOKENMILL_INT8_TILES)
  if (a.n_passes == 2 && m_rows >= kTileMinRows && tiles_fit(a.block) && tiles_permitted()) {
    tile_product(p, a, m_rows, bias, y);
    return;
  }
#endif
  const int64_t n_panels = p.n_out / kPanel;
  for (int64_t m_begin = 0; m_begin < m_rows; m_begin += kChunkRows) {
    const int64_t m_end = std::min(m_rows, m_begin + kChunkRows);
    at::parallel_for(0, (n_panels + kTilePanels - 1) / kTilePanels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t panel0 = item * kTilePanels;
        if (a.n_passes == 2) {
          p.bits == 8 ? item_rows<2, 8>(p, a, bias, m_begin, m_end, panel0, y)
                      : item_rows<2, 4>(p, a, bias, m_begin, m_end, panel0, y);
        } else {
          p.bits == 8 ? item_rows<1, 8>(p, a, bias, m_begin, m_end, panel0, y)
                      : item_rows<1, 4>(p, a, bias, m_begin, m_end, panel0, y);
        }
      }
    });
  }
}

}  // namespace

std::string int8_dot_isa() { return "avx512-vnni"; }

#if defined(TOKENMILL_INT8_TILES)
bool int8_dot_tiles() { return tiles_permitted(); }
#else
bool int8_dot_tiles() { return false; }
#endif

void int8_dot_product(const Packed& p, const float* x, int64_t m_rows, const float* bias, float* y) {
  product(p, x, m_rows, bias, y);
}

void int8_dot_product(const Packed& p, const tokenmill_simd::bf16_t* x, int64_t m_rows, const float* bias,
                      tokenmill_simd::bf16_t* y) {
  product(p, x, m_rows, bias, y);
}

#else

bool int8_dot_tiles() { return false; }

#if !defined(TOKENMILL_INT8_DOT_AVX2)

std::string int8_dot_isa() { return ""; }

void int8_dot_product(const Packed&, const float*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "int8 dot products need AVX2 (with FMA and F16C) or AVX512-VNNI");
}

void int8_dot_product(const Packed&, const tokenmill_simd::bf16_t*, int64_t, const float*, tokenmill_simd::bf16_t*) {
  TORCH_CHECK(false, "int8 dot products need AVX2 (with FMA and F16C) or AVX512-VNNI");
}

#endif
#endif

}  // namespace tokenmill_quant
