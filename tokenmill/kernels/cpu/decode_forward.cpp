// The forward of a pure decode step in one call, for fp32 CPU Llama-family models without
// projection biases or q/k norms: token embedding, cos/sin rows, the decoder layers, final norm
// and LM head, with the same kernels in the same order as model/causal_lm.py and model/blocks.py
// run them for such a step (so the logits are identical). What goes away is the Python and
// dispatcher work between the kernels: ~10 op calls per layer, and ~8 more around the layers.
// Keys and values of the step are written to the cache as the attention backend does.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "kernels.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

// out[i] = table[index[i]] for a 2-d fp32 table; every index checked against the table.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index, const char* what) {
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.is_contiguous(), what,
              ": table must be contiguous 2-d fp32");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(), what,
              ": index must be contiguous 1-d int64");
  const int64_t n = index.numel(), rows = table.size(0), width = table.size(1);
  at::Tensor out = at::empty({n, width}, table.options());
  const int64_t* idx = index.data_ptr<int64_t>();
  const float* src = table.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, what, ": index ", idx[i], " outside [0, ", rows, ")");
    std::memcpy(dst + i * width, src + idx[i] * width, width * sizeof(float));
  }
  return out;
}

}  // namespace

// input_ids/positions [B]; embed [V, hidden]; cos_table/sin_table [N, D] (row p: position p, the
// rotate_half layout); weights: kWeightsPerLayer per layer, in the order above; k_buffer/v_buffer
// [layers, slots, Hkv, D]. Returns the logits [B, V']. Rows up to skinny_max_rows use
// skinny_linear, more use panel_linear (the caller bounds the batch).
at::Tensor decode_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, at::TensorList weights,
                          const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& k_buffer,
                          const at::Tensor& v_buffer, const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                          const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, int64_t n_heads,
                          int64_t n_kv_heads, int64_t head_dim, double eps, double scale, int64_t skinny_max_rows) {
  const int64_t n_layers = k_buffer.size(0), batch = input_ids.numel();
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kWeightsPerLayer, "expected ", kWeightsPerLayer,
              " weights per layer for ", n_layers, " layers, got ", weights.size());
  TORCH_CHECK(positions.numel() == batch && out_cache_loc.numel() == batch && seq_lens.numel() == batch,
              "one position, slot and length per request");
  const auto linear = batch <= skinny_max_rows ? &skinny_linear : &panel_linear;
  const c10::optional<at::Tensor> no_bias;
  at::Tensor h = gather_rows(embed, input_ids, "token embedding");
  const at::Tensor cos = gather_rows(cos_table, positions, "cos table");
  const at::Tensor sin = gather_rows(sin_table, positions, "sin table");
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
    const at::Tensor q = rotary_store_kv(linear(x, w[1], no_bias), cos, sin, k_cache, v_cache, out_cache_loc,
                                         n_heads, n_kv_heads, head_dim);
    const at::Tensor attn =
        paged_decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
    x = add_rms_norm(linear(attn.view({batch, n_heads * head_dim}), w[2], no_bias), residual, w[3], eps);
    h = linear(silu_and_mul(linear(x, w[4], no_bias)), w[5], no_bias);
  }
  return linear(add_rms_norm(h, residual, final_norm, eps), lm_head, no_bias);
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("decode_forward(Tensor input_ids, Tensor positions, Tensor embed, Tensor cos_table, Tensor sin_table, "
        "Tensor[] weights, Tensor final_norm, Tensor lm_head, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
        "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int n_heads, "
        "int n_kv_heads, int head_dim, float eps, float scale, int skinny_max_rows) -> Tensor");
  m.impl("decode_forward", c10::DispatchKey::CPU, &decode_forward);
}
