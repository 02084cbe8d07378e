// Paged prefill attention on CPU: the query rows of several requests (fp32 or bf16), each request's keys
// and values read in place from the token-slot KV storage (in the queries' dtype) through the
// request-to-token table, this step's own included (they are stored before attention). The query at
// position p of a request sees its keys max(0, p - window + 1) .. p (every key <= p when window <= 0).
//
// Numerics are those of two matmuls around a softmax in the model's dtype (transformers' eager
// attention): each score q.k is summed in fp32 and rounded to the dtype, softmax(scale * score) is
// fp32, each probability is rounded to the dtype, and each output value is summed in fp32 and rounded
// to the dtype. In fp32 nothing is rounded.
//
// A work item is one request's KV head and a tile of up to kTilePositions query positions, with every
// query head of the KV head's group: the tile's rows share their keys. An item packs the keys its
// last row sees (from its first row's first key) into blocks of 16 keys, transposed, and the values
// into rows; then it computes the scores of kScoreRows rows x 16 keys in registers, the exact softmax
// of each row (keys it must not see get probability 0), and the outputs kValueRows rows x up to 64
// dims at a time, over the keys those rows see. bf16 built with AVX512-BF16 packs bf16 pairs (keys:
// pairs of dims; values and probabilities: pairs of consecutive keys) for vdpbf16ps, 32 products an
// instruction with exact products and fp32 sums; everything else packs fp32 for FMAs. Items are
// handed out largest first from a shared counter, so a thread that is descheduled holds up only the
// item it has.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"
#include "tile16.h"

namespace {

using tokenmill_simd::bf16_t;
using tokenmill_simd::load16;
using tokenmill_simd::softmax_in_place;
using tokenmill_simd::store16;
using tokenmill_simd::store_as;
using tokenmill_simd::to_float;
using tokenmill_simd::vec16;

constexpr int64_t kTilePositions = 16;
constexpr int64_t kKeyBlock = 16;  // keys per transposed block: one vector of scores
constexpr int64_t kMaxHeadDim = 256;
#if defined(__AVX512F__)
constexpr int64_t kScoreRows = 8;  // 8 accumulators
constexpr int64_t kValueRows = 4;  // 16 accumulators
constexpr int64_t kMaxChunkVectors = 4;  // output dims per pass: 4 vectors of 16
#else
constexpr int64_t kScoreRows = 4;  // a vec16 is two AVX2 registers: 8 accumulators
constexpr int64_t kValueRows = 2;  // 8 accumulators
constexpr int64_t kMaxChunkVectors = 2;
#endif

template <typename T>
struct Problem {
  const T* q;
  T* out;
  const T* k_cache;
  const T* v_cache;
  const int32_t* table;
  int64_t table_stride;
  const int64_t* rows;
  const int64_t* q_starts;
  const int64_t* prefix;
  const int64_t* extend;
  int64_t n_heads, n_kv_heads, group, head_dim, window;
  float scale;
};

struct Item {
  int64_t request, kv_head, tile, cost;
};

struct Scratch {
  std::vector<float> keys;        // fp32 path: [blocks][D][kKeyBlock]
  std::vector<float> values;      // fp32 path: [keys][D]
  std::vector<float> queries;     // fp32 path: [padded rows][D]
  std::vector<uint32_t> keys2;    // bf16 pairs: [blocks][D / 2][kKeyBlock]
  std::vector<uint32_t> values2;  // bf16 pairs of consecutive keys: [key pairs][D]
  std::vector<uint32_t> queries2; // bf16 pairs: [padded rows][D / 2]
  std::vector<uint32_t> probs2;   // bf16 pairs of consecutive keys: [padded rows][padded keys / 2]
  std::vector<float> scores;      // [padded rows][padded keys]
};

// x as the model's dtype holds it (fp32: as is).
template <typename T>
inline float rounded(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    bf16_t b;
    store_as(&b, x);
    return to_float(b);
  }
}

