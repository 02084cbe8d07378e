// The forward of a pure decode step in one call, for fp32 or bf16 CPU Llama-family models without
// projection biases or q/k norms: token embedding, cos/sin rows, the decoder layers, final norm
// and LM head, with the same kernels in the same order as model/causal_lm.py, model/blocks.py and
// kernels/linear.py run them for such a step (so the logits are identical). What goes away is the
// Python and dispatcher work between the kernels: ~10 op calls per layer, and ~8 more around the
// layers. Keys and values of the step are written to the cache as the attention backend does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

#include "kernels.h"
#include "quant_packed.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;      // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t kProjectionsPerLayer = 4;  // qkv, o, gate_up, down: weights 1, 2, 4, 5 of a layer

// out[i] = table[index[i]] for a 2-d fp32 or bf16 table; every index checked against the table.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index, const char* what) {
  TORCH_CHECK((table.scalar_type() == at::kFloat || table.scalar_type() == at::kBFloat16) && table.dim() == 2 &&
                  table.is_contiguous(), what, ": table must be contiguous 2-d fp32 or bf16");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(), what,
              ": index must be contiguous 1-d int64");
  const int64_t n = index.numel(), rows = table.size(0);
  const int64_t row_bytes = table.size(1) * static_cast<int64_t>(table.element_size());
  at::Tensor out = at::empty({n, table.size(1)}, table.options());
  const int64_t* idx = index.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, what, ": index ", idx[i], " outside [0, ", rows, ")");
    std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
  }
  return out;
}

// oneDNN's linear (torch.ops.mkldnn._linear_pointwise, no bias, no post-op), as kernels/linear.py
// calls it: with a weight in oneDNN's blocked layout, or (fp32) as stored.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, c10::IValue(), c10::string_view("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::string_view("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// How kernels/linear.py's functional linear picks a product for x's rows (no bias): skinny_linear up
// to skinny_max_rows, panel_linear up to panel_max_rows, else oneDNN (fp32) or at::linear (bf16).
struct PlainLinear {
  int64_t skinny_max_rows, panel_max_rows;

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight) const {
    const c10::optional<at::Tensor> no_bias;
    const int64_t rows = x.size(0);
    if (rows <= skinny_max_rows) return skinny_linear(x, weight, no_bias);
    if (rows <= panel_max_rows) return panel_linear(x, weight, no_bias);
    return x.scalar_type() == at::kFloat ? onednn_linear(x, weight) : at::linear(x, weight);
  }
};

}  // namespace

