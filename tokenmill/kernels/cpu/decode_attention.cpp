// Paged decode attention on CPU: one query token (fp32 or bf16) per request; keys and values (fp32,
// bf16, fp8 e4m3fn or e5m2 (scale 1), or int8 with an fp32 scale per slot and KV head; widened to fp32
// as they are read, an int8 key's scale applied to its score and a value's to its weight) are read in
// place from the token-slot KV storage
// through the request-to-token table (no gather copies, no padding to the longest request). The
// math is fp32; the output has the query's dtype. With a sliding window W > 0 a request reads only
// its last W keys (positions max(0, len - W) .. len - 1), as the query at position len - 1 sees them.
//
// A request's context is split into chunks of at most kChunkTokens keys, merged afterwards with
// their softmax statistics (a fixed size, so a request's output never depends on the rest of the
// batch). A work item is one chunk and a range of its KV heads (all of them when there are enough
// chunks to keep every thread busy), so a key/value slot row is streamed once, front to back,
// and serves every query head of its GQA group; one long request still spreads over the threads
// while reading whole slot rows. Threads take items one at a time from a shared counter. Slot rows
// are prefetched a few slots ahead: the request-to-token indirection hides the access pattern from
// the hardware prefetchers, and decode-time slots of concurrent requests interleave. Scores are
// exact (a score pass, then a vectorized max/exp/sum per query row, then the value pass into the
// output rows). bf16 queries against a bf16 cache, built with AVX512-BF16, are scored by vdpbf16ps
// on the bf16 values as they are (exact products, fp32 sums in another order than the widened path's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

using tokenmill_simd::horizontal_sum;
using tokenmill_simd::load16;
using tokenmill_simd::load8;
using tokenmill_simd::store16;
using tokenmill_simd::store8;
using tokenmill_simd::vec16;
using tokenmill_simd::vec8;

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the slot row in use to prefetch
constexpr int64_t kChunkTokens = 128;  // keys per work item at most (see run)
#if defined(__AVX512BF16__)
constexpr bool kBf16Scores = true;  // bf16 queries against a bf16 cache score by vdpbf16ps
#else
constexpr bool kBf16Scores = false;
#endif

// kHeadDim > 0 fixes head_dim at compile time (unrolled loops); 0 reads it at run time.
template <int64_t kHeadDim, typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : n;
  const int64_t vec_end = dim - dim % 8;
  vec8 acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 16 <= vec_end; i += 16) {
    acc0 += load8(a + i) * load8(b + i);
    acc1 += load8(a + i + 8) * load8(b + i + 8);
  }
  if (i < vec_end) acc0 += load8(a + i) * load8(b + i);
  float s = horizontal_sum(acc0 + acc1);
  for (i = vec_end; i < dim; ++i) s += a[i] * tokenmill_simd::to_float(b[i]);
  return s;
}

template <int64_t kHeadDim, typename KV>
inline void axpy(float alpha, const KV* x, float* y, int64_t n) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : n;
  const int64_t vec_end = dim - dim % 8;
  for (int64_t i = 0; i < vec_end; i += 8) store8(y + i, load8(y + i) + alpha * load8(x + i));
  for (int64_t i = vec_end; i < dim; ++i) y[i] += alpha * tokenmill_simd::to_float(x[i]);
}

// In place: s[0:n] = exp(s - max(s)); returns the sum, and the maximum in max_score.
inline float exp_shifted(float* s, int64_t n, float& max_score) {
  const float max_s = tokenmill_simd::max_of(s, n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t l = 0; l < n; ++l) {
    s[l] = tokenmill_simd::fast_exp(s[l] - max_s);
    sum += s[l];
  }
  max_score = max_s;
  return sum;
}

