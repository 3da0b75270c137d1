// int16 x int16 -> int32 pair dot products: decode attention scores int8
// keys against the query quantized to int16 (attention.cpp), half the
// instructions of widening both to fp32. One branch per ISA, matching vec.h.
//
//   VecI16x32: 32 int16; load(const int8_t*) sign-extends 32 int8 and
//     load(const int16_t*) loads 32 int16, in the same lane order.
//   VecI32x16: 16 int32 sums; dot2(acc, a, b) adds the products of a and b,
//     two per lane, exactly (the caller bounds the magnitudes: 32 int16 x
//     int8 products per lane stay far below 2^31).
//   to_f32(VecI32x16): the sums as a VecF32x16. Lane order is the ISA's own:
//     callers only ever sum all 16 lanes.
#pragma once

#include <cstdint>

#include "vec.h"

namespace cpu_backend {

#if defined(CPU_BACKEND_ISA_AVX512)
struct VecI16x32 {
  __m512i v;
  static CB_ALWAYS_INLINE VecI16x32 load(const int8_t* p) {
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static CB_ALWAYS_INLINE VecI16x32 load(const int16_t* p) { return {_mm512_loadu_si512(p)}; }
};
struct VecI32x16 {
  __m512i v;
  static CB_ALWAYS_INLINE VecI32x16 zero() { return {_mm512_setzero_si512()}; }
};
static CB_ALWAYS_INLINE VecI32x16 dot2(VecI32x16 acc, VecI16x32 a, VecI16x32 b) {
  return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)};  // AVX-512 VNNI
}
static CB_ALWAYS_INLINE VecF32x16 to_f32(VecI32x16 x) { return {_mm512_cvtepi32_ps(x.v)}; }

#elif defined(CPU_BACKEND_ISA_AVX2)
struct VecI16x32 {
  __m256i lo, hi;
  static CB_ALWAYS_INLINE VecI16x32 load(const int8_t* p) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static CB_ALWAYS_INLINE VecI16x32 load(const int16_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
  }
};
struct VecI32x16 {
  __m256i lo, hi;
  static CB_ALWAYS_INLINE VecI32x16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
};
static CB_ALWAYS_INLINE VecI32x16 dot2(VecI32x16 acc, VecI16x32 a, VecI16x32 b) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
static CB_ALWAYS_INLINE VecF32x16 to_f32(VecI32x16 x) {
  return {_mm256_cvtepi32_ps(x.lo), _mm256_cvtepi32_ps(x.hi)};
}

#else
struct VecI16x32 {
  int16_t v[32];
  template <typename T>
  static CB_ALWAYS_INLINE VecI16x32 load(const T* p) {
    VecI16x32 r;
    for (int i = 0; i < 32; ++i) r.v[i] = p[i];
    return r;
  }
};
struct VecI32x16 {
  int32_t v[16];
  static CB_ALWAYS_INLINE VecI32x16 zero() { return {}; }
};
static CB_ALWAYS_INLINE VecI32x16 dot2(VecI32x16 acc, VecI16x32 a, VecI16x32 b) {
  for (int i = 0; i < 16; ++i)
    acc.v[i] += int32_t(a.v[2 * i]) * b.v[2 * i] + int32_t(a.v[2 * i + 1]) * b.v[2 * i + 1];
  return acc;
}
static CB_ALWAYS_INLINE VecF32x16 to_f32(VecI32x16 x) {
  VecF32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(x.v[i]);
  return r;
}
#endif

}  // namespace cpu_backend
