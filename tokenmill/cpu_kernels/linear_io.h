// Argument checks, output allocation and bias for the linear kernels (skinny_linear, panel_linear):
// y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), all contiguous fp32.
#pragma once

#include <ATen/ATen.h>

// Checks the operands and returns the uninitialized output.
inline at::Tensor linear_output(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous(),
              "x [M, K] and weight [N, K] must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  return at::empty({x.size(0), weight.size(0)}, x.options());
}

inline void add_bias(at::Tensor& out, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out.size(1), "bias must be fp32 [N]");
    out.add_(*bias);
  }
}