inline int64_t first_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// What one tile computes with: its keys (from k0 on, n_keys of them, padded to whole blocks), its
// query rows (row r: position first_pos + r / group, query head h * group + r % group) padded to
// whole score groups, where each row's output goes and which keys it sees. A thread keeps one and
// refills it for every item it takes (no allocation per item once its vectors have grown).
template <typename T>
struct Tile {
  int64_t k0, n_keys, blocks, padded_keys, first_pos, rows, padded_rows;
  const int32_t* slots;           // the tile's keys' slots
  std::vector<const T*> queries;  // [rows]
  std::vector<T*> outs;           // [rows]
  std::vector<int64_t> lo, hi;    // [padded rows]: row r's keys [lo, hi) from k0; padded rows none
};

// The fp32 path: keys widened and transposed into blocks of 16, values widened, queries widened.
template <typename T>
void pack_fp32(const Problem<T>& p, int64_t h, const Tile<T>& t, Scratch& s) {
  const int64_t dim = p.head_dim, slot_stride = p.n_kv_heads * dim;
  s.keys.assign(t.blocks * dim * kKeyBlock, 0.f);
  s.values.resize(t.n_keys * dim);
  s.queries.assign(t.padded_rows * dim, 0.f);
  for (int64_t j = 0; j < t.n_keys; ++j) {
    const T* key = p.k_cache + t.slots[j] * slot_stride + h * dim;
    const T* value = p.v_cache + t.slots[j] * slot_stride + h * dim;
    float* column = s.keys.data() + (j / kKeyBlock) * dim * kKeyBlock + j % kKeyBlock;
    for (int64_t d = 0; d < dim; ++d) column[d * kKeyBlock] = to_float(key[d]);
    for (int64_t d = 0; d < dim; d += 16) store16(s.values.data() + j * dim + d, load16(value + d));
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t d = 0; d < dim; d += 16) store16(s.queries.data() + r * dim + d, load16(t.queries[r] + d));
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// With AVX2 alone, a vec16 times a scalar compiles to the scalar's broadcast through the stack on
// every use: the scores take panel_linear.cpp's register tile (tile16.h) and the value sums hold each
// vec16 as two 256-bit registers explicitly. Same sums, in the same order, one fma each.

// scores[r][block * 16 ..] for kScoreRows rows from `queries` and the key blocks [0, blocks).
inline void score_rows(const float* queries, const float* keys, float* scores, int64_t blocks, int64_t dim,
                       int64_t score_stride) {
  for (int64_t kb = 0; kb < blocks; ++kb) {
    tokenmill_tile::tile16<kScoreRows>(queries, dim, keys + kb * dim * kKeyBlock, dim, scores + kb * kKeyBlock,
                                       score_stride, false, kKeyBlock);
  }
}

// out rows (kValueRows of them; `valid` written) for dims [d0, d0 + 16 * kVectors): sum over keys
// [lo, hi) of probs[r][j] * values[j].
template <typename T, int kVectors>
inline void value_rows(const float* probs, int64_t prob_stride, const float* values, int64_t dim, int64_t d0,
                       int64_t lo, int64_t hi, T* const* out_rows, int64_t valid) {
  __m256 acc[kValueRows][2 * kVectors];
  for (int64_t r = 0; r < kValueRows; ++r) {
    for (int c = 0; c < 2 * kVectors; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t j = lo; j < hi; ++j) {
    __m256 v[2 * kVectors];
    #pragma GCC unroll 8
    for (int c = 0; c < 2 * kVectors; ++c) v[c] = _mm256_loadu_ps(values + j * dim + d0 + 8 * c);
    #pragma GCC unroll 8
    for (int64_t r = 0; r < kValueRows; ++r) {
      const __m256 weight = _mm256_broadcast_ss(probs + r * prob_stride + j);
      #pragma GCC unroll 8
      for (int c = 0; c < 2 * kVectors; ++c) acc[r][c] = _mm256_fmadd_ps(v[c], weight, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kValueRows; ++r) {  // constant indices keep acc in registers
    if (r >= valid) break;
    for (int c = 0; c < kVectors; ++c) {
      store16(out_rows[r] + d0 + 16 * c, tokenmill_simd::join16(acc[r][2 * c], acc[r][2 * c + 1]));
    }
  }
}
#else
// scores[r][block * 16 ..] for kScoreRows rows from `queries` and the key blocks [0, blocks).
inline void score_rows(const float* queries, const float* keys, float* scores, int64_t blocks, int64_t dim,
                       int64_t score_stride) {
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const float* block = keys + kb * dim * kKeyBlock;
    vec16 acc[kScoreRows] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const vec16 k = load16(block + d * kKeyBlock);
      #pragma GCC unroll 8
      for (int64_t r = 0; r < kScoreRows; ++r) acc[r] += k * queries[r * dim + d];
    }
    for (int64_t r = 0; r < kScoreRows; ++r) store16(scores + r * score_stride + kb * kKeyBlock, acc[r]);
  }
}

// out rows (kValueRows of them; `valid` written) for dims [d0, d0 + 16 * kVectors): sum over keys
// [lo, hi) of probs[r][j] * values[j].
template <typename T, int kVectors>
inline void value_rows(const float* probs, int64_t prob_stride, const float* values, int64_t dim, int64_t d0,
                       int64_t lo, int64_t hi, T* const* out_rows, int64_t valid) {
  vec16 acc[kValueRows][kVectors] = {};
  for (int64_t j = lo; j < hi; ++j) {
    vec16 v[kVectors];
    #pragma GCC unroll 8
    for (int c = 0; c < kVectors; ++c) v[c] = load16(values + j * dim + d0 + 16 * c);
    #pragma GCC unroll 8
    for (int64_t r = 0; r < kValueRows; ++r) {
      const float weight = probs[r * prob_stride + j];
      #pragma GCC unroll 8
      for (int c = 0; c < kVectors; ++c) acc[r][c] += v[c] * weight;
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kValueRows; ++r) {  // constant indices keep acc in registers
    if (r >= valid) break;
    for (int c = 0; c < kVectors; ++c) store16(out_rows[r] + d0 + 16 * c, acc[r][c]);
  }
}

#endif

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// The bf16 path: keys as pairs of dims, transposed into blocks of 16 keys; values as pairs of
// consecutive keys per dim (a last odd key paired with zeros); queries as pairs of dims.
void pack_bf16(const Problem<bf16_t>& p, int64_t h, const Tile<bf16_t>& t, Scratch& s) {
  const int64_t half = p.head_dim / 2, slot_stride = p.n_kv_heads * p.head_dim;
  const int64_t key_pairs = (t.n_keys + 1) / 2;
  s.keys2.assign(t.blocks * half * kKeyBlock, 0u);
  s.values2.resize(key_pairs * p.head_dim);
  s.queries2.assign(t.padded_rows * half, 0u);
  for (int64_t j = 0; j < t.n_keys; ++j) {
    uint32_t key[kMaxHeadDim / 2];
    std::memcpy(key, p.k_cache + t.slots[j] * slot_stride + h * p.head_dim, half * sizeof(uint32_t));
    uint32_t* column = s.keys2.data() + (j / kKeyBlock) * half * kKeyBlock + j % kKeyBlock;
    for (int64_t d = 0; d < half; ++d) column[d * kKeyBlock] = key[d];
  }
  for (int64_t jp = 0; jp < key_pairs; ++jp) {
    const bf16_t* even = p.v_cache + t.slots[2 * jp] * slot_stride + h * p.head_dim;
    const bool has_odd = 2 * jp + 1 < t.n_keys;  // a last odd key pairs with zeros
    const bf16_t* odd = has_odd ? p.v_cache + t.slots[2 * jp + 1] * slot_stride + h * p.head_dim : nullptr;
    uint32_t* pair = s.values2.data() + jp * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) pair[d] = even[d] | (odd ? uint32_t{odd[d]} << 16 : 0u);
  }
  for (int64_t r = 0; r < t.rows; ++r) std::memcpy(s.queries2.data() + r * half, t.queries[r], half * sizeof(uint32_t));
}

void score_rows_bf16(const uint32_t* queries, const uint32_t* keys, float* scores, int64_t blocks, int64_t half,
                     int64_t score_stride) {
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint32_t* block = keys + kb * half * kKeyBlock;
    __m512 acc[kScoreRows];
    for (int64_t r = 0; r < kScoreRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < half; ++d) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(block + d * kKeyBlock);
      #pragma GCC unroll 8
      for (int64_t r = 0; r < kScoreRows; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[r * half + d])));
      }
    }
    for (int64_t r = 0; r < kScoreRows; ++r) _mm512_storeu_ps(scores + r * score_stride + kb * kKeyBlock, acc[r]);
  }
}

