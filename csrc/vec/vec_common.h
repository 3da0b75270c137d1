// Types and scalar conversions shared by every ISA's vector header.
//
// bf16_t / fp16_t are layout-compatible with c10::BFloat16 / c10::Half (one
// uint16_t), so tensor data pointers are reinterpret_cast to them. Kernels
// never include torch headers through this file.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpu_backend {

struct bf16_t {
  uint16_t x;
};
struct fp16_t {
  uint16_t x;
};
// One-byte KV-cache elements (csrc/kv_format.h). e4m3 is the OCP "fn"
// variant (torch.float8_e4m3fn): no infinities, 0x7f/0xff are NaN; caches are
// written saturated, so NaN never reaches the readers below.
struct fp8_e5m2_t {
  uint8_t x;
};
struct fp8_e4m3_t {
  uint8_t x;
};

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 -> fp32: exact, the bf16 bits are the top half of the fp32.
static inline float to_f32(bf16_t v) { return bits_f32(uint32_t(v.x) << 16); }

// fp32 -> bf16, round to nearest even; NaN -> quiet NaN (sign kept).
static inline bf16_t to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

// IEEE half -> fp32: exact (subnormals, inf and NaN included).
static inline float to_f32(fp16_t v) {
  const uint32_t h = v.x;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);  // +-0
  // subnormal: value = mant * 2^-24
  float f = float(mant) * 5.9604644775390625e-8f;
  return sign ? -f : f;
}

// fp32 -> IEEE half, round to nearest even, overflow -> inf, NaN kept quiet.
static inline fp16_t to_fp16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16_t{uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};
  if (a >= 0x477ff000u) return fp16_t{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // result is subnormal or zero (|f| < 2^-14)
    if (a < 0x33000000u) return fp16_t{sign};  // < 2^-25: rounds to 0
    // shift the full significand so that the result unit is 2^-24
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24 for e in 102..112
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return fp16_t{uint16_t(sign | r)};
  }
  // normal: rebias exponent (127 -> 15) and round the 13 dropped bits
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return fp16_t{uint16_t(sign | (r >> 13))};
}

// e5m2 is the top byte of an IEEE half: exact.
static inline float to_f32(fp8_e5m2_t v) { return to_f32(fp16_t{uint16_t(v.x << 8)}); }
static inline float to_f32(int8_t v) { return float(v); }
static inline float to_f32(float v) { return v; }
// A KV-cache element in the attention kernel's units, value / kKvUnit<E>:
// e4m3 as its half-precision pattern, 2^-8 of the value, which saves a
// multiply per vector; the kernel folds kKvUnit<E> into its per-tensor scales.
template <typename E>
inline constexpr float kKvUnit = 1.0f;
template <>
inline constexpr float kKvUnit<fp8_e4m3_t> = 256.0f;
template <typename T>
static inline float to_f32_kv(T v) {
  return to_f32(v);
}
// e4m3 (bias 7) placed in a half's exponent/mantissa (bias 15) is 2^-8 of the
// value, subnormals included: exact for every non-NaN byte.
static inline float to_f32_kv(fp8_e4m3_t v) {
  return to_f32(fp16_t{uint16_t(((v.x & 0x80u) << 8) | ((v.x & 0x7fu) << 7))});
}
static inline float to_f32(fp8_e4m3_t v) { return to_f32_kv(v) * kKvUnit<fp8_e4m3_t>; }
template <typename T>
static inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline bf16_t from_f32<bf16_t>(float v) { return to_bf16(v); }
template <>
inline fp16_t from_f32<fp16_t>(float v) { return to_fp16(v); }

}  // namespace cpu_backend

// The portable library neither forces inlining nor asks for `GCC unroll 32`:
// its float[16] loops, forced and unrolled into each kernel at -O3, made GCC
// spend 13.5 min on attention.cpp alone (alias walking over huge functions).
// With GCC's own inlining and unrolling decisions and -O2 (setup.py) it takes
// ~1/10 of that.
#if defined(__GNUC__) && !defined(CPU_BACKEND_ISA_PORTABLE)
#define CB_ALWAYS_INLINE inline __attribute__((always_inline))
#define CB_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#define CB_UNROLL _Pragma("GCC unroll 32")
#else
#define CB_ALWAYS_INLINE inline
#define CB_ALWAYS_INLINE_LAMBDA
#define CB_UNROLL
#endif
