// Helpers shared by the CPU kernels: 8- and 16-wide fp32 vectors (GCC/Clang vector extensions, so
// any x86/ARM target compiles them), loads of bf16, int8 and fp8 into them, bf16 rounding,
// horizontal sums, a vectorizable exp, an in-place softmax, and a software prefetch of a byte range.
// torch's rebuild check hashes only the listed .cpp sources, so kernels/cpu/__init__.py adds this
// header's content hash to the compile flags: an edit here rebuilds the extension too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tokenmill_simd {

typedef float vec4 __attribute__((vector_size(16)));
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// bf16 values are handled as their raw 16 bits: the upper half of the fp32 with the same value.
typedef uint16_t bf16_t;

inline vec8 load8(const bf16_t* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
  vec8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float to_float(float x) { return x; }

// int8 values (an int8 KV cache's, before their scale) widened to fp32: sign-extend + convert
// instructions where the CPU has them (GCC's __builtin_convertvector from int8 goes element by
// element), plain vector code elsewhere.
inline vec8 load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vec8 v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
#else
  typedef int8_t i8x8 __attribute__((vector_size(8)));
  i8x8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vec8);
#endif
}

inline float to_float(int8_t x) { return static_cast<float>(x); }

inline float to_float(bf16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Store an fp32 result as T: as is for float; rounded to nearest even for bf16 (as torch rounds),
// a NaN staying a (quiet) NaN. Branch-free, so loops over it vectorize.
inline void store_as(float* p, float v) { *p = v; }

inline void store_as(bf16_t* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  *p = static_cast<bf16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float horizontal_sum(vec8 v) {
  vec4 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const vec4 s = lo + hi;
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// 16-wide fp32 vectors: one AVX-512 register, or two AVX2 ones where the CPU has no AVX-512.
typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec16 load16(const bf16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline vec16 load16(const int8_t* p) {
  vec16 v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &f, sizeof(v));
#else
  const vec8 lo = load8(p), hi = load8(p + 8);
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#endif
  return v;
}


// fp8 values (an fp8 KV cache's, cache/kv_fp8.py) as their raw byte: OCP e4m3fn (bias 7, no
// infinities, S.1111.111 the only NaN) or e5m2 (bias 15: the upper byte of the fp16 of equal value).
struct fp8_e4m3_t {
  uint8_t bits;
};
struct fp8_e5m2_t {
  uint8_t bits;
};

// The exact value of fp8 byte b with kMantissaBits (3: e4m3fn, 2: e5m2) and kBias; e5m2 has
// infinities and NaNs in its top exponent, e4m3fn only the NaN S.1111.111.
template <int kMantissaBits, int kBias>
constexpr float fp8_value(int b) {
  const int top = (1 << (7 - kMantissaBits)) - 1, full = (1 << kMantissaBits) - 1;
  const int exponent = (b & 0x7F) >> kMantissaBits, mantissa = b & full;
  const bool has_inf = kMantissaBits == 2;
  float magnitude = 0.f;
  if (exponent == top && (has_inf || mantissa == full)) {
    magnitude = has_inf && mantissa == 0 ? std::numeric_limits<float>::infinity()
                                         : std::numeric_limits<float>::quiet_NaN();
  } else {  // (implicit one + mantissa) * 2^(exponent - bias - mantissa bits); subnormals at exponent 1
    magnitude = static_cast<float>(exponent > 0 ? (1 << kMantissaBits) + mantissa : mantissa);
    for (int e = (exponent > 0 ? exponent : 1) - kBias - kMantissaBits; e != 0; e += e > 0 ? -1 : 1) {
      magnitude *= e > 0 ? 2.f : 0.5f;
    }
  }
  return b & 0x80 ? -magnitude : magnitude;
}

// Every byte's value: the scalar reads (and the vector ones without AVX2/F16C) look them up.
template <int kMantissaBits, int kBias>
struct Fp8Table {
  float values[256];
  constexpr Fp8Table() : values() {
    for (int b = 0; b < 256; ++b) values[b] = fp8_value<kMantissaBits, kBias>(b);
  }
};
inline constexpr Fp8Table<3, 7> kE4m3Values{};
inline constexpr Fp8Table<2, 15> kE5m2Values{};

inline float to_float(fp8_e4m3_t x) { return kE4m3Values.values[x.bits]; }
inline float to_float(fp8_e5m2_t x) { return kE5m2Values.values[x.bits]; }

// 8 fp8 values widened to fp32 through fp16 (F16C's exact conversion): an e5m2 byte is the upper
// byte of its fp16; an e4m3fn byte's 7 low bits shifted into an fp16's exponent and mantissa read
// 2^-8 times its value (subnormals included: they become fp16 subnormals), its NaN is made an fp16
// NaN. Without AVX2/F16C: the table.
inline vec8 load8(const fp8_e4m3_t* p) {
  vec8 v;
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_and_si128(w, _mm_set1_epi16(0x7F));
  __m128i h = _mm_or_si128(_mm_slli_epi16(magnitude, 7), _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7E00)));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  std::memcpy(&v, &f, sizeof(v));
#else
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
#endif
  return v;
}

inline vec8 load8(const fp8_e5m2_t* p) {
  vec8 v;
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  const __m256 f = _mm256_cvtph_ps(h);
  std::memcpy(&v, &f, sizeof(v));
#else
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
#endif
  return v;
}

template <typename Fp8>
inline vec16 load16_fp8(const Fp8* p) {
  vec16 v;
  const vec8 lo = load8(p), hi = load8(p + 8);
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
}
inline vec16 load16(const fp8_e4m3_t* p) { return load16_fp8(p); }
inline vec16 load16(const fp8_e5m2_t* p) { return load16_fp8(p); }

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

#if defined(__AVX2__)
// A vec16 as two 256-bit registers (values 0-7, 8-15) and back: with AVX2 alone, code that keeps the
// halves in registers explicitly (GCC would put a vec16 times a scalar's broadcast through the stack).
inline void split16(vec16 v, __m256* halves) { std::memcpy(halves, &v, sizeof(v)); }

inline vec16 join16(__m256 low, __m256 high) {
  vec16 v;
  std::memcpy(&v, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(low), &high, sizeof(high));
  return v;
}
#endif

// 16 values rounded to bf16 as store_as rounds one (nearest even, a NaN staying a quiet NaN).
inline void store16(bf16_t* p, vec16 v) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 quiet_nan = (bits >> 16) | 0x40u;
  const u32x16 result = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  const u16x16 halves = __builtin_convertvector(result, u16x16);
  std::memcpy(p, &halves, sizeof(halves));
}

