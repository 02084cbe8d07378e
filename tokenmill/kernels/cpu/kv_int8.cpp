// The int8 KV cache's store and read (cache/kv_quant.py's format): each token's keys (values) of one
// KV head are int8 q times one fp32 scale = max|x| / 127, q = x / scale rounded to nearest even and
// clamped to [-127, 127] (0 with scale 0 for an all-zero head), exactly as kv_quant.quantize computes
// them; a read gathers slots and widens them, times their scale, to fp32 or bf16 (rounded once).
//   store_kv_int8_   k, v [T, Hkv, D] (fp32 or bf16) into slots [T] of the int8 caches [S, Hkv, D] and
//                    their scales [S, Hkv]
//   read_kv_int8     slots [N] of an int8 cache and its scales -> [N, Hkv, D] in the requested dtype
// Rows are split over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kRowGrain = 16;

using tokenmill_simd::bf16_t;
using tokenmill_simd::store_as;
using tokenmill_simd::to_float;

template <typename T>
void quantize_rows(const T* src, int8_t* dst, float* scales, const int64_t* slots, int64_t tokens, int64_t n_kv_heads,
                   int64_t head_dim) {
  at::parallel_for(0, tokens * n_kv_heads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / n_kv_heads, h = row % n_kv_heads;
      const T* x = src + row * head_dim;
      float amax = 0.f;
      for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
      const float scale = amax / 127.f, safe = scale > 0.f ? scale : 1.f;
      int8_t* q = dst + (slots[t] * n_kv_heads + h) * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) {  // |x / safe| <= 127: the 1.5 * 2^23 trick rounds to nearest even
        const float rounded = (to_float(x[i]) / safe + 12582912.f) - 12582912.f;
        q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, rounded)));
      }
      scales[slots[t] * n_kv_heads + h] = scale;
    }
  });
}

template <typename T>
void dequantize_rows(const int8_t* cache, const float* scales, const int64_t* slots, T* out, int64_t n,
                     int64_t n_kv_heads, int64_t head_dim) {
  at::parallel_for(0, n * n_kv_heads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t slot_row = slots[row / n_kv_heads] * n_kv_heads + row % n_kv_heads;
      const int8_t* q = cache + slot_row * head_dim;
      const float scale = scales[slot_row];
      T* o = out + row * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) store_as(o + i, static_cast<float>(q[i]) * scale);
    }
  });
}

void check_cache(const at::Tensor& cache, const at::Tensor& scales) {
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 3 && cache.is_contiguous(),
              "the cache must be a contiguous int8 [S, Hkv, D] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == cache.size(0) * cache.size(1), "its scales must be contiguous fp32 [S, Hkv]");
}

void check_slots(const at::Tensor& slots, int64_t n, int64_t n_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots: contiguous int64, one per row");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < n_slots, "cache slot out of range");
}

}  // namespace

void store_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& slots) {
  check_cache(k_cache, k_scale);
  check_cache(v_cache, v_scale);
  const int64_t tokens = k.size(0), n_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK((x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16) && x->is_contiguous() &&
                    x->dim() == 3 && x->size(0) == tokens && x->size(1) == n_kv_heads && x->size(2) == head_dim,
                "k/v must be contiguous fp32 or bf16 [T, Hkv, D] matching the cache");
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k/v caches differ in shape");
  check_slots(slots, tokens, k_cache.size(0));
  const int64_t* s = slots.data_ptr<int64_t>();
  for (auto [x, cache, scales] : {std::tuple{&k, &k_cache, &k_scale}, std::tuple{&v, &v_cache, &v_scale}}) {
    if (x->scalar_type() == at::kFloat) {
      quantize_rows(x->data_ptr<float>(), cache->data_ptr<int8_t>(), scales->data_ptr<float>(), s, tokens, n_kv_heads,
                    head_dim);
    } else {
      quantize_rows(static_cast<const bf16_t*>(x->data_ptr()), cache->data_ptr<int8_t>(), scales->data_ptr<float>(), s,
                    tokens, n_kv_heads, head_dim);
    }
  }
}

void store_kv_int8_(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale,
                    at::Tensor v_scale, const at::Tensor& slots) {
  store_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, slots);
}

at::Tensor read_kv_int8(const at::Tensor& cache, const at::Tensor& scales, const at::Tensor& slots, bool bf16) {
  check_cache(cache, scales);
  check_slots(slots, slots.numel(), cache.size(0));
  const int64_t n = slots.numel(), n_kv_heads = cache.size(1), head_dim = cache.size(2);
  auto out = at::empty({n, n_kv_heads, head_dim}, cache.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t* s = slots.data_ptr<int64_t>();
  if (bf16) {
    dequantize_rows(cache.data_ptr<int8_t>(), scales.data_ptr<float>(), s, static_cast<bf16_t*>(out.data_ptr()), n,
                    n_kv_heads, head_dim);
  } else {
    dequantize_rows(cache.data_ptr<int8_t>(), scales.data_ptr<float>(), s, out.data_ptr<float>(), n, n_kv_heads,
                    head_dim);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("store_kv_int8_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slots) -> ()");
  m.def("read_kv_int8(Tensor cache, Tensor scales, Tensor slots, bool bf16) -> Tensor");
  m.impl("store_kv_int8_", c10::DispatchKey::CPU, &store_kv_int8_);
  m.impl("read_kv_int8", c10::DispatchKey::CPU, &read_kv_int8);
}
