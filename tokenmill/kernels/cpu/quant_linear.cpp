// Products with weights kept quantized in memory (kernels/quant_format.py's layout):
//   int8: qweight int8 [N, K], w = q * scale;
//   int4: qweight uint8 [N, K / 2], w = q * scale + min with q in 0..15; the 16 bytes of each run of
//         32 values along K hold value j in byte j's low nibble and value 16 + j in its high one;
// scale (and min) fp32 [N, K / group], one per group of `group` values along K (group a multiple of
// 32 that divides K).
//
// quantized_linear: y [M, N] = x [M, K] @ w^T (+ bias), x and y fp32 or bf16 (fp32 math).
//   Few rows (M <= stream_max_rows): the packed weights stream from memory once; threads split the
//   output columns in blocks of 4 weight rows, each dequantized kChunk values at a time into an
//   L1-resident fp32 tile that every row of x is multiplied against (the dequantized weight never
//   exists whole). More rows: the weight is dequantized to x's dtype (a temporary freed after the
//   call) and multiplied by at::linear (oneDNN), whose cost then dominates.
// dequantize_weight: the whole weight in `dtype` (fp32 or bf16), for that path and for tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"

namespace {

using tokenmill_simd::bf16_t;
using tokenmill_simd::horizontal_sum4;
using tokenmill_simd::load16;
using tokenmill_simd::store16;
using tokenmill_simd::vec16;

constexpr int64_t kRun = 32;  // values per packed run (and the smallest group)
constexpr int64_t kChunk = 256;  // values along K dequantized at a time per weight row
constexpr int64_t kBlock = 4;  // weight rows per work item

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// 16 bytes widened to fp32, as unsigned values or (signed) as int8 ones. Through int32 vectors: a
// direct byte-to-float conversion compiles to scalar code with GCC 12; these are vpmovzxbd (plus
// a re-bias for signed bytes) and vcvtdq2ps.
inline vec16 widen_unsigned(u8x16 bytes) { return __builtin_convertvector(__builtin_convertvector(bytes, i32x16), vec16); }

inline vec16 widen_signed(u8x16 bytes) {
  const u8x16 biased = bytes ^ static_cast<uint8_t>(0x80);  // int8 v as the byte v + 128
  return __builtin_convertvector(__builtin_convertvector(biased, i32x16) - 128, vec16);
}

struct Packed {
  const void* q;
  const float* scale;
  const float* min;  // nullptr for int8
  int64_t bits, group, n_out, k_dim;
  int64_t groups_per_row;  // k_dim / group
  int64_t group_shift;  // log2(group) when group is a power of two; else -1 (then group == k_dim)
};

// The index into scale/min of value k of weight row n (no division on this hot path).
inline int64_t group_index(const Packed& p, int64_t n, int64_t k) {
  return n * p.groups_per_row + (p.group_shift >= 0 ? k >> p.group_shift : 0);
}

// w[0:32) = the dequantized values [k, k + 32) of weight row n (k a multiple of 32).
inline void dequantize_run(const Packed& p, int64_t n, int64_t k, float* w) {
  const int64_t g = group_index(p, n, k);
  const float scale = p.scale[g];
  if (p.bits == 8) {
    const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * p.k_dim + k;
    for (int64_t half = 0; half < 2; ++half) {
      u8x16 bytes;
      std::memcpy(&bytes, q + 16 * half, sizeof(bytes));
      store16(w + 16 * half, widen_signed(bytes) * scale);
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (p.k_dim >> 1) + (k >> 1);
  u8x16 bytes;
  std::memcpy(&bytes, q, sizeof(bytes));
  const float min = p.min[g];
  store16(w, widen_unsigned(bytes & 15) * scale + min);
  store16(w + 16, widen_unsigned(bytes >> 4) * scale + min);
}

// y[m, n0:n0+4] for every row m of x (fp32, [M, K]); sums accumulate chunk by chunk.
void block_product(const Packed& p, const float* x, int64_t m_rows, int64_t n0, float* tile, float* sums) {
  const int64_t k_dim = p.k_dim;
  std::fill(sums, sums + m_rows * kBlock, 0.f);
  for (int64_t k0 = 0; k0 < k_dim; k0 += kChunk) {
    const int64_t len = std::min(kChunk, k_dim - k0);  // a multiple of 32
    for (int64_t j = 0; j < kBlock; ++j) {
      for (int64_t k = 0; k < len; k += kRun) dequantize_run(p, n0 + j, k0 + k, tile + j * kChunk + k);
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * k_dim + k0;
      vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t k = 0; k < len; k += 16) {
        const vec16 xv = load16(xr + k);
        a0 += load16(tile + k) * xv;
        a1 += load16(tile + kChunk + k) * xv;
        a2 += load16(tile + 2 * kChunk + k) * xv;
        a3 += load16(tile + 3 * kChunk + k) * xv;
      }
      const tokenmill_simd::vec4 s = horizontal_sum4(a0, a1, a2, a3);
      for (int64_t j = 0; j < kBlock; ++j) sums[m * kBlock + j] += s[j];
    }
  }
}

Packed packed_operands(const at::Tensor& qweight, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                       int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && scale.is_contiguous(), "contiguous operands");
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "int8 weights are int8, int4 uint8");
  const int64_t n_out = qweight.size(0), k_dim = bits == 8 ? qweight.size(1) : 2 * qweight.size(1);
  TORCH_CHECK(group % kRun == 0 && group > 0 && k_dim % group == 0, "group ", group, " must be a multiple of 32 "
              "dividing K=", k_dim);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_out * (k_dim / group), "scale: fp32 [N, K/group]");
  const bool has_min = min.has_value() && min->defined();
  TORCH_CHECK(has_min == (bits == 4), "int4 weights need mins, int8 weights have none");
  if (has_min) {
    TORCH_CHECK(min->scalar_type() == at::kFloat && min->is_contiguous() && min->numel() == scale.numel(),
                "min: fp32 like scale");
  }
  int64_t shift = 0;
  while ((int64_t{1} << shift) < group) ++shift;
  if ((int64_t{1} << shift) != group) shift = -1;
  TORCH_CHECK(shift >= 0 || group == k_dim, "a group size that is not a power of two must be all of K");
  return {qweight.data_ptr(), scale.data_ptr<float>(), has_min ? min->data_ptr<float>() : nullptr,
          bits, group, n_out, k_dim, k_dim / group, shift};
}

