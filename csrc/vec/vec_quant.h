// Integer weight loads for the weight-only quantized linear (linear_wna16.cpp):
// 16 unsigned 4-bit or 8-bit values -> one VecF32x16 of exact floats.
// One branch per ISA, matching vec.h's selection.
#pragma once

#include <cstdint>

#include "vec.h"

namespace cpu_backend {

// u8: 16 bytes, value j = p[j].
// u4: 8 bytes, value j < 8 is the low nibble of p[j], value j >= 8 the high
// nibble of p[j - 8] (so both halves unpack with one shift and one mask).
#if defined(CPU_BACKEND_ISA_AVX512)
static CB_ALWAYS_INLINE VecF32x16 load_u8x16(const uint8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
}
// Zero-extend the 8 bytes to 32-bit lanes first (a load-op), then split the
// nibbles with one AND and one shift on whole lanes.
static CB_ALWAYS_INLINE VecF32x16 load_u4x16(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
  const __m256i hi = _mm256_srli_epi32(v, 4);
  return {_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1))};
}
#elif defined(CPU_BACKEND_ISA_AVX2)
static CB_ALWAYS_INLINE __m256i zext8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static CB_ALWAYS_INLINE VecF32x16 load_u8x16(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(zext8(p)), _mm256_cvtepi32_ps(zext8(p + 8))};
}
// Zero-extend the 8 bytes to 32-bit lanes first (a load-op), then split the
// nibbles with one AND and one shift on whole lanes.
static CB_ALWAYS_INLINE VecF32x16 load_u4x16(const uint8_t* p) {
  const __m256i v = zext8(p);
  return {_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f))),
          _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))};
}
#else
static CB_ALWAYS_INLINE VecF32x16 load_u8x16(const uint8_t* p) {
  VecF32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(p[i]);
  return r;
}
static CB_ALWAYS_INLINE VecF32x16 load_u4x16(const uint8_t* p) {
  VecF32x16 r;
  for (int i = 0; i < 8; ++i) {
    r.v[i] = float(p[i] & 0x0f);
    r.v[i + 8] = float(p[i] >> 4);
  }
  return r;
}
#endif

}  // namespace cpu_backend