inline float horizontal_sum(vec16 v) {
  vec8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  return horizontal_sum(lo + hi);
}

// {sum(a), sum(b), sum(c), sum(d)}: four horizontal sums sharing one reduction tree (one each
// where the compiler lacks __builtin_shufflevector: GCC before 12).
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
inline vec4 horizontal_sum4(vec16 a, vec16 b, vec16 c, vec16 d) {
  const vec8 a8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec8 b8 = __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec8 c8 = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec8 d8 = __builtin_shufflevector(d, d, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(d, d, 8, 9, 10, 11, 12, 13, 14, 15);
  // ab: a's partial sums in lanes 0-3, b's in 4-7; cd likewise
  const vec8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  // pairs: lanes 0-1 a, 2-3 b, 4-5 c, 6-7 d
  const vec8 pairs = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) + __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);
}
#else
inline vec4 horizontal_sum4(vec16 a, vec16 b, vec16 c, vec16 d) {
  return vec4{horizontal_sum(a), horizontal_sum(b), horizontal_sum(c), horizontal_sum(d)};
}
#endif

// exp(x) with x clamped to [-87, 88] (enough for silu and for softmax, where x <= 0);
// ~1e-7 relative error: Cephes' expf polynomial after the usual ln2 range reduction.
inline float fast_exp(float x) {
  x = std::max(-87.f, std::min(x, 88.f));
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest, vectorizable
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-06f;
  float p = 1.98756915e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 5.00000000e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof(bits));
  return p;
}

// max(s[0 .. n)), n >= 1: sixteen lanes of maxima, then across them (the compiler leaves a plain
// max loop scalar).
inline float max_of(const float* s, int64_t n) {
  float max_s = s[0];
  int64_t l = 0;
  if (n >= 16) {
    vec16 lanes = load16(s);
    for (l = 16; l + 16 <= n; l += 16) {
      const vec16 next = load16(s + l);
      lanes = lanes < next ? next : lanes;
    }
    for (int64_t i = 0; i < 16; ++i) max_s = std::max(max_s, lanes[i]);
  }
  for (; l < n; ++l) max_s = std::max(max_s, s[l]);
  return max_s;
}

// e[first .. last) = softmax(factor * e[first .. last)), in place (fp32; exp as fast_exp; first < last).
inline void softmax_in_place(float* e, int64_t first, int64_t last, float factor) {
  const float shift = max_of(e + first, last - first) * factor;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = first; j < last; ++j) {
    e[j] = fast_exp(e[j] * factor - shift);
    sum += e[j];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = first; j < last; ++j) e[j] *= inv;
}

// Ask the cache for [p, p + n_bytes) ahead of use (reads through an index table defeat the
// hardware prefetchers).
inline void prefetch_range(const void* p, int64_t n_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < n_bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

}  // namespace tokenmill_simd
