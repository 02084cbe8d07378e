// The fp8 KV cache's store and read (cache/kv_fp8.py's format): keys and values as OCP fp8 bytes,
// e4m3fn or e5m2, with the format's fixed scale 1. A value is clamped to the format's largest finite
// magnitude (448 or 57344; a NaN stays NaN) and rounded to nearest even by c10's conversion, the one
// torch's .to(float8) uses, so out-of-range values saturate, never becoming inf; a read gathers
// slots and widens them to fp32 or bf16 (exact: every fp8 value is a bf16 value).
//   store_kv_fp8_  k, v [T, Hkv, D] (fp32 or bf16) into slots [T] of the fp8 caches [S, Hkv, D]
//   read_kv_fp8    slots [N] of an fp8 cache -> [N, Hkv, D] in the requested dtype
// Rows are split over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kRowGrain = 4;

using tokenmill_simd::bf16_t;
using tokenmill_simd::fp8_e4m3_t;
using tokenmill_simd::fp8_e5m2_t;
using tokenmill_simd::store_as;
using tokenmill_simd::to_float;

// The largest finite value of a format (the clamp of a store).
template <typename Fp8>
constexpr float kMaxFinite = std::is_same_v<Fp8, c10::Float8_e4m3fn> ? 448.f : 57344.f;

bool is_fp8(at::ScalarType type) { return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2; }

// Token t's row [Hkv * D] of src into cache row slots[t], clamped and converted.
template <typename Fp8, typename T>
void convert_rows(const T* src, Fp8* dst, const int64_t* slots, int64_t tokens, int64_t row) {
  constexpr float kMax = kMaxFinite<Fp8>;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = src + t * row;
      Fp8* q = dst + slots[t] * row;
      for (int64_t i = 0; i < row; ++i) {
        const float f = to_float(x[i]);
        q[i] = Fp8(f > kMax ? kMax : f < -kMax ? -kMax : f);  // comparisons with NaN fail: it stays NaN
      }
    }
  });
}

// Cache rows slots[r] ([Hkv * D] each, the raw bytes of format Raw) widened into out's row r.
template <typename Raw, typename T>
void widen_rows(const Raw* cache, const int64_t* slots, T* out, int64_t n, int64_t row) {
  at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Raw* q = cache + slots[r] * row;
      T* o = out + r * row;
      int64_t i = 0;
      for (; i + 8 <= row; i += 8) {
        const tokenmill_simd::vec8 v = tokenmill_simd::load8(q + i);
        for (int j = 0; j < 8; ++j) store_as(o + i + j, v[j]);
      }
      for (; i < row; ++i) store_as(o + i, to_float(q[i]));
    }
  });
}

void check_cache(const at::Tensor& cache) {
  TORCH_CHECK(is_fp8(cache.scalar_type()) && cache.dim() == 3 && cache.is_contiguous(),
              "the cache must be a contiguous fp8 (e4m3fn or e5m2) [S, Hkv, D] tensor");
}

void check_slots(const at::Tensor& slots, int64_t n, int64_t n_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots: contiguous int64, one per row");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < n_slots, "cache slot out of range");
}

template <typename Fp8>
void store_one(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t row = cache.size(1) * cache.size(2);
  Fp8* dst = static_cast<Fp8*>(cache.data_ptr());
  if (x.scalar_type() == at::kFloat) {
    convert_rows(x.data_ptr<float>(), dst, slots, x.size(0), row);
  } else {
    convert_rows(static_cast<const bf16_t*>(x.data_ptr()), dst, slots, x.size(0), row);
  }
}

template <typename Raw, typename T>
void read_as(const at::Tensor& cache, const int64_t* slots, at::Tensor& out) {
  widen_rows(static_cast<const Raw*>(cache.data_ptr()), slots, static_cast<T*>(out.data_ptr()), out.size(0),
             cache.size(1) * cache.size(2));
}

}  // namespace

void store_kv_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slots) {
  check_cache(k_cache);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "k/v caches differ in dtype or shape");
  const int64_t tokens = k.size(0);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK((x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16) && x->is_contiguous() &&
                    x->dim() == 3 && x->size(0) == tokens && x->size(1) == k_cache.size(1) &&
                    x->size(2) == k_cache.size(2),
                "k/v must be contiguous fp32 or bf16 [T, Hkv, D] matching the cache");
  }
  check_slots(slots, tokens, k_cache.size(0));
  const int64_t* s = slots.data_ptr<int64_t>();
  for (auto [x, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
    if (cache->scalar_type() == at::kFloat8_e4m3fn) {
      store_one<c10::Float8_e4m3fn>(*x, *cache, s);
    } else {
      store_one<c10::Float8_e5m2>(*x, *cache, s);
    }
  }
}

void store_kv_fp8_(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slots) {
  store_kv_fp8(k, v, k_cache, v_cache, slots);
}

at::Tensor read_kv_fp8(const at::Tensor& cache, const at::Tensor& slots, bool bf16) {
  check_cache(cache);
  check_slots(slots, slots.numel(), cache.size(0));
  auto out = at::empty({slots.numel(), cache.size(1), cache.size(2)},
                       cache.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t* s = slots.data_ptr<int64_t>();
  const bool e4m3 = cache.scalar_type() == at::kFloat8_e4m3fn;
  if (e4m3 && bf16) {
    read_as<fp8_e4m3_t, bf16_t>(cache, s, out);
  } else if (e4m3) {
    read_as<fp8_e4m3_t, float>(cache, s, out);
  } else if (bf16) {
    read_as<fp8_e5m2_t, bf16_t>(cache, s, out);
  } else {
    read_as<fp8_e5m2_t, float>(cache, s, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("store_kv_fp8_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("read_kv_fp8(Tensor cache, Tensor slots, bool bf16) -> Tensor");
  m.impl("store_kv_fp8_", c10::DispatchKey::CPU, &store_kv_fp8_);
  m.impl("read_kv_fp8", c10::DispatchKey::CPU, &read_kv_fp8);
}