template <int kVectors>
inline void value_rows_bf16(const uint32_t* probs, int64_t prob_stride, const uint32_t* values, int64_t dim,
                            int64_t d0, int64_t lo, int64_t hi, bf16_t* const* out_rows, int64_t valid) {
  __m512 acc[kValueRows][kVectors];
  for (int64_t r = 0; r < kValueRows; ++r) {
    for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t jp = lo; jp < hi; ++jp) {
    __m512bh v[kVectors];
    #pragma GCC unroll 8
    for (int c = 0; c < kVectors; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + jp * dim + d0 + 16 * c);
    #pragma GCC unroll 8
    for (int64_t r = 0; r < kValueRows; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r * prob_stride + jp]));
      #pragma GCC unroll 8
      for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], weight);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kValueRows; ++r) {  // constant indices keep acc in registers
    if (r >= valid) break;
    for (int c = 0; c < kVectors; ++c) {
      float sum[16];
      _mm512_storeu_ps(sum, acc[r][c]);
      store16(out_rows[r] + d0 + 16 * c, load16(sum));
    }
  }
}
#else
constexpr bool kBf16Dot = false;
// Declared only, for attend_tile's branches that need them, discarded where kBf16Dot is false.
void pack_bf16(const Problem<bf16_t>& p, int64_t h, const Tile<bf16_t>& t, Scratch& s);
void score_rows_bf16(const uint32_t* queries, const uint32_t* keys, float* scores, int64_t blocks, int64_t half,
                     int64_t score_stride);