template <typename KV>
struct Problem {
  const float* q;  // [batch, n_heads, head_dim]
  const tokenmill_simd::bf16_t* q_bf16;  // the same queries where bf16 and the bf16 score pass is built, else null
  const KV* k_cache;  // [n_slots, n_kv_heads, head_dim]
  const KV* v_cache;
  const float* k_scale;  // [n_slots, n_kv_heads] for an int8 cache (else unused)
  const float* v_scale;
  float* out;  // like q
  const int32_t* table;  // req_to_token rows
  int64_t table_stride;
  const int64_t* rows;  // [batch]
  const int64_t* lens;  // [batch]
  int64_t n_heads, n_kv_heads, group, head_dim;
  int64_t window;  // keys per request: its last `window` (all of them when <= 0)
  float scale;
};

// The scale of a key or value of `slot`, KV head `head` (from `scales`: p.k_scale or p.v_scale) in an
// int8 cache; 1 in any other.
template <typename KV>
inline float slot_scale(const Problem<KV>& p, const float* scales, int64_t slot, int64_t head) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    return scales[slot * p.n_kv_heads + head];
  } else {
    return 1.f;
  }
}

// Ask for a slot's row of keys (or values) of the item's heads ahead of use, and for an int8 cache
// the line holding their scales too (one more stream the hardware prefetchers cannot follow).
template <typename KV>
inline void prefetch_slot(const KV* cache, const float* scales, const Problem<KV>& p, int64_t slot,
                          int64_t slot_stride, int64_t offset, int64_t row_bytes, int64_t kv_begin) {
  tokenmill_simd::prefetch_range(cache + slot * slot_stride + offset, row_bytes);
  if constexpr (std::is_same_v<KV, int8_t>) __builtin_prefetch(scales + slot * p.n_kv_heads + kv_begin, 0, 3);
}

// A request's keys in [begin, end): one chunk of its context.
struct Chunk {
  int64_t request, begin, end;
};

// Unnormalized outputs, row maxima and exp sums by chunk; only the chunks of requests with more
// than one are written: fp32 sums, ~H / (256 Hkv) of the bytes fp32 KV of those chunks would take.
struct Partials {
  std::vector<float> out;  // [chunk][n_heads][head_dim]
  std::vector<float> max, sum;  // [chunk][n_heads]
};

