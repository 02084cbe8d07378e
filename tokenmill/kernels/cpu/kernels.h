// The kernels' C++ entry points, for decode_forward.cpp to call them directly (not through the
// dispatcher). Each is defined in its own .cpp; all but rotary_store_kv (decode_forward.cpp's alone)
// are also registered as torch.ops.tokenmill_cpu ops (store_kv_int8 as store_kv_int8_, store_kv_fp8 as
// store_kv_fp8_).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& min, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, int64_t stream_max_rows, int64_t activation_passes);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                               const at::Tensor& sin, int64_t n_heads,
                                                               int64_t n_kv_heads, int64_t head_dim);
at::Tensor rotary_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& out_cache_loc, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale);
void store_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& slots);
void store_kv_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slots);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