template <int kVectors>
void value_rows_bf16(const uint32_t* probs, int64_t prob_stride, const uint32_t* values, int64_t dim, int64_t d0,
                     int64_t lo, int64_t hi, bf16_t* const* out_rows, int64_t valid);
#endif

template <typename T>
void attend_tile(const Problem<T>& p, const Item& item, Tile<T>& t, Scratch& s) {
  const int64_t b = item.request, h = item.kv_head, group = p.group, dim = p.head_dim;
  const int64_t tile_first = item.tile * kTilePositions;
  const int64_t positions = std::min(kTilePositions, p.extend[b] - tile_first);
  t.first_pos = p.prefix[b] + tile_first;
  t.k0 = first_key(t.first_pos, p.window);
  t.n_keys = t.first_pos + positions - t.k0;
  t.blocks = (t.n_keys + kKeyBlock - 1) / kKeyBlock;
  t.padded_keys = t.blocks * kKeyBlock;
  t.rows = positions * group;
  t.padded_rows = (t.rows + kScoreRows - 1) / kScoreRows * kScoreRows;
  t.slots = p.table + p.rows[b] * p.table_stride + t.k0;
  t.queries.resize(t.rows);
  t.outs.resize(t.rows);
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t token = p.q_starts[b] + tile_first + r / group, head = h * group + r % group;
    t.queries[r] = p.q + (token * p.n_heads + head) * dim;
    t.outs[r] = p.out + (token * p.n_heads + head) * dim;
  }
  constexpr bool bf16_dot = kBf16Dot && !std::is_same_v<T, float>;
  s.scores.resize(t.padded_rows * t.padded_keys);
  if constexpr (bf16_dot) {
    pack_bf16(p, h, t, s);
  } else {
    pack_fp32(p, h, t, s);
  }
  for (int64_t r0 = 0; r0 < t.padded_rows; r0 += kScoreRows) {
    const int64_t last_row = std::min(r0 + kScoreRows, t.rows) - 1;
    const int64_t seen = t.first_pos + last_row / group + 1 - t.k0;  // keys the group's last row sees
    const int64_t blocks = (seen + kKeyBlock - 1) / kKeyBlock;
    float* scores = s.scores.data() + r0 * t.padded_keys;
    if constexpr (bf16_dot) {
      score_rows_bf16(s.queries2.data() + r0 * dim / 2, s.keys2.data(), scores, blocks, dim / 2, t.padded_keys);
    } else {
      score_rows(s.queries.data() + r0 * dim, s.keys.data(), scores, blocks, dim, t.padded_keys);
    }
  }

  t.lo.assign(t.padded_rows, 0);
  t.hi.assign(t.padded_rows, 0);
  std::vector<int64_t>& lo = t.lo;
  std::vector<int64_t>& hi = t.hi;
  for (int64_t r = 0; r < t.padded_rows; ++r) {
    float* e = s.scores.data() + r * t.padded_keys;
    if (r < t.rows) {
      const int64_t position = t.first_pos + r / group;
      lo[r] = first_key(position, p.window) - t.k0;
      hi[r] = position + 1 - t.k0;
      for (int64_t j = lo[r]; j < hi[r]; ++j) e[j] = rounded<T>(e[j]);
      softmax_in_place(e, lo[r], hi[r], p.scale);
      for (int64_t j = lo[r]; j < hi[r]; ++j) e[j] = rounded<T>(e[j]);
    }
    std::memset(e, 0, lo[r] * sizeof(float));
    std::memset(e + hi[r], 0, (t.padded_keys - hi[r]) * sizeof(float));
  }
  if constexpr (bf16_dot) {  // probabilities (already bf16 values) as pairs of consecutive keys
    const int64_t pairs = t.padded_keys / 2;
    s.probs2.resize(t.padded_rows * pairs);
    for (int64_t i = 0; i < t.padded_rows * pairs; ++i) {
      uint32_t even, odd;
      std::memcpy(&even, &s.scores[2 * i], sizeof(even));
      std::memcpy(&odd, &s.scores[2 * i + 1], sizeof(odd));
      s.probs2[i] = (even >> 16) | (odd & 0xffff0000u);
    }
  }

  for (int64_t r0 = 0; r0 < t.rows; r0 += kValueRows) {  // padded rows (kValueRows divides kScoreRows): zeros
    const int64_t valid = std::min(kValueRows, t.rows - r0);
    int64_t key_lo = lo[r0], key_hi = 0;
    for (int64_t r = r0; r < r0 + valid; ++r) {
      key_lo = std::min(key_lo, lo[r]);
      key_hi = std::max(key_hi, hi[r]);
    }
    T* const* outs = t.outs.data() + r0;
    for (int64_t d0 = 0; d0 < dim; d0 += 16 * kMaxChunkVectors) {
      const int64_t vectors = std::min<int64_t>(kMaxChunkVectors, (dim - d0) / 16);
      if constexpr (bf16_dot) {
        const uint32_t* probs = s.probs2.data() + r0 * t.padded_keys / 2;
        const int64_t stride = t.padded_keys / 2, jp_lo = key_lo / 2, jp_hi = (key_hi + 1) / 2;
        const uint32_t* values = s.values2.data();
        switch (vectors) {
          case 4: value_rows_bf16<4>(probs, stride, values, dim, d0, jp_lo, jp_hi, outs, valid); break;
          case 3: value_rows_bf16<3>(probs, stride, values, dim, d0, jp_lo, jp_hi, outs, valid); break;
          case 2: value_rows_bf16<2>(probs, stride, values, dim, d0, jp_lo, jp_hi, outs, valid); break;
          default: value_rows_bf16<1>(probs, stride, values, dim, d0, jp_lo, jp_hi, outs, valid); break;
        }
      } else {
        const float* probs = s.scores.data() + r0 * t.padded_keys;
        const float* values = s.values.data();
        switch (vectors) {
          case 4: value_rows<T, 4>(probs, t.padded_keys, values, dim, d0, key_lo, key_hi, outs, valid); break;
          case 3: value_rows<T, 3>(probs, t.padded_keys, values, dim, d0, key_lo, key_hi, outs, valid); break;
          case 2: value_rows<T, 2>(probs, t.padded_keys, values, dim, d0, key_lo, key_hi, outs, valid); break;
          default: value_rows<T, 1>(probs, t.padded_keys, values, dim, d0, key_lo, key_hi, outs, valid); break;
        }
      }
    }
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t batch) {
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t tile = 0; tile * kTilePositions < p.extend[b]; ++tile) {
      const int64_t last_pos = p.prefix[b] + std::min(p.extend[b], (tile + 1) * kTilePositions) - 1;
      const int64_t keys = last_pos + 1 - first_key(p.prefix[b] + tile * kTilePositions, p.window);
      for (int64_t h = 0; h < p.n_kv_heads; ++h) items.push_back({b, h, tile, keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Tile<T> tile;
    Scratch scratch;
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) attend_tile(p, items[i], tile, scratch);
  });
}

}  // namespace