template <typename T>
void dequantize_into(const Packed& p, T* out) {
  at::parallel_for(0, p.n_out, 16, [&](int64_t begin, int64_t end) {
    float run[kRun];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < p.k_dim; k += kRun) {
        dequantize_run(p, n, k, run);
        T* o = out + n * p.k_dim + k;
        for (int64_t i = 0; i < kRun; ++i) tokenmill_simd::store_as(o + i, run[i]);
      }
    }
  });
}

}  // namespace

at::Tensor dequantize_weight(const at::Tensor& qweight, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                             int64_t bits, int64_t group, at::ScalarType dtype) {
  const Packed p = packed_operands(qweight, scale, min, bits, group);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to fp32 or bf16");
  at::Tensor out = at::empty({p.n_out, p.k_dim}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_into(p, out.data_ptr<float>());
  } else {
    dequantize_into(p, reinterpret_cast<bf16_t*>(out.data_ptr()));
  }
  return out;
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& min, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, int64_t stream_max_rows) {
  const Packed p = packed_operands(qweight, scale, min, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k_dim, "x must be [M, ", p.k_dim, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x fp32 or bf16");
  const int64_t m_rows = x.size(0);
  if (m_rows > stream_max_rows) {
    const at::Tensor w = dequantize_weight(qweight, scale, min, bits, group, x.scalar_type());
    return at::linear(x, w, bias.has_value() && bias->defined() ? *bias : at::Tensor());
  }
  TORCH_CHECK(p.n_out % kBlock == 0, "N must be a multiple of 4, got ", p.n_out);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m_rows, p.n_out}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, p.n_out / kBlock, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kBlock * kChunk), sums(m_rows * kBlock);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kBlock;
      block_product(p, xp, m_rows, n0, tile.data(), sums.data());
      for (int64_t m = 0; m < m_rows; ++m) {
        for (int64_t j = 0; j < kBlock; ++j) y[m * p.n_out + n0 + j] = sums[m * kBlock + j];
      }
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? min, int bits, int group, Tensor? bias, "
        "int stream_max_rows) -> Tensor");
  m.def("dequantize_weight(Tensor qweight, Tensor scale, Tensor? min, int bits, int group, ScalarType dtype) -> Tensor");
  m.impl("quantized_linear", c10::DispatchKey::CPU, &quantized_linear);
  m.impl("dequantize_weight", c10::DispatchKey::CPU, &dequantize_weight);
}