// input_ids/positions [B]; embed [V, hidden]; cos_table/sin_table [N, D] (row p: position p, the
// rotate_half layout); weights: kWeightsPerLayer per layer, in the order above; blocked: empty, or
// kProjectionsPerLayer per layer and then one for the LM head, each the projection's weight in
// oneDNN's blocked layout (what kernels/linear.py's Linear would use for B rows) or None (the plain
// weight, through PlainLinear's choice); qscales/qmins: empty, or like blocked, the scale and min of a
// projection kept quantized (quant_linear.cpp's layout; its weight slot then holds the packed int8
// or uint8 weight: 8 or 4 bits; min None for int8) or None for one that is not, multiplied by
// quantized_linear with stream_max_rows and activation_passes as kernels/quant_linear.py calls it; k_buffer/v_buffer
// [layers, slots, Hkv, D] in the model's dtype, fp8 (kv_fp8's format), or int8 with k_scale_buffer/v_scale_buffer
// [layers, slots, Hkv] (kv_quant's format); windows: each layer's sliding window (0: global attention). Returns the logits [B, V'].
at::Tensor decode_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& blocked, const at::Tensor& final_norm,
                          const at::Tensor& lm_head, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                          const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                          const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, at::IntArrayRef windows,
                          int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double scale,
                          int64_t skinny_max_rows, int64_t panel_max_rows,
                          const c10::List<std::optional<at::Tensor>>& qscales,
                          const c10::List<std::optional<at::Tensor>>& qmins, int64_t stream_max_rows,
                          const c10::optional<at::Tensor>& k_scale_buffer,
                          const c10::optional<at::Tensor>& v_scale_buffer, int64_t activation_passes) {
  const int64_t n_layers = k_buffer.size(0), batch = input_ids.numel();
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == n_layers, "one window per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kWeightsPerLayer, "expected ", kWeightsPerLayer,
              " weights per layer for ", n_layers, " layers, got ", weights.size());
  const int64_t lm_head_index = n_layers * kProjectionsPerLayer;
  TORCH_CHECK(blocked.empty() || static_cast<int64_t>(blocked.size()) == lm_head_index + 1, "blocked: none, or ",
              kProjectionsPerLayer, " per layer and one for the LM head");
  TORCH_CHECK(qscales.size() == qmins.size() && (qscales.empty() || static_cast<int64_t>(qscales.size()) ==
                                                                          lm_head_index + 1),
              "qscales/qmins: none, or one each per projection");
  TORCH_CHECK(positions.numel() == batch && out_cache_loc.numel() == batch && seq_lens.numel() == batch,
              "one position, slot and length per request");
  const PlainLinear plain{skinny_max_rows, panel_max_rows};
  // x @ weight^T for the projection whose blocked copy (if any) is blocked[index], or whose scales
  // (if it is quantized) are qscales[index]
  const auto project = [&](const at::Tensor& x, int64_t index, const at::Tensor& weight) {
    if (!qscales.empty()) {
      const std::optional<at::Tensor> scales = qscales.get(index);
      if (scales.has_value()) {
        const int64_t bits = weight.scalar_type() == at::kChar ? 8 : 4;
        const int64_t n_out = weight.dim() == 3 ? weight.size(0) * tokenmill_quant::kPanel : weight.size(0);
        const int64_t group = x.size(1) * n_out / scales->numel();  // either layout: one scale per group
        return quantized_linear(x, weight, *scales, qmins.get(index), bits, group, c10::nullopt, stream_max_rows,
                                activation_passes);
      }
    }
    if (!blocked.empty()) {
      const std::optional<at::Tensor> copy = blocked.get(index);
      if (copy.has_value()) return onednn_linear(x, *copy);
    }
    return plain(x, weight);
  };
  at::Tensor h = gather_rows(embed, input_ids, "token embedding");
  const at::Tensor cos = gather_rows(cos_table, positions, "cos table");
  const at::Tensor sin = gather_rows(sin_table, positions, "sin table");
  at::Tensor residual;
  for (int64_t layer = 0; layer < n_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const int64_t p = layer * kProjectionsPerLayer;  // blocked[p + j]: qkv, o, gate_up, down
    at::Tensor x;
    if (layer == 0) {
      residual = h;
      x = rms_norm(h, w[0], eps);
    } else {
      x = add_rms_norm(h, residual, w[0], eps);
    }
    at::Tensor k_cache = k_buffer.select(0, layer), v_cache = v_buffer.select(0, layer);
    c10::optional<at::Tensor> k_scale, v_scale;  // an int8 cache's scales of this layer
    if (k_scale_buffer.has_value() && v_scale_buffer.has_value()) {
      k_scale = k_scale_buffer->select(0, layer);
      v_scale = v_scale_buffer->select(0, layer);
    }
    const at::Tensor q = rotary_store_kv(project(x, p, w[1]), cos, sin, k_cache, v_cache, out_cache_loc,
                                         n_heads, n_kv_heads, head_dim, k_scale, v_scale);
    const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                                   scale, windows[layer], k_scale, v_scale);
    x = add_rms_norm(project(attn.view({batch, n_heads * head_dim}), p + 1, w[2]), residual, w[3], eps);
    h = project(silu_and_mul(project(x, p + 2, w[4])), p + 3, w[5]);
  }
  return project(add_rms_norm(h, residual, final_norm, eps), lm_head_index, lm_head);
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("decode_forward(Tensor input_ids, Tensor positions, Tensor embed, Tensor cos_table, Tensor sin_table, "
        "Tensor[] weights, Tensor?[] blocked, Tensor final_norm, Tensor lm_head, Tensor(a!) k_buffer, "
        "Tensor(b!) v_buffer, Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "int[] windows, int n_heads, int n_kv_heads, int head_dim, float eps, float scale, int skinny_max_rows, "
        "int panel_max_rows, Tensor?[] qscales, Tensor?[] qmins, int stream_max_rows, Tensor? k_scale_buffer=None, "
        "Tensor? v_scale_buffer=None, int activation_passes=2) -> Tensor");
  m.impl("decode_forward", c10::DispatchKey::CPU, &decode_forward);
  // fp32 blocked weights are oneDNN tensors, which dispatch the call to this key
  m.impl("decode_forward", c10::DispatchKey::MkldnnCPU, &decode_forward);
}