// The value pass of query rows [r, r + kRows) of KV head kv_begin + h (item-relative head h): out row
// r + i = sum over the chunk's keys l of s[(r + i) len + l] (times an int8 value's scale) times value
// l, summed in key order in registers and stored once. With `prefetch`, the value rows of all the
// item's heads are requested `ahead` slots in advance (later heads' passes find them in cache).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// (AVX2 alone: each vec16 as two 256-bit registers explicitly, the weight broadcast once; a vec16
// times a scalar would put the broadcast through the stack on every use. The same fmas in the same
// order.)
template <int64_t kHeadDim, int64_t kRows, typename KV>
inline void value_rows(const Problem<KV>& p, const int32_t* slots, int64_t len, const float* s, int64_t r, int64_t h,
                       int64_t kv_begin, int64_t offset, bool prefetch, int64_t ahead, int64_t row_bytes, float* out) {
  constexpr int64_t kHalves = kHeadDim / 8;
  const int64_t slot_stride = p.n_kv_heads * kHeadDim;
  __m256 acc[kRows][kHalves];
  for (int64_t j = 0; j < kRows; ++j) {
    for (int64_t i = 0; i < kHalves; ++i) acc[j][i] = _mm256_setzero_ps();
  }
  for (int64_t l = 0; l < len; ++l) {
    if (prefetch && l + ahead < len) {
      prefetch_slot(p.v_cache, p.v_scale, p, slots[l + ahead], slot_stride, offset, row_bytes, kv_begin);
    }
    const KV* values = p.v_cache + slots[l] * slot_stride + offset + h * kHeadDim;
    const float v_scale = slot_scale<KV>(p, p.v_scale, slots[l], kv_begin + h);
    __m256 weight[kRows];
    for (int64_t j = 0; j < kRows; ++j) weight[j] = _mm256_set1_ps(s[(r + j) * len + l] * v_scale);
    for (int64_t i = 0; i < kHalves; i += 2) {
      __m256 halves[2];
      tokenmill_simd::split16(load16(values + 8 * i), halves);
      for (int64_t j = 0; j < kRows; ++j) {
        acc[j][i] = _mm256_fmadd_ps(weight[j], halves[0], acc[j][i]);
        acc[j][i + 1] = _mm256_fmadd_ps(weight[j], halves[1], acc[j][i + 1]);
      }
    }
  }
  for (int64_t j = 0; j < kRows; ++j) {
    for (int64_t i = 0; i < kHalves; ++i) _mm256_storeu_ps(out + (r + j) * kHeadDim + 8 * i, acc[j][i]);
  }
}
#else
template <int64_t kHeadDim, int64_t kRows, typename KV>
inline void value_rows(const Problem<KV>& p, const int32_t* slots, int64_t len, const float* s, int64_t r, int64_t h,
                       int64_t kv_begin, int64_t offset, bool prefetch, int64_t ahead, int64_t row_bytes, float* out) {
  constexpr int64_t kVecs = kHeadDim / 16;
  const int64_t slot_stride = p.n_kv_heads * kHeadDim;
  vec16 acc[kRows][kVecs] = {};
  for (int64_t l = 0; l < len; ++l) {
    if (prefetch && l + ahead < len) {
      prefetch_slot(p.v_cache, p.v_scale, p, slots[l + ahead], slot_stride, offset, row_bytes, kv_begin);
    }
    const KV* values = p.v_cache + slots[l] * slot_stride + offset + h * kHeadDim;
    vec16 v[kVecs];
    for (int64_t i = 0; i < kVecs; ++i) v[i] = load16(values + 16 * i);
    const float v_scale = slot_scale<KV>(p, p.v_scale, slots[l], kv_begin + h);
    for (int64_t j = 0; j < kRows; ++j) {
      const float weight = s[(r + j) * len + l] * v_scale;
      for (int64_t i = 0; i < kVecs; ++i) acc[j][i] += weight * v[i];
    }
  }
  for (int64_t j = 0; j < kRows; ++j) {
    for (int64_t i = 0; i < kVecs; ++i) store16(out + (r + j) * kHeadDim + 16 * i, acc[j][i]);
  }
}

#endif

#if defined(__AVX512BF16__)
// The scores of query rows [r, r + group) (bf16 queries) against four bf16 keys of KV head h (in
// key_rows), scaled, into s[row * len + l ..]: vdpbf16ps, 32 exact products an instruction summed
// in fp32, then one reduction tree per four scores.
template <int64_t kHeadDim>
inline void score_four_bf16(const tokenmill_simd::bf16_t* const key_rows[4], const tokenmill_simd::bf16_t* queries,
                            int64_t h, int64_t r, int64_t group, float scale, float* s, int64_t len, int64_t l) {
  constexpr int64_t kSteps = kHeadDim / 32;
  __m512bh k[4][kSteps];
  for (int64_t j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < kSteps; ++i) k[j][i] = (__m512bh)_mm512_loadu_si512(key_rows[j] + h * kHeadDim + 32 * i);
  }
  for (int64_t g = 0; g < group; ++g, ++r) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < kSteps; ++i) {
      const __m512bh q = (__m512bh)_mm512_loadu_si512(queries + r * kHeadDim + 32 * i);
      for (int64_t j = 0; j < 4; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], q, k[j][i]);
    }
    vec16 sums[4];
    std::memcpy(sums, acc, sizeof(sums));
    const tokenmill_simd::vec4 scores = tokenmill_simd::horizontal_sum4(sums[0], sums[1], sums[2], sums[3]) * scale;
    std::memcpy(s + r * len + l, &scores, sizeof(scores));
  }
}
#endif

