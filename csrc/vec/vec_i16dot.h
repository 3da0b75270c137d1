// int16 x int16 -> int32 pair dot products: decode attention over int8 KV
// (attention.cpp) scores int8 keys against the query quantized to int16, and
// sums int8 value rows weighted by probabilities quantized to int16, two rows
// per instruction: half the instructions of widening to fp32. One branch per
// ISA, matching vec.h.
//
//   VecI16x32: 32 int16; load(const int8_t*) sign-extends 32 int8 and
//     load(const int16_t*) loads 32 int16, in the same lane order;
//     broadcast_pair(p) repeats the pair (p[0], p[1]) in every lane pair.
//   VecI32x16: 16 int32 sums; dot2(acc, a, b) adds the products of a and b,
//     two per lane, exactly (the caller bounds the magnitudes: 32 int16 x
//     int8 products per lane stay far below 2^31).
//   to_f32(VecI32x16): the sums as a VecF32x16. Lane order is the ISA's own:
//     a score sums all 16 lanes.
//   interleave(a, b, p0, p1): the 32 columns of two rows a, b as pairs
//     (a[c], b[c]) in p0 and p1 (16 columns each, in the ISA's lane order), so
//     dot2(acc, p_i, broadcast_pair(w)) adds w[0] * a[c] + w[1] * b[c] to
//     column c's lane; columns(s0, s1, lo, hi) puts the to_f32 sums of p0's
//     and p1's accumulators back in column order (lo: 0-15, hi: 16-31).
//   store_i16(x, p): 16 floats rounded to the nearest int16 (saturating).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace cpu_backend {

// The int16 pair p[0], p[1] as one little-endian int32 (p[0] in the low half).
static CB_ALWAYS_INLINE int32_t pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(CPU_BACKEND_ISA_AVX512)
struct VecI16x32 {
  __m512i v;
  static CB_ALWAYS_INLINE VecI16x32 load(const int8_t* p) {
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static CB_ALWAYS_INLINE VecI16x32 load(const int16_t* p) { return {_mm512_loadu_si512(p)}; }
  static CB_ALWAYS_INLINE VecI16x32 broadcast_pair(const int16_t* p) { return {_mm512_set1_epi32(pair(p))}; }
};
struct VecI32x16 {
  __m512i v;
  static CB_ALWAYS_INLINE VecI32x16 zero() { return {_mm512_setzero_si512()}; }
};
static CB_ALWAYS_INLINE VecI32x16 dot2(VecI32x16 acc, VecI16x32 a, VecI16x32 b) {
  return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)};  // AVX-512 VNNI
}
static CB_ALWAYS_INLINE VecF32x16 to_f32(VecI32x16 x) { return {_mm512_cvtepi32_ps(x.v)}; }
// unpack works within 128-bit lanes: p0 lane 4k+m is column 8k+m, p1's is 8k+4+m.
static CB_ALWAYS_INLINE void interleave(VecI16x32 a, VecI16x32 b, VecI16x32& p0, VecI16x32& p1) {
  p0.v = _mm512_unpacklo_epi16(a.v, b.v);
  p1.v = _mm512_unpackhi_epi16(a.v, b.v);
}
static CB_ALWAYS_INLINE void columns(VecF32x16 s0, VecF32x16 s1, VecF32x16& lo, VecF32x16& hi) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  lo.v = _mm512_permutex2var_ps(s0.v, i0, s1.v);
  hi.v = _mm512_permutex2var_ps(s0.v, i1, s1.v);
}
static CB_ALWAYS_INLINE void store_i16(VecF32x16 x, int16_t* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x.v)));
}

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
  static CB_ALWAYS_INLINE VecI16x32 broadcast_pair(const int16_t* p) {
    const __m256i w = _mm256_set1_epi32(pair(p));
    return {w, w};
  }
};
struct VecI32x16 {
  __m256i lo, hi;
  static CB_ALWAYS_INLINE VecI32x16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
};
static CB_ALWAYS_INLINE VecI32x16 dot2(VecI32x16 acc, VecI16x32 a, VecI16x32 b) {
#if defined(CPU_BACKEND_HAS_AVX_VNNI)
  return {_mm256_dpwssd_avx_epi32(acc.lo, a.lo, b.lo), _mm256_dpwssd_avx_epi32(acc.hi, a.hi, b.hi)};
#else
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
#endif
}
static CB_ALWAYS_INLINE VecF32x16 to_f32(VecI32x16 x) {
  return {_mm256_cvtepi32_ps(x.lo), _mm256_cvtepi32_ps(x.hi)};
}
// unpack works within 128-bit lanes: p0.lo lane 4k+m is column 8k+m, p1.lo's
// is 8k+4+m; .hi the same for columns 16-31.
static CB_ALWAYS_INLINE void interleave(VecI16x32 a, VecI16x32 b, VecI16x32& p0, VecI16x32& p1) {
  p0 = {_mm256_unpacklo_epi16(a.lo, b.lo), _mm256_unpacklo_epi16(a.hi, b.hi)};
  p1 = {_mm256_unpackhi_epi16(a.lo, b.lo), _mm256_unpackhi_epi16(a.hi, b.hi)};
}
static CB_ALWAYS_INLINE void columns(VecF32x16 s0, VecF32x16 s1, VecF32x16& lo, VecF32x16& hi) {
  lo = {_mm256_permute2f128_ps(s0.lo, s1.lo, 0x20), _mm256_permute2f128_ps(s0.lo, s1.lo, 0x31)};
  hi = {_mm256_permute2f128_ps(s0.hi, s1.hi, 0x20), _mm256_permute2f128_ps(s0.hi, s1.hi, 0x31)};
}
static CB_ALWAYS_INLINE void store_i16(VecF32x16 x, int16_t* p) {
  const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(x.lo), _mm256_cvtps_epi32(x.hi));  // lo0-3 hi0-3 lo4-7 hi4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, 0xD8));
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
  static CB_ALWAYS_INLINE VecI16x32 broadcast_pair(const int16_t* p) {
    VecI16x32 r;
    for (int i = 0; i < 32; ++i) r.v[i] = p[i % 2];
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
// p0 lane i is column i, p1's is column 16 + i: columns() has nothing to reorder.
static CB_ALWAYS_INLINE void interleave(VecI16x32 a, VecI16x32 b, VecI16x32& p0, VecI16x32& p1) {
  for (int i = 0; i < 16; ++i) {
    p0.v[2 * i] = a.v[i], p0.v[2 * i + 1] = b.v[i];
    p1.v[2 * i] = a.v[16 + i], p1.v[2 * i + 1] = b.v[16 + i];
  }
}
static CB_ALWAYS_INLINE void columns(VecF32x16 s0, VecF32x16 s1, VecF32x16& lo, VecF32x16& hi) {
  lo = s0;
  hi = s1;
}
static CB_ALWAYS_INLINE void store_i16(VecF32x16 x, int16_t* p) {
  for (int i = 0; i < 16; ++i) p[i] = int16_t(std::clamp(std::nearbyint(x.v[i]), -32768.f, 32767.f));
}
#endif

}  // namespace cpu_backend
