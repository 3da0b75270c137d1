// Unsigned 4-bit weights times signed 8-bit activations, 32 inputs at a time,
// for the W4A8 option of the weight-only linear (linear_wna16.cpp,
// VLLM_CPU_INT4_W4A8, the default). One branch per ISA family.
//
// Weights: linear_wna16's 64-byte blocks (16 words, one per column; nibble i of
// a word is input 8b + i). Byte j of a word holds inputs 2j (low nibble) and
// 2j + 1 (high nibble), so one AND gives the even inputs of 16 columns as
// unsigned bytes and a shift plus an AND the odd ones: no repacking.
// Activations are stored to match: per block and row two int32, the bytes of
// inputs (0, 2, 4, 6) and of (1, 3, 5, 7), each in [-127, 127].
//
// u4s8_unit<MR>(q, a, out): q = 4 consecutive blocks of one panel (32
// inputs), a = [4][MR][2] int32; out[m] = float(sum of the 32 products q * x)
// for the 16 columns, exact (|sum| <= 32 * 15 * 127).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace cpu_backend {

constexpr int kU4S8Inputs = 32;   // inputs per unit (and per activation scale)
constexpr int kU4S8Blocks = 4;    // 64-byte blocks per unit

#if defined(CPU_BACKEND_ISA_AVX512) || defined(CPU_BACKEND_ISA_AVX2)
// VPMADDUBSW: u8 x s8, adjacent pairs summed into int16 (with saturation,
// never reached: a pair is at most 2 * 15 * 127 = 3810). Both halves of a
// block add into one int16 lane per column pair, so a unit's lane holds at
// most 4 * 2 * 3810 = 30480 < 32767; VPMADDWD by ones then widens to int32.
// Per 128 products: 2 loads, 3 logic ops, 4 VPMADDUBSW and 4 adds, against 16
// conversions and 16 FMAs on the float path. The AVX-512 build runs the same
// 256-bit code (16 columns are two ymm either way).
static CB_ALWAYS_INLINE VecF32x16 u4s8_join(__m256 lo, __m256 hi) {
#if defined(CPU_BACKEND_ISA_AVX512)
  return {_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1))};
#else
  return {lo, hi};
#endif
}

template <int MR>
static CB_ALWAYS_INLINE void u4s8_unit(const uint8_t* q, const int32_t* a, VecF32x16 (&out)[MR]) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i s16[MR][2];
  CB_UNROLL for (int m = 0; m < MR; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
  CB_UNROLL for (int b = 0; b < kU4S8Blocks; ++b) {
    CB_UNROLL for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * b + 32 * h));
      const __m256i even = _mm256_and_si256(w, nib);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const int32_t* ab = a + (b * MR + m) * 2;
        const __m256i pe = _mm256_maddubs_epi16(even, _mm256_set1_epi32(ab[0]));
        const __m256i po = _mm256_maddubs_epi16(odd, _mm256_set1_epi32(ab[1]));
        s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_add_epi16(pe, po));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  CB_UNROLL for (int m = 0; m < MR; ++m) {
    out[m] = u4s8_join(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m][0], ones)),
                       _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m][1], ones)));
  }
}

#else
// Portable: the same sums with plain integer multiply-adds.
template <int MR>
static inline void u4s8_unit(const uint8_t* q, const int32_t* a, VecF32x16 (&out)[MR]) {
  int32_t s[MR][16] = {};
  for (int b = 0; b < kU4S8Blocks; ++b) {
    for (int m = 0; m < MR; ++m) {
      int8_t x[8];  // inputs 0..7 of the block, from the even / odd words
      int8_t ev[4], od[4];
      std::memcpy(ev, a + (b * MR + m) * 2, 4);
      std::memcpy(od, a + (b * MR + m) * 2 + 1, 4);
      for (int j = 0; j < 4; ++j) {
        x[2 * j] = ev[j];
        x[2 * j + 1] = od[j];
      }
      for (int c = 0; c < 16; ++c) {
        const uint8_t* w = q + 64 * b + 4 * c;
        for (int i = 0; i < 8; ++i) s[m][c] += int32_t((w[i / 2] >> (4 * (i % 2))) & 0xF) * x[i];
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < 16; ++c) out[m].v[c] = float(s[m][c]);
  }
}
#endif

}  // namespace cpu_backend