// Attention of one chunk's query heads of KV heads [kv_begin, kv_end). A request in one chunk
// gets its normalized output; otherwise the chunk's unnormalized output, score maximum and exp sum
// per query row go to `partials` (row c of them for chunk c) for merge_chunks.
template <int64_t kHeadDim, typename KV>
void attend(const Problem<KV>& p, const Chunk& chunk, int64_t c, bool whole, Partials& partials, int64_t kv_begin,
            int64_t kv_end, std::vector<float>& scores) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : p.head_dim;
  const int64_t b = chunk.request, len = chunk.end - chunk.begin;
  const int32_t* slots = p.table + p.rows[b] * p.table_stride + chunk.begin;
  const int64_t slot_stride = p.n_kv_heads * dim, offset = kv_begin * dim;
  const int64_t row_bytes = (kv_end - kv_begin) * dim * static_cast<int64_t>(sizeof(KV));
  const int64_t first_head = kv_begin * p.group, n_rows = (kv_end - kv_begin) * p.group;
  const float* queries = p.q + (b * p.n_heads + first_head) * dim;
  float* out = whole ? p.out + (b * p.n_heads + first_head) * dim
                     : partials.out.data() + (c * p.n_heads + first_head) * dim;
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  scores.resize(n_rows * len + n_rows);  // scores[r * len + l] for query row r and key l; then 1 / sums
  float* s = scores.data();
  float* inv_sum = s + n_rows * len;
  int64_t l = 0;
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // four keys at a time: one reduction tree per four scores
    constexpr int64_t kVecs = kHeadDim / 16;
    for (; l + 4 <= len; l += 4) {
      for (int64_t j = 0; j < 4 && l + ahead + j < len; ++j) {
        prefetch_slot(p.k_cache, p.k_scale, p, slots[l + ahead + j], slot_stride, offset, row_bytes, kv_begin);
      }
      const KV* key_rows[4];
      for (int64_t j = 0; j < 4; ++j) key_rows[j] = p.k_cache + slots[l + j] * slot_stride + offset;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<KV, tokenmill_simd::bf16_t> && kHeadDim % 32 == 0) {
        if (p.q_bf16 != nullptr) {
          const tokenmill_simd::bf16_t* q_bf16 = p.q_bf16 + (b * p.n_heads + first_head) * dim;
          for (int64_t h = 0; h < kv_end - kv_begin; ++h) {
            score_four_bf16<kHeadDim>(key_rows, q_bf16, h, h * p.group, p.group, p.scale, s, len, l);
          }
          continue;
        }
      }