// out and q [T, H, D] (fp32 or bf16, contiguous; D a multiple of 16); k_cache/v_cache [S, Hkv, D] in q's
// dtype; req_to_token [R, C] int32; req_pool_indices, q_starts, prefix_lens, extend_lens [B] int64. Request
// b's query rows q[q_starts[b] : q_starts[b] + extend_lens[b]] sit at positions prefix_lens[b] .. and
// attend to slots req_to_token[req_pool_indices[b], 0 : prefix_lens[b] + extend_lens[b]]; their outputs
// are written to the same rows of `out` (other rows are left as they are).
void paged_prefill_attention_(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& req_to_token,
                              const at::Tensor& req_pool_indices, const at::Tensor& q_starts,
                              const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                              int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q must be fp32 or bf16");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == dtype &&
                  out.is_contiguous(), "q and out: contiguous [T, H, D] of one dtype");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache/v_cache: contiguous [S, Hkv, D] in q's dtype");
  const int64_t dim = q.size(2), n_heads = q.size(1), n_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && dim % 16 == 0 && dim <= kMaxHeadDim && n_heads % n_kv_heads == 0,
              "head_dim must match, be a multiple of 16 and at most 256; query heads a multiple of KV heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 rows");
  const int64_t batch = req_pool_indices.numel();
  for (const at::Tensor* t : {&req_pool_indices, &q_starts, &prefix_lens, &extend_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == batch,
                "indices and lengths: contiguous int64, one per request");
  }
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0), "req_pool_index out of range for request ", b);
    TORCH_CHECK(extend[b] >= 1 && prefix[b] >= 0 && prefix[b] + extend[b] <= req_to_token.size(1),
                "prefix/extend lengths out of range for request ", b);
    TORCH_CHECK(starts[b] >= 0 && starts[b] + extend[b] <= q.size(0), "query rows out of range for request ", b);
  }
  auto fill = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> p{};
    p.q = static_cast<const T*>(q.data_ptr());
    p.out = static_cast<T*>(out.data_ptr());
    p.k_cache = static_cast<const T*>(k_cache.data_ptr());
    p.v_cache = static_cast<const T*>(v_cache.data_ptr());
    p.table = req_to_token.data_ptr<int32_t>();
    p.table_stride = req_to_token.stride(0);
    p.rows = rows;
    p.q_starts = starts;
    p.prefix = prefix;
    p.extend = extend;
    p.n_heads = n_heads;
    p.n_kv_heads = n_kv_heads;
    p.group = n_heads / n_kv_heads;
    p.head_dim = dim;
    p.window = window;
    p.scale = static_cast<float>(scale);
    run(p, batch);
  };
  if (dtype == at::kFloat) {
    fill(float{});
  } else {
    fill(bf16_t{});
  }
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor q_starts, Tensor prefix_lens, Tensor extend_lens, float scale, "
        "int window) -> ()");
  m.impl("paged_prefill_attention_", c10::DispatchKey::CPU, &paged_prefill_attention_);
}
