// Argument checks, output allocation and bias for the linear kernels (skinny_linear, panel_linear):
// y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), all contiguous fp32.
#pragma once

#include <ATen/ATen.h>

// The operands of one product, checked, with the uninitialized output y [M, N] allocated.
struct LinearIO {
  at::Tensor out;
  const float* x;
  const float* w;
  float* y;
  int64_t m_rows, k_dim, n_out;
};

inline LinearIO linear_io(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous(),
              "x [M, K] and weight [N, K] must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  return {out, x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
          weight.size(0)};
}

inline void add_bias(at::Tensor& out, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out.size(1), "bias must be fp32 [N]");
    out.add_(*bias);
  }
}
