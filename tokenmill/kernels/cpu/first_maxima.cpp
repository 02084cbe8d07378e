// Greedy picks: each row's index of its first maximal entry, as torch's max(dim=-1) returns it
// (a NaN counts as the maximum: the first NaN's index; a row of -inf: 0), for fp32 or bf16 logits
// [rows, vocab]. Two passes over a row: its maximum (and whether it holds a NaN) in 8-wide vectors,
// then the first entry equal to it, 8 at a time, stopping at the chunk that holds it (torch's
// reduction with indices is slower on CPU, and a greedy step reads every logit of its rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "simd.h"

namespace {

using tokenmill_simd::bf16_t;
using tokenmill_simd::load8;
using tokenmill_simd::to_float;
using tokenmill_simd::vec8;

typedef int32_t i32x8 __attribute__((vector_size(32)));

inline bool any_lane(i32x8 mask) {
  for (int i = 0; i < 8; ++i) {
    if (mask[i]) return true;
  }
  return false;
}

template <typename T>
int64_t first_maximum(const T* row, int64_t n) {
  const int64_t vector_end = n - n % 8;
  vec8 best = vec8{} - std::numeric_limits<float>::infinity();
  i32x8 nan = i32x8{};
  for (int64_t i = 0; i < vector_end; i += 8) {
    const vec8 v = load8(row + i);
    nan |= v != v;
    best = v > best ? v : best;
  }
  float maximum = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < 8; ++i) maximum = std::max(maximum, best[i]);
  bool has_nan = any_lane(nan);
  for (int64_t i = vector_end; i < n; ++i) {
    const float x = to_float(row[i]);
    has_nan |= std::isnan(x);
    maximum = std::max(maximum, x);
  }
  for (int64_t i = 0; i < vector_end; i += 8) {
    const vec8 v = load8(row + i);
    const i32x8 hit = has_nan ? (v != v) : (v == maximum);
    if (!any_lane(hit)) continue;
    for (int j = 0; j < 8; ++j) {
      if (hit[j]) return i + j;
    }
  }
  for (int64_t i = vector_end; i < n; ++i) {
    const float x = to_float(row[i]);
    if (has_nan ? std::isnan(x) : x == maximum) return i;
  }
  return 0;  // unreachable: some entry equals the maximum (a row of -inf: its first)
}

template <typename T>
void run(const T* logits, int64_t rows, int64_t vocab, int64_t* out) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = first_maximum(logits + r * vocab, vocab);
  });
}

at::Tensor first_maxima(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "first_maxima: logits must be [rows, vocab > 0]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "first_maxima: fp32 or bf16 logits");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  } else {
    run(reinterpret_cast<const bf16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), x.size(1), out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("first_maxima(Tensor logits) -> Tensor");
  m.impl("first_maxima", c10::DispatchKey::CPU, &first_maxima);
}
