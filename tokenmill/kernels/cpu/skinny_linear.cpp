// y = x @ weight^T (+ bias) for CPU tensors with few rows in x (decode batches), fp32 or bf16 (bf16:
// x widened to fp32 once, weights widened as they stream, fp32 sums, y rounded to bf16 once): a
// bandwidth-bound product, so the kernel streams each weight row from memory exactly once.
// Threads split the output columns (weight rows) in blocks of 4; each block keeps 4 weight
// rows in L1 while every row of x is multiplied against them with 4 independent 8-wide
// accumulators. On 2 AVX2 cores this reads weights at ~17-21 GB/s for 1-2 rows, where
// oneDNN/MKL reach 8-13 GB/s; from ~12 rows on, the register-tiled panel_linear is faster.
// bf16 x and weights on a CPU with AVX512-BF16 (built with __AVX512BF16__) take dot_bf16_rows
// instead: 32 products per instruction straight from bf16 (vdpbf16ps, fp32 sums; exact products,
// sums rounded per pair as the instruction does, denormal inputs read as zero), no widening.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "linear_io.h"
#include "simd.h"

namespace {

using tokenmill_simd::bf16_t;
using tokenmill_simd::horizontal_sum;
using tokenmill_simd::load8;
using tokenmill_simd::to_float;
using tokenmill_simd::vec8;

constexpr int64_t kRowsPerBlock = 4;

// out[m * n_out + n] for n in [n0, n0 + 4): four weight rows against every row of x.
template <typename W>
void four_rows(const float* x, const W* w, float* out, int64_t m_rows, int64_t k_dim, int64_t n_out, int64_t n0) {
  const W* w0 = w + n0 * k_dim;
  const W* w1 = w0 + k_dim;
  const W* w2 = w1 + k_dim;
  const W* w3 = w2 + k_dim;
  const int64_t vec_end = k_dim - k_dim % 8;
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* xr = x + m * k_dim;
    vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t k = 0; k < vec_end; k += 8) {
      const vec8 xv = load8(xr + k);
      a0 += load8(w0 + k) * xv;
      a1 += load8(w1 + k) * xv;
      a2 += load8(w2 + k) * xv;
      a3 += load8(w3 + k) * xv;
    }
    float s0 = horizontal_sum(a0), s1 = horizontal_sum(a1), s2 = horizontal_sum(a2), s3 = horizontal_sum(a3);
    for (int64_t k = vec_end; k < k_dim; ++k) {
      s0 += to_float(w0[k]) * xr[k];
      s1 += to_float(w1[k]) * xr[k];
      s2 += to_float(w2[k]) * xr[k];
      s3 += to_float(w3[k]) * xr[k];
    }
    float* o = out + m * n_out + n0;
    o[0] = s0;
    o[1] = s1;
    o[2] = s2;
    o[3] = s3;
  }
}

template <typename W>
void one_row(const float* x, const W* w, float* out, int64_t m_rows, int64_t k_dim, int64_t n_out, int64_t n) {
  const W* wr = w + n * k_dim;
  for (int64_t m = 0; m < m_rows; ++m) {
    float s = 0.f;
    for (int64_t k = 0; k < k_dim; ++k) s += to_float(wr[k]) * x[m * k_dim + k];
    out[m * n_out + n] = s;
  }
}

// y [M, N] (fp32) = x [M, K] (fp32) @ w [N, K]^T.
template <typename W>
void product(const float* x, const W* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_out) {
  const int64_t full_blocks = n_out / kRowsPerBlock;
  at::parallel_for(0, full_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) four_rows(x, w, y, m_rows, k_dim, n_out, b * kRowsPerBlock);
  });
  for (int64_t n = full_blocks * kRowsPerBlock; n < n_out; ++n) one_row(x, w, y, m_rows, k_dim, n_out, n);
}

#if defined(__AVX512BF16__)
constexpr int64_t kPrefetchBlocks = 2;

// y [M, N] (fp32) = x [M, K] (bf16) @ w [N, K]^T (bf16): blocks of 4 weight rows, 32 of K per step
// (the last step masked), each row of x against the block while it is in L1. Each step also asks
// for the same columns of the block kPrefetchBlocks ahead: with the prefetchers alone, the many
// short row streams of a decode step's small matrices read well below the machine's rate.
void dot_bf16_rows(const bf16_t* x, const bf16_t* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_out) {
  const int64_t steps = (k_dim + 31) / 32;
  const __mmask32 tail = k_dim % 32 == 0 ? ~__mmask32{0} : (__mmask32{1} << (k_dim % 32)) - 1;
  const auto load = [&](const bf16_t* p, int64_t step) {
    return (__m512bh)_mm512_maskz_loadu_epi16(step == steps - 1 ? tail : ~__mmask32{0}, p + step * 32);
  };
  const int64_t n_blocks = (n_out + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, n_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock, rows = std::min(kRowsPerBlock, n_out - n0);
      const bf16_t* wr[kRowsPerBlock];
      for (int64_t r = 0; r < kRowsPerBlock; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * k_dim;
      for (int64_t m = 0; m < m_rows; ++m) {
        const bf16_t* xr = x + m * k_dim;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t step = 0; step < steps; ++step) {
          if (m == 0 && b + kPrefetchBlocks < end && (b + kPrefetchBlocks + 1) * kRowsPerBlock <= n_out) {
            const bf16_t* ahead = w + (n0 + kPrefetchBlocks * kRowsPerBlock) * k_dim + step * 32;
            for (int64_t r = 0; r < kRowsPerBlock; ++r) {
              _mm_prefetch(reinterpret_cast<const char*>(ahead + r * k_dim), _MM_HINT_T0);
            }
          }
          const __m512bh xv = load(xr, step);
          a0 = _mm512_dpbf16_ps(a0, load(wr[0], step), xv);
          a1 = _mm512_dpbf16_ps(a1, load(wr[1], step), xv);
          a2 = _mm512_dpbf16_ps(a2, load(wr[2], step), xv);
          a3 = _mm512_dpbf16_ps(a3, load(wr[3], step), xv);
        }
        const float sums[kRowsPerBlock] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                                           _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
        for (int64_t r = 0; r < rows; ++r) y[m * n_out + n0 + r] = sums[r];
      }
    }
  });
}
#endif

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16 like the weight");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous(),
                "x [M, K] and weight [N, K] must be contiguous");
    TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
    const auto* w = static_cast<const bf16_t*>(weight.data_ptr());
#if defined(__AVX512BF16__)
    dot_bf16_rows(static_cast<const bf16_t*>(x.data_ptr()), w, y.data_ptr<float>(), x.size(0), x.size(1),
                  weight.size(0));
#else
    const at::Tensor x32 = x.to(at::kFloat);
    product(x32.data_ptr<float>(), w, y.data_ptr<float>(), x.size(0), x.size(1), weight.size(0));
#endif
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == y.size(1), "bias must be [N]");
      y.add_(*bias);
    }
    return y.to(at::kBFloat16);
  }
  LinearIO io = linear_io(x, weight);
  product(io.x, io.w, io.y, io.m_rows, io.k_dim, io.n_out);
  add_bias(io.out, bias);
  return io.out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("skinny_linear", c10::DispatchKey::CPU, &skinny_linear);
}