#endif
      for (int64_t h = 0, r = 0; h < kv_end - kv_begin; ++h) {
        // bf16, int8 and fp8 keys of this head are widened once for the whole group where the four
        // fit in registers (head_dim 64); fp32 ones, and longer heads, are read directly
        constexpr bool kWiden = !std::is_same_v<KV, float> && kHeadDim <= 64;
        vec16 k[kWiden ? 4 : 1][kWiden ? kVecs : 1];
        if constexpr (kWiden) {
          for (int64_t j = 0; j < 4; ++j) {
            for (int64_t i = 0; i < kVecs; ++i) k[j][i] = load16(key_rows[j] + h * kHeadDim + 16 * i);
          }
        }
        for (int64_t g = 0; g < p.group; ++g, ++r) {
          const float* q = queries + r * kHeadDim;
          vec16 acc[4] = {};
          for (int64_t i = 0; i < kVecs; ++i) {
            const vec16 qi = load16(q + 16 * i);
            for (int64_t j = 0; j < 4; ++j) {
              if constexpr (kWiden) {
                acc[j] += qi * k[j][i];
              } else {
                acc[j] += qi * load16(key_rows[j] + h * kHeadDim + 16 * i);
              }
            }
          }
          const tokenmill_simd::vec4 sums = tokenmill_simd::horizontal_sum4(acc[0], acc[1], acc[2], acc[3]);
          if constexpr (std::is_same_v<KV, int8_t>) {
            for (int64_t j = 0; j < 4; ++j) {
              s[r * len + l + j] = sums[j] * p.scale * slot_scale<KV>(p, p.k_scale, slots[l + j], kv_begin + h);
            }
          } else {  // no per-slot scales: the four scores scaled and stored as one vector
            const tokenmill_simd::vec4 scores = sums * p.scale;
            std::memcpy(s + r * len + l, &scores, sizeof(scores));
          }
        }
      }
    }
  }
  for (; l < len; ++l) {
    if (l + ahead < len) {
      prefetch_slot(p.k_cache, p.k_scale, p, slots[l + ahead], slot_stride, offset, row_bytes, kv_begin);
    }
    const KV* keys = p.k_cache + slots[l] * slot_stride + offset;  // the keys after the last four
    for (int64_t r = 0; r < n_rows; ++r) {
      s[r * len + l] = dot<kHeadDim>(queries + r * dim, keys + (r / p.group) * dim, dim) * p.scale *
                       slot_scale<KV>(p, p.k_scale, slots[l], kv_begin + r / p.group);
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    float max_score;
    const float sum = exp_shifted(s + r * len, len, max_score);
    inv_sum[r] = whole ? 1.f / sum : 1.f;
    if (!whole) {
      partials.max[c * p.n_heads + first_head + r] = max_score;
      partials.sum[c * p.n_heads + first_head + r] = sum;
    }
  }
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    // per KV head, its query rows a few at a time, their outputs kept in registers over all the keys
#if defined(__AVX512F__)
    constexpr int64_t kRows = kHeadDim / 16 <= 4 ? 4 : 2;  // kRows x kHeadDim / 16 accumulators <= 16
#else
    constexpr int64_t kRows = kHeadDim <= 64 ? 2 : 1;  // AVX2: kRows x kHeadDim / 8 accumulators <= 16
#endif
    for (int64_t h = 0; h < kv_end - kv_begin; ++h) {
      for (int64_t g = 0; g < p.group; g += kRows) {
        const int64_t r = h * p.group + g;
        const bool prefetch = h == 0 && g == 0;  // the first pass brings the chunk's value rows in
        const auto pass = [&](auto rows) {  // rows: the number of query rows, a compile-time constant
          value_rows<kHeadDim, decltype(rows)::value>(p, slots, len, s, r, h, kv_begin, offset, prefetch, ahead,
                                                      row_bytes, out);
        };
        switch (std::min(kRows, p.group - g)) {
          case 1: pass(std::integral_constant<int64_t, 1>{}); break;
          case 2: pass(std::integral_constant<int64_t, 2>{}); break;
          case 3:
            if constexpr (kRows > 3) pass(std::integral_constant<int64_t, 3>{});  // never at kRows 2
            break;
          default: pass(std::integral_constant<int64_t, kRows>{});
        }
      }
    }
  } else {
    std::memset(out, 0, n_rows * dim * sizeof(float));
    for (int64_t l = 0; l < len; ++l) {
      if (l + ahead < len) {
        prefetch_slot(p.v_cache, p.v_scale, p, slots[l + ahead], slot_stride, offset, row_bytes, kv_begin);
      }
      const KV* values = p.v_cache + slots[l] * slot_stride + offset;
      for (int64_t r = 0; r < n_rows; ++r) {
        const float weight = s[r * len + l] * slot_scale<KV>(p, p.v_scale, slots[l], kv_begin + r / p.group);
        axpy<kHeadDim>(weight, values + (r / p.group) * dim, out + r * dim, dim);
      }
    }
  }
  if (whole) {
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] *= inv_sum[r];
    }
  }
}

