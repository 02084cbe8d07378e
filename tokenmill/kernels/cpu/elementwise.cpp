// Fused row-wise kernels for CPU tensors, each replacing a chain of small torch ops (and their
// intermediate tensors) in a decoder layer; fp32 or bf16 in and out (bf16: math in fp32, each
// result rounded to nearest even once):
//   rms_norm          out = weight * x / sqrt(mean(x^2) + eps)
//   add_rms_norm      residual += x (in place); out = rms_norm(residual)
//   silu_and_mul      [T, 2I] -> [T, I]: silu(gate) * up
//   rotary_split_qkv  fused qkv rows [T, (H + 2 Hkv) D] -> contiguous q, k (rotate_half RoPE) and v
//   rotary_store_kv   the same, with k and v written to their KV-cache slots (decode_forward.cpp); an int8
//                     cache's through kv_int8.cpp, an fp8 cache's through kv_fp8.cpp
//   causal_softmax_   in place over fp32 or bf16 attention scores: scale, causal (and sliding-window) mask, softmax
// Rows are split over torch's intra-op threads. Loops are written for the compiler to vectorize
// (exp is a polynomial, so silu vectorizes too).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kRowGrain = 8;

using tokenmill_simd::bf16_t;
using tokenmill_simd::fast_exp;
using tokenmill_simd::load16;
using tokenmill_simd::softmax_in_place;
using tokenmill_simd::store16;
using tokenmill_simd::store_as;
using tokenmill_simd::to_float;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.dim() == 2 &&
                  t.is_contiguous(), name, " must be a contiguous 2-d fp32 or bf16 tensor");
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of the rows it goes with");
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// body(T{}) with T = float or bf16_t by the dtype of `t` (a generic lambda takes the element type
// from its argument: `using T = decltype(tag);`).
template <typename Body>
auto dispatch(const at::Tensor& t, Body body) {
  return t.scalar_type() == at::kFloat ? body(float{}) : body(bf16_t{});
}

// out = weight * (x * inv_rms); for bf16 as torch's bf16 ops round: the normalized row, then the product.
template <typename T>
inline void normalize_row(const T* x, const T* weight, T* out, int64_t dim, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < dim; ++i) sum_sq += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    T normalized;
    store_as(&normalized, to_float(x[i]) * inv);
    store_as(out + i, to_float(weight[i]) * to_float(normalized));
  }
}

// One token of fused qkv [(H + 2 Hkv) D]: rotate_half RoPE of its H query heads into q_out [H, D]
// and of its Hkv key heads into k_out [Hkv, D]; its values copied to v_out [Hkv, D].
template <typename T>
void rotate_token(const T* row, const T* c, const T* s, T* q_out, T* k_out, T* v_out, int64_t n_heads,
                  int64_t n_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads + n_kv_heads; ++h) {
    const T* x = row + h * head_dim;
    T* o = h < n_heads ? q_out + h * head_dim : k_out + (h - n_heads) * head_dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = to_float(x[i]), hi = to_float(x[i + half]);
      store_as(o + i, lo * to_float(c[i]) - hi * to_float(s[i]));
      store_as(o + i + half, hi * to_float(c[i + half]) + lo * to_float(s[i + half]));
    }
  }
  std::memcpy(v_out, row + (n_heads + n_kv_heads) * head_dim, n_kv_heads * head_dim * sizeof(T));
}

void check_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  check_same_dtype(cos, qkv, "cos");
  check_same_dtype(sin, qkv, "sin");
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (n_heads + 2 * n_kv_heads) * head_dim,
              "qkv must be [T, (H + 2 Hkv) * D] with even D");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes(), "cos/sin: [T, D]");
}

// Every token t of qkv rotated into q [T, H, D] (returned), its keys and values into row
// kv_row(t) of k_dst / v_dst ([rows, Hkv, D] buffers).
template <typename T, typename KvRow>
at::Tensor rotate_tokens(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, T* k_dst, T* v_dst,
                         KvRow kv_row, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), q_width = n_heads * head_dim;
  const int64_t kv_width = n_kv_heads * head_dim;
  auto q = at::empty({tokens, n_heads, head_dim}, qkv.options());
  const T* src = ptr<T>(qkv);
  const T* cos_ptr = ptr<T>(cos);
  const T* sin_ptr = ptr<T>(sin);
  T* q_ptr = ptr<T>(q);
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_token(src + t * width, cos_ptr + t * head_dim, sin_ptr + t * head_dim, q_ptr + t * q_width,
                   k_dst + kv_row(t) * kv_width, v_dst + kv_row(t) * kv_width, n_heads, n_kv_heads, head_dim);
    }
  });
  return q;
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  auto out = at::empty_like(x);
  const int64_t dim = x.size(1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    const T* w = ptr<T>(weight);
    T* dst = ptr<T>(out);
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        normalize_row(src + t * dim, w, dst + t * dim, dim, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_same_dtype(residual, x, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  check_weight(weight, x);
  auto out = at::empty_like(x);
  const int64_t dim = x.size(1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    T* res = ptr<T>(residual);
    const T* w = ptr<T>(weight);
    T* dst = ptr<T>(out);
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        T* r = res + t * dim;
        const T* s = src + t * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) store_as(r + i, to_float(r[i]) + to_float(s[i]));
        normalize_row(r, w, dst + t * dim, dim, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t half = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), half}, gate_up.options());
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(gate_up);
    T* dst = ptr<T>(out);
    at::parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = src + t * 2 * half;
        const T* up = gate + half;
        T* o = dst + t * half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float g = to_float(gate[i]);
          T silu;  // rounded as torch's bf16 silu is, before the product
          store_as(&silu, g / (1.f + fast_exp(-g)));
          store_as(o + i, to_float(silu) * to_float(up[i]));
        }
      }
    });
  });
  return out;
}

