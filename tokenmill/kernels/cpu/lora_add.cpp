// LoRA deltas of a step's rows in one call per projection (kernels/lora.py's layout): rows sorted by
// adapter slot (order, bounds, slots), each slot's matrices streamed once for all its rows.
//   shrink: y[i, q] = x[order[i]] . a[slot, q]          (q < J*R: every segment's ranks)
//   expand: out[order[i], c] += sum_r y[i, j*R + r] * b[slot, r, c]   (c in segment j's columns)
// fp32 sums, fp32 or bf16 operands (out rounded once per element, as torch's bf16 ops round). Threads
// split (slot, a-row) pairs for the shrink and (slot, 64-column block) pairs for the expand, so a
// decode batch of a few rows per adapter still uses every thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using tokenmill_simd::bf16_t;
using tokenmill_simd::horizontal_sum;
using tokenmill_simd::load8;
using tokenmill_simd::store_as;
using tokenmill_simd::to_float;
using tokenmill_simd::vec8;

constexpr int64_t kColumnBlock = 64;

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  const int64_t vec_end = n - n % 8;
  vec8 acc0 = {}, acc1 = {};
  int64_t k = 0;
  for (; k + 16 <= vec_end; k += 16) {
    acc0 += load8(a + k) * load8(b + k);
    acc1 += load8(a + k + 8) * load8(b + k + 8);
  }
  for (; k < vec_end; k += 8) acc0 += load8(a + k) * load8(b + k);
  float s = horizontal_sum(acc0 + acc1);
  for (; k < n; ++k) s += to_float(a[k]) * to_float(b[k]);
  return s;
}

template <typename T>
void lora_add_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const int64_t* order, const std::vector<int64_t>& bounds, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& seg_bounds) {
  const int64_t in_dim = x.size(1), out_dim = out.size(1);
  const int64_t n_groups = static_cast<int64_t>(slots.size());
  const int64_t n_ranks = a.size(1), rank = b.size(1), n_segments = n_ranks / rank;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* ap = reinterpret_cast<const T*>(a.data_ptr());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t n_rows = bounds.back();
  std::vector<float> y(static_cast<size_t>(n_rows * n_ranks));

  at::parallel_for(0, n_groups * n_ranks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / n_ranks, q = item % n_ranks;
      const T* a_row = ap + (slots[g] * n_ranks + q) * in_dim;
      for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) y[i * n_ranks + q] = dot(xp + order[i] * in_dim, a_row, in_dim);
    }
  });

  const int64_t n_blocks = (out_dim + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, n_groups * n_blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kColumnBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / n_blocks, c0 = (item % n_blocks) * kColumnBlock;
      const int64_t c1 = std::min(c0 + kColumnBlock, out_dim);
      const T* b_slot = bp + slots[g] * rank * out_dim;
      for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) {
        for (int64_t c = c0; c < c1; ++c) acc[c - c0] = 0.0f;
        for (int64_t j = 0; j < n_segments; ++j) {  // the segments' columns that fall in this block
          const int64_t s0 = std::max(c0, seg_bounds[j]), s1 = std::min(c1, seg_bounds[j + 1]);
          if (s0 >= s1) continue;
          const float* yr = y.data() + i * n_ranks + j * rank;
          for (int64_t r = 0; r < rank; ++r) {
            const float coef = yr[r];
            if (coef == 0.0f) continue;
            const T* b_row = b_slot + r * out_dim;
            for (int64_t c = s0; c < s1; ++c) acc[c - c0] += coef * to_float(b_row[c]);
          }
        }
        T* o = op + order[i] * out_dim;
        for (int64_t c = c0; c < c1; ++c) store_as(o + c, to_float(o[c]) + acc[c - c0]);
      }
    }
  });
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1, "index tensors must be 1-d int64");
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& order,
              const at::Tensor& bounds, const at::Tensor& slots, const at::Tensor& seg_bounds) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3, "x, out [T, *]; a, b [S, *, *]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "operands must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && a.scalar_type() == dtype && b.scalar_type() == dtype,
              "x, out, a and b must share one dtype");
  TORCH_CHECK(a.size(2) == x.size(1) && b.size(2) == out.size(1) && x.size(0) == out.size(0) &&
                  a.size(0) == b.size(0) && a.size(1) % b.size(1) == 0,
              "shapes disagree: a [S, J*R, in], b [S, R, out]");
  const std::vector<int64_t> bound_v = to_vector(bounds), slot_v = to_vector(slots), seg_v = to_vector(seg_bounds);
  TORCH_CHECK(bound_v.size() == slot_v.size() + 1 && bound_v.front() == 0 && bound_v.back() == order.numel(),
              "bounds must cover order");
  TORCH_CHECK(std::is_sorted(bound_v.begin(), bound_v.end()), "bounds must not decrease");
  TORCH_CHECK(static_cast<int64_t>(seg_v.size()) == a.size(1) / b.size(1) + 1 && seg_v.front() == 0 &&
                  seg_v.back() == out.size(1) && std::is_sorted(seg_v.begin(), seg_v.end()),
              "segment bounds must cover the output columns in order");
  for (const int64_t s : slot_v) TORCH_CHECK(s >= 0 && s < a.size(0), "slot out of range");
  const at::Tensor order_c = order.contiguous();
  TORCH_CHECK(order_c.scalar_type() == at::kLong, "order must be int64");
  const int64_t* order_p = order_c.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(x.size(0)), false);  // threads write a row's output: once each
  for (int64_t i = 0; i < order_c.numel(); ++i) {
    TORCH_CHECK(order_p[i] >= 0 && order_p[i] < x.size(0), "row out of range");
    TORCH_CHECK(!seen[order_p[i]], "a row may use one slot only");
    seen[order_p[i]] = true;
  }
  if (dtype == at::kFloat) {
    lora_add_typed<float>(out, x, a, b, order_p, bound_v, slot_v, seg_v);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "fp32 or bf16 only");
    lora_add_typed<bf16_t>(out, x, a, b, order_p, bound_v, slot_v, seg_v);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor order, Tensor bounds, Tensor slots, "
        "Tensor seg_bounds) -> ()");
  m.impl("lora_add", c10::DispatchKey::CPU, &lora_add);
}