// Request b's output from its chunks [first, first + n): each chunk's rows rescaled to the
// overall score maximum, summed in chunk order, divided by the rescaled exp sums.
template <typename KV>
void merge_chunks(const Problem<KV>& p, int64_t b, int64_t first, int64_t n, const Partials& partials) {
  const int64_t dim = p.head_dim;
  for (int64_t h = 0; h < p.n_heads; ++h) {
    float max_score = partials.max[first * p.n_heads + h];
    for (int64_t c = first + 1; c < first + n; ++c) max_score = std::max(max_score, partials.max[c * p.n_heads + h]);
    float total = 0.f;
    for (int64_t c = first; c < first + n; ++c) {
      total += std::exp(partials.max[c * p.n_heads + h] - max_score) * partials.sum[c * p.n_heads + h];
    }
    float* out = p.out + (b * p.n_heads + h) * dim;
    std::memset(out, 0, dim * sizeof(float));
    for (int64_t c = first; c < first + n; ++c) {
      const float weight = std::exp(partials.max[c * p.n_heads + h] - max_score) / total;
      const float* part = partials.out.data() + (c * p.n_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] += weight * part[d];
    }
  }
}

template <int64_t kHeadDim, typename KV>
void run(const Problem<KV>& p, int64_t batch) {
  // Requests' contexts in chunks of kChunkTokens keys (fixed, so that a request's result never
  // depends on the rest of the batch); a work item is one chunk and all its KV heads when there
  // are enough chunks to keep every thread busy, else one KV head of a chunk.
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    first_chunk[b] = static_cast<int64_t>(chunks.size());
    const int64_t first_key = p.window > 0 ? std::max<int64_t>(0, p.lens[b] - p.window) : 0;
    for (int64_t begin = first_key; begin < p.lens[b]; begin += kChunkTokens) {
      chunks.push_back({b, begin, std::min(p.lens[b], begin + kChunkTokens)});
    }
  }
  const int64_t n_chunks = first_chunk[batch] = static_cast<int64_t>(chunks.size());
  // Kept between calls (at the largest size seen): a fresh allocation's page faults cost ~10% at
  // 64 requests x 400 tokens.
  thread_local Partials calling_thread_partials;
  Partials& partials = calling_thread_partials;  // the workers must use the caller's, not their own
  if (n_chunks > batch) {
    partials.out.resize(n_chunks * p.n_heads * p.head_dim);
    partials.max.resize(n_chunks * p.n_heads);
    partials.sum.resize(n_chunks * p.n_heads);
  }
  const int64_t heads_per_item = n_chunks >= 2 * at::get_num_threads() ? p.n_kv_heads : 1;
  const int64_t items_per_chunk = p.n_kv_heads / heads_per_item;
  // items are taken one at a time from a shared counter: the threads finish together however the
  // chunks' lengths fall, and a descheduled thread holds up only the item it has
  const int64_t n_items = n_chunks * items_per_chunk;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;  // per-thread scratch
    for (int64_t item = next_item++; item < n_items; item = next_item++) {
      const int64_t c = item / items_per_chunk, kv_begin = (item % items_per_chunk) * heads_per_item;
      const Chunk& chunk = chunks[c];
      const bool whole = first_chunk[chunk.request + 1] - first_chunk[chunk.request] == 1;
      attend<kHeadDim>(p, chunk, c, whole, partials, kv_begin, kv_begin + heads_per_item, scores);
    }
  });
  if (n_chunks > batch) {
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n = first_chunk[b + 1] - first_chunk[b];
        if (n > 1) merge_chunks(p, b, first_chunk[b], n, partials);
      }
    });
  }
}

template <typename KV>
void run_for_head_dim(const Problem<KV>& p, int64_t batch) {
  switch (p.head_dim) {
    case 64: run<64>(p, batch); break;
    case 128: run<128>(p, batch); break;
    default: run<0>(p, batch);
  }
}

