// Integer weight fields for the weight-only quantized linear (linear_wna16.cpp).
// A block is 64 bytes: 16 little-endian 32-bit words, one per output column,
// each holding KW = 32 / BITS unsigned fields (field i in bits [BITS*i,
// BITS*(i+1))). qfield<BITS, I> turns field I of the 16 words into one
// VecF32x16 of exact floats with a single AND (or shift) and a conversion:
//   I < KW-1: the field is left in place, so the value is q * 2^(BITS*I)
//             (the kernel scales x by 2^-(BITS*I) instead, exactly);
//   I = KW-1: the top field is shifted down (its AND would set the sign bit): q.
// One branch per ISA, matching vec.h's selection.
#pragma once

#include <cstdint>

#include "vec.h"

namespace cpu_backend {

template <int BITS, int I>
struct QField {
  static constexpr int kPerWord = 32 / BITS;
  static constexpr bool kTop = I == kPerWord - 1;
  static constexpr uint32_t kMask = ((1u << BITS) - 1u) << (BITS * I);
  // x multiplier that undoes the in-place position: 2^-(BITS*I), or 1 on top.
  static constexpr float kXScale = kTop ? 1.0f : 1.0f / float(1u << (BITS * I));
};

#if defined(CPU_BACKEND_ISA_AVX512)
template <int BITS, int I>
static CB_ALWAYS_INLINE VecF32x16 qfield(const uint8_t* p) {
  const __m512i w = _mm512_loadu_si512(p);
  if constexpr (QField<BITS, I>::kTop) {
    return {_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 32 - BITS))};
  } else {
    return {_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(QField<BITS, I>::kMask))))};
  }
}
// u4 fields J and J+4 (J < 4) of the 16 words as bf16 pairs (128 + q_J,
// 128 + q_{J+4}) for VDPBF16PS: a shift and one ternary logic op put each
// nibble in a bf16 mantissa under the exponent of 128 (0x4300 | q = 128 + q).
template <int J>
static CB_ALWAYS_INLINE VecBF16x32 q4_bf16_pair(const uint8_t* p) {
  __m512i w = _mm512_loadu_si512(p);
  if constexpr (J > 0) w = _mm512_srli_epi32(w, 4 * J);
  // (w & 0x000f000f) | 0x43004300
  return {_mm512_ternarylogic_epi32(w, _mm512_set1_epi32(0x000f000f), _mm512_set1_epi32(0x43004300), 0xea)};
}
constexpr float kQ4PairBias = 128.0f;
#elif defined(CPU_BACKEND_ISA_AVX2)
template <int BITS, int I>
static CB_ALWAYS_INLINE __m256 qfield8(const uint8_t* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (QField<BITS, I>::kTop) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 32 - BITS));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(QField<BITS, I>::kMask))));
  }
}
template <int BITS, int I>
static CB_ALWAYS_INLINE VecF32x16 qfield(const uint8_t* p) {
  return {qfield8<BITS, I>(p), qfield8<BITS, I>(p + 32)};
}
#else
template <int BITS, int I>
static CB_ALWAYS_INLINE VecF32x16 qfield(const uint8_t* p) {
  VecF32x16 r;
  for (int c = 0; c < 16; ++c) {
    const uint8_t* b = p + 4 * c;
    const uint32_t w = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
    r.v[c] = QField<BITS, I>::kTop ? float(w >> (32 - BITS)) : float(int32_t(w & QField<BITS, I>::kMask));
  }
  return r;
}
#endif

}  // namespace cpu_backend
