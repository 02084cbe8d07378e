// Paged decode attention for fp32 CPU tensors: one query token per request; keys and values are
// read in place from the token-slot KV storage through the request-to-token table (no gather
// copies, no padding to the longest request).
//
// A work item is one request and a range of its KV heads (all of them when the batch is large
// enough to keep every thread busy), so a key/value slot row is streamed once, front to back,
// and serves every query head of its GQA group. Scores are exact (two passes: scores and max,
// then exp and sum), the value pass accumulates in a per-thread buffer. GCC/Clang vector
// extensions give 8-wide loads/FMAs on any x86/ARM target; a scalar tail covers head_dim % 8.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float horizontal_sum(vec8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

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
            std::vector<float>& row_max, std::vector<float>& row_sum) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : p.head_dim;
  const int64_t len = p.lens[b];
  const int32_t* slots = p.table + p.rows[b] * p.table_stride;
  const int64_t slot_stride = p.n_kv_heads * dim;
  const int64_t first_head = kv_begin * p.group, n_rows = (kv_end - kv_begin) * p.group;
  const float* queries = p.q + (b * p.n_heads + first_head) * dim;
  float* out = p.out + (b * p.n_heads + first_head) * dim;
  scores.resize(len * n_rows);
  row_max.assign(n_rows, -std::numeric_limits<float>::infinity());
  row_sum.assign(n_rows, 0.f);
  for (int64_t l = 0; l < len; ++l) {  // scores[l * n_rows + r] for query row r
    const float* keys = p.k_cache + slots[l] * slot_stride + kv_begin * dim;
    float* s = scores.data() + l * n_rows;
    for (int64_t r = 0; r < n_rows; ++r) {
      s[r] = dot<kHeadDim>(queries + r * dim, keys + (r / p.group) * dim, dim) * p.scale;
      row_max[r] = std::max(row_max[r], s[r]);
    }
  }
  for (int64_t l = 0; l < len; ++l) {
    float* s = scores.data() + l * n_rows;
    for (int64_t r = 0; r < n_rows; ++r) {
      s[r] = std::exp(s[r] - row_max[r]);
      row_sum[r] += s[r];
    }
  }
  std::memset(out, 0, n_rows * dim * sizeof(float));
  for (int64_t l = 0; l < len; ++l) {
    const float* values = p.v_cache + slots[l] * slot_stride + kv_begin * dim;
    const float* s = scores.data() + l * n_rows;
    for (int64_t r = 0; r < n_rows; ++r) axpy<kHeadDim>(s[r], values + (r / p.group) * dim, out + r * dim, dim);
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const float inv = 1.f / row_sum[r];
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] *= inv;
  }
}

template <int64_t kHeadDim>
void run(const Problem& p, int64_t batch) {
  // Whole requests per work item when there are enough of them; else one KV head per item.
  const int64_t heads_per_item = batch >= 2 * at::get_num_threads() ? p.n_kv_heads : 1;
  const int64_t items_per_request = p.n_kv_heads / heads_per_item;
  at::parallel_for(0, batch * items_per_request, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_max, row_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_request, kv_begin = (item % items_per_request) * heads_per_item;
      attend<kHeadDim>(p, b, kv_begin, kv_begin + heads_per_item, scores, row_max, row_sum);
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