template <typename KV>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                double scale, int64_t window, const float* k_scale, const float* v_scale, at::Tensor& out,
                const tokenmill_simd::bf16_t* q_bf16 = nullptr) {
  const int64_t batch = q.size(0);
  Problem<KV> p{};
  p.n_heads = q.size(1);
  p.head_dim = q.size(2);
  p.n_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == p.head_dim && p.n_heads % p.n_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(req_pool_indices.numel() == batch && seq_lens.numel() == batch, "one row and length per request");
  p.group = p.n_heads / p.n_kv_heads;
  p.q = q.data_ptr<float>();
  p.q_bf16 = q_bf16;
  p.k_cache = static_cast<const KV*>(k_cache.data_ptr());
  p.v_cache = static_cast<const KV*>(v_cache.data_ptr());
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.out = out.data_ptr<float>();
  p.table = req_to_token.data_ptr<int32_t>();
  p.table_stride = req_to_token.stride(0);
  p.rows = req_pool_indices.data_ptr<int64_t>();
  p.lens = seq_lens.data_ptr<int64_t>();
  p.scale = static_cast<float>(scale);
  p.window = window;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(p.lens[b] >= 1 && p.lens[b] <= req_to_token.size(1), "seq_len out of range for request ", b);
    TORCH_CHECK(p.rows[b] >= 0 && p.rows[b] < req_to_token.size(0), "req_pool_index out of range for request ", b);
  }
  run_for_head_dim(p, batch);
}

}  // namespace

// q [B, H, D] fp32 or bf16; k_cache/v_cache [S, Hkv, D], both fp32, bf16, fp8 or int8 (then k_scale/v_scale
// [S, Hkv] fp32: a slot's values are the int8 ones times its scale); req_to_token [R, C] int32;
// req_pool_indices [B] and seq_lens [B] int64. Request b attends to slots
// req_to_token[req_pool_indices[b], 0:seq_lens[b]], or only the last `window` of them when window > 0 (a
// sliding window). The math is fp32; the output has q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad q/k/v ranks");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK((q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16) &&
                  v_cache.scalar_type() == kv_type &&
                  (kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kChar ||
                   kv_type == at::kFloat8_e4m3fn || kv_type == at::kFloat8_e5m2),
              "q fp32 or bf16; k/v caches both fp32, bf16, int8, fp8 e4m3fn or fp8 e5m2");
  const bool int8 = kv_type == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "scales come with an int8 cache only");
  if (int8) {
    for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 2 &&
                      s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1),
                  "k_scale/v_scale: contiguous fp32 [S, Hkv]");
    }
  }
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v caches must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 rows");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous(), "indices: contiguous int64");
  auto out = at::empty_like(q);
  if (kv_type == at::kFloat) {
    attend_all<float>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window, nullptr, nullptr,
                      out);
  } else if (kv_type == at::kBFloat16) {
    // bf16 queries as they are for the bf16 score pass where it is built (exact products either way)
    const at::Tensor q_bf16 = q_in.scalar_type() == at::kBFloat16 ? q_in.contiguous() : at::Tensor();
    const auto* q_pairs =
        kBf16Scores && q_bf16.defined() ? static_cast<const tokenmill_simd::bf16_t*>(q_bf16.data_ptr()) : nullptr;
    attend_all<tokenmill_simd::bf16_t>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window,
                                       nullptr, nullptr, out, q_pairs);
  } else if (kv_type == at::kFloat8_e4m3fn) {
    attend_all<tokenmill_simd::fp8_e4m3_t>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale,
                                           window, nullptr, nullptr, out);
  } else if (kv_type == at::kFloat8_e5m2) {
    attend_all<tokenmill_simd::fp8_e5m2_t>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale,
                                           window, nullptr, nullptr, out);
  } else {
    attend_all<int8_t>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window,
                       k_scale->data_ptr<float>(), v_scale->data_ptr<float>(), out);
  }
  return out.to(q_in.scalar_type());
}

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale, int window, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
