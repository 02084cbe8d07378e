// The decoder layers of a pure decode step in one call, for fp32 CPU Llama-family models without
// projection biases or q/k norms: the same kernels as model/layers.py runs for such a step, in the
// same order (so the results are identical), minus the ~10 Python-level op calls per layer and
// their dispatch: ~4 ms of a ~33 ms batch-1 forward of the ~100M benchmark model on 2 cores.
// Keys and values of the step are written to the cache as the attention backend does.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "kernels.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

}  // namespace

// h [B, hidden]: the token embeddings. weights: kWeightsPerLayer per layer, in the order above.
// k_buffer/v_buffer [layers, slots, Hkv, D]. Returns (h, residual) after the last layer: the
// stack's output is h + residual (the caller fuses that sum into the final norm). Rows up to
// skinny_max_rows use skinny_linear, more use panel_linear (the caller bounds the batch).
std::tuple<at::Tensor, at::Tensor> decode_stack(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                                at::TensorList weights, const at::Tensor& k_buffer,
                                                const at::Tensor& v_buffer, const at::Tensor& out_cache_loc,
                                                const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                                const at::Tensor& seq_lens, int64_t n_heads, int64_t n_kv_heads,
                                                int64_t head_dim, double eps, double scale, int64_t skinny_max_rows) {
  const int64_t n_layers = k_buffer.size(0), batch = h.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kWeightsPerLayer, "expected ", kWeightsPerLayer,
              " weights per layer for ", n_layers, " layers, got ", weights.size());
  TORCH_CHECK(out_cache_loc.numel() == batch && seq_lens.numel() == batch, "one slot and length per request");
  const auto linear = batch <= skinny_max_rows ? &skinny_linear : &panel_linear;
  const c10::optional<at::Tensor> no_bias;
  at::Tensor residual;
  for (int64_t layer = 0; layer < n_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    at::Tensor x;
    if (layer == 0) {
      residual = h;
      x = rms_norm(h, w[0], eps);
    } else {
      x = add_rms_norm(h, residual, w[0], eps);
    }
    at::Tensor k_cache = k_buffer.select(0, layer), v_cache = v_buffer.select(0, layer);
    const at::Tensor q =
        rotary_store_kv(linear(x, w[1], no_bias), cos, sin, k_cache, v_cache, out_cache_loc, n_heads, n_kv_heads, head_dim);
    const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
    x = add_rms_norm(linear(attn.view({batch, n_heads * head_dim}), w[2], no_bias), residual, w[3], eps);
    h = linear(silu_and_mul(linear(x, w[4], no_bias)), w[5], no_bias);
  }
  return {h, residual};
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("decode_stack(Tensor(a!) h, Tensor cos, Tensor sin, Tensor[] weights, Tensor(b!) k_buffer, "
        "Tensor(c!) v_buffer, Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "int n_heads, int n_kv_heads, int head_dim, float eps, float scale, int skinny_max_rows) -> (Tensor, Tensor)");
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
}
