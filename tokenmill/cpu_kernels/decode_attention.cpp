// Paged decode attention for fp32 CPU tensors: one query token per request; keys and values are
// read in place from the token-slot KV storage through the request-to-token table (no gather
// copies, no padding to the longest request).
//
// A work item is one request and a range of its KV heads (all of them when the batch is large
// enough to keep every thread busy), so a key/value slot row is streamed once, front to back,
// and serves every query head of its GQA group. Slot rows are prefetched a few slots ahead: the
// request-to-token indirection hides the access pattern from the hardware prefetchers, and
// decode-time slots of concurrent requests interleave. Scores are exact (a score pass, then a
// vectorized max/exp/sum per query row, then the value pass into the output rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using tokenmill_simd::horizontal_sum;
using tokenmill_simd::load8;
using tokenmill_simd::store8;
using tokenmill_simd::vec8;

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the slot row in use to prefetch

// kHeadDim > 0 fixes head_dim at compile time (unrolled loops); 0 reads it at run time.
template <int64_t kHeadDim>
inline float dot(const float* a, const float* b, int64_t n) {
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
  for (i = vec_end; i < dim; ++i) s += a[i] * b[i];
  return s;
}

template <int64_t kHeadDim>
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : n;
  const int64_t vec_end = dim - dim % 8;
  for (int64_t i = 0; i < vec_end; i += 8) store8(y + i, load8(y + i) + alpha * load8(x + i));
  for (int64_t i = vec_end; i < dim; ++i) y[i] += alpha * x[i];
}

// In place: s[0:n] = exp(s - max(s)); returns the sum.
inline float exp_shifted(float* s, int64_t n) {
  float max_score = s[0];
#pragma omp simd reduction(max : max_score)
  for (int64_t l = 0; l < n; ++l) max_score = std::max(max_score, s[l]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t l = 0; l < n; ++l) {
    s[l] = tokenmill_simd::fast_exp(s[l] - max_score);
    sum += s[l];
  }
  return sum;
}

struct Problem {
  const float* q;  // [batch, n_heads, head_dim]
  const float* k_cache;  // [n_slots, n_kv_heads, head_dim]
  const float* v_cache;
  float* out;  // like q
  const int32_t* table;  // req_to_token rows
  int64_t table_stride;
  const int64_t* rows;  // [batch]
  const int64_t* lens;  // [batch]
  int64_t n_heads, n_kv_heads, group, head_dim;
  float scale;
};

// Attention of request b's query heads of KV heads [kv_begin, kv_end) over its whole context.
template <int64_t kHeadDim>
void attend(const Problem& p, int64_t b, int64_t kv_begin, int64_t kv_end, std::vector<float>& scores,
            std::vector<float>& inv_sum) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : p.head_dim;
  const int64_t len = p.lens[b];
  const int32_t* slots = p.table + p.rows[b] * p.table_stride;
  const int64_t slot_stride = p.n_kv_heads * dim, offset = kv_begin * dim;
  const int64_t row_bytes = (kv_end - kv_begin) * dim * static_cast<int64_t>(sizeof(float));
  const int64_t first_head = kv_begin * p.group, n_rows = (kv_end - kv_begin) * p.group;
  const float* queries = p.q + (b * p.n_heads + first_head) * dim;
  float* out = p.out + (b * p.n_heads + first_head) * dim;
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  scores.resize(n_rows * len);  // scores[r * len + l] for query row r and key l
  float* s = scores.data();
  for (int64_t l = 0; l < len; ++l) {
    if (l + ahead < len) {
      tokenmill_simd::prefetch_range(p.k_cache + slots[l + ahead] * slot_stride + offset, row_bytes);
    }
    const float* keys = p.k_cache + slots[l] * slot_stride + offset;
    for (int64_t r = 0; r < n_rows; ++r) {
      s[r * len + l] = dot<kHeadDim>(queries + r * dim, keys + (r / p.group) * dim, dim) * p.scale;
    }
  }
  inv_sum.resize(n_rows);
  for (int64_t r = 0; r < n_rows; ++r) inv_sum[r] = 1.f / exp_shifted(s + r * len, len);
  std::memset(out, 0, n_rows * dim * sizeof(float));
  for (int64_t l = 0; l < len; ++l) {
    if (l + ahead < len) {
      tokenmill_simd::prefetch_range(p.v_cache + slots[l + ahead] * slot_stride + offset, row_bytes);
    }
    const float* values = p.v_cache + slots[l] * slot_stride + offset;
    for (int64_t r = 0; r < n_rows; ++r) axpy<kHeadDim>(s[r * len + l], values + (r / p.group) * dim, out + r * dim, dim);
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] *= inv_sum[r];
  }
}

template <int64_t kHeadDim>
void run(const Problem& p, int64_t batch) {
  // Whole requests per work item when there are enough of them; else one KV head per item.
  const int64_t heads_per_item = batch >= 2 * at::get_num_threads() ? p.n_kv_heads : 1;
  const int64_t items_per_request = p.n_kv_heads / heads_per_item;
  at::parallel_for(0, batch * items_per_request, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv_sum;  // per-thread scratch
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_request, kv_begin = (item % items_per_request) * heads_per_item;
      attend<kHeadDim>(p, b, kv_begin, kv_begin + heads_per_item, scores, inv_sum);
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache/v_cache [S, Hkv, D]; req_to_token [R, C] int32; req_pool_indices [B] and
// seq_lens [B] int64. Request b attends to slots req_to_token[req_pool_indices[b], 0:seq_lens[b]].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad q/k/v ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "q/k/v must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 rows");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous(), "indices: contiguous int64");
  const int64_t batch = q.size(0);
  Problem p{};
  p.n_heads = q.size(1);
  p.head_dim = q.size(2);
  p.n_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == p.head_dim && p.n_heads % p.n_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(req_pool_indices.numel() == batch && seq_lens.numel() == batch, "one row and length per request");
  p.group = p.n_heads / p.n_kv_heads;
  auto out = at::empty_like(q);
  p.q = q.data_ptr<float>();
  p.k_cache = k_cache.data_ptr<float>();
  p.v_cache = v_cache.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.table = req_to_token.data_ptr<int32_t>();
  p.table_stride = req_to_token.stride(0);
  p.rows = req_pool_indices.data_ptr<int64_t>();
  p.lens = seq_lens.data_ptr<int64_t>();
  p.scale = static_cast<float>(scale);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(p.lens[b] >= 1 && p.lens[b] <= req_to_token.size(1), "seq_len out of range for request ", b);
    TORCH_CHECK(p.rows[b] >= 0 && p.rows[b] < req_to_token.size(0), "req_pool_index out of range for request ", b);
  }
  switch (p.head_dim) {
    case 64: run<64>(p, batch); break;
    case 128: run<128>(p, batch); break;
    default: run<0>(p, batch);
  }
  return out;
}

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