// qkv [T, (H + 2 Hkv) * D] (fused projection rows); cos/sin [T, D] in the rotate_half layout.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                               const at::Tensor& sin, int64_t n_heads,
                                                               int64_t n_kv_heads, int64_t head_dim) {
  check_qkv(qkv, cos, sin, n_heads, n_kv_heads, head_dim);
  auto k = at::empty({qkv.size(0), n_kv_heads, head_dim}, qkv.options());
  auto v = at::empty_like(k);
  auto q = dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    return rotate_tokens(qkv, cos, sin, ptr<T>(k), ptr<T>(v), [](int64_t t) { return t; }, n_heads, n_kv_heads,
                         head_dim);
  });
  return {q, k, v};
}

// As rotary_split_qkv, but token t's keys and values go straight to the cache slot
// out_cache_loc[t] of k_cache/v_cache [S, Hkv, D] (what the attention backend's store does): in qkv's
// dtype, or int8 with their scales into k_scale/v_scale [S, Hkv] (kv_quant's format); returns q [T, H, D].
at::Tensor rotary_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& out_cache_loc, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale) {
  check_qkv(qkv, cos, sin, n_heads, n_kv_heads, head_dim);
  const int64_t n_slots = k_cache.size(0);
  const auto cache_type = k_cache.scalar_type();
  const bool int8 = cache_type == at::kChar;
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  const auto kv_type = int8 || fp8 ? cache_type : qkv.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == kv_type && v_cache.scalar_type() == kv_type && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.numel() == n_slots * n_kv_heads * head_dim,
              "k_cache/v_cache must be contiguous [S, Hkv, D] in qkv's dtype, int8 or fp8");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "scales come with an int8 cache only");
  if (int8) {
    for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == n_slots * n_kv_heads,
                  "k_scale/v_scale: contiguous fp32 [S, Hkv]");
    }
  }
  TORCH_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.is_contiguous() &&
                  out_cache_loc.numel() == qkv.size(0), "out_cache_loc: contiguous int64, one slot per token");
  const int64_t* slots = out_cache_loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < n_slots, "cache slot out of range");
  if (int8) {
    auto [q, k, v] = rotary_split_qkv(qkv, cos, sin, n_heads, n_kv_heads, head_dim);
    at::Tensor k_scales = *k_scale, v_scales = *v_scale;  // handles to the caller's tensors
    store_kv_int8(k, v, k_cache, v_cache, k_scales, v_scales, out_cache_loc);
    return q;
  }
  if (fp8) {
    auto [q, k, v] = rotary_split_qkv(qkv, cos, sin, n_heads, n_kv_heads, head_dim);
    store_kv_fp8(k, v, k_cache, v_cache, out_cache_loc);
    return q;
  }
  return dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    return rotate_tokens(qkv, cos, sin, ptr<T>(k_cache), ptr<T>(v_cache), [slots](int64_t t) { return slots[t]; },
                         n_heads, n_kv_heads, head_dim);
  });
}

// scores [B, n, S]: row r of a block is the query at position first_pos + r over keys 0 .. S - 1; it keeps
// keys first_pos + r - window < k <= first_pos + r (every k <= first_pos + r when window <= 0), the rest
// become exactly 0; the kept ones get softmax(scale * s). bf16 scores are read as fp32 and the fp32
// probabilities rounded to bf16 once: the same bits as converting to fp32, this kernel, and back.
void causal_softmax_(at::Tensor scores, int64_t first_pos, double scale, int64_t window) {
  TORCH_CHECK((scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16) && scores.dim() == 3 &&
                  scores.is_contiguous(), "scores must be a contiguous [B, n, S] fp32 or bf16 tensor");
  const int64_t n = scores.size(1), keys = scores.size(2);
  TORCH_CHECK(first_pos >= 0 && first_pos + n <= keys, "query positions must lie within the keys");
  const float factor = static_cast<float>(scale);
  dispatch(scores, [&](auto tag) {
    using T = decltype(tag);
    constexpr bool kFloat = std::is_same_v<T, float>;
    T* base = ptr<T>(scores);
    at::parallel_for(0, scores.size(0) * n, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(kFloat ? 0 : keys);  // a bf16 row's values in fp32 until rounded once
      for (int64_t row = begin; row < end; ++row) {
        T* s = base + row * keys;
        const int64_t visible = first_pos + row % n + 1;
        const int64_t first_key = window > 0 ? std::max<int64_t>(0, visible - window) : 0;
        if constexpr (kFloat) {
          softmax_in_place(s, first_key, visible, factor);
        } else {
          float* e = widened.data();
          int64_t j = first_key;
          for (; j + 16 <= visible; j += 16) store16(e + j, load16(s + j));
          for (; j < visible; ++j) e[j] = to_float(s[j]);
          softmax_in_place(e, first_key, visible, factor);
          for (j = first_key; j + 16 <= visible; j += 16) store16(s + j, load16(e + j));
          for (; j < visible; ++j) store_as(s + j, e[j]);
        }
        std::memset(s, 0, first_key * sizeof(T));
        std::memset(s + visible, 0, (keys - visible) * sizeof(T));
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_split_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_heads, int n_kv_heads, int head_dim) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("causal_softmax_(Tensor(a!) scores, int first_pos, float scale, int window) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary_split_qkv", c10::DispatchKey::CPU, &rotary_split_qkv);
  m.impl("causal_softmax_", c10::DispatchKey::CPU, &causal_softmax_);
}
