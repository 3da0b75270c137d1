// Unsigned weights below 64 in 8-bit fields times signed 8-bit activations,
// for the int8_act option of the weight-only linear at bits=6 (GGUF's 5- and
// 6-bit block types, linear_wna16.cpp). One branch per ISA family.
//
// Weights: linear_wna16's 64-byte 8-bit blocks (16 words, one per column;
// byte i of a word is input 4b + i). Activations as pack_rows_a8 stores them
// without interleaving: per 8 inputs and row two int32, the bytes of inputs
// (0..3) and (4..7), each in [-127, 127].
//
// u6s8_sum<MR, NB>(q, a, out): q = NB consecutive blocks of one panel (4 * NB
// inputs, NB even), a = [NB / 2][MR][2] int32; out[m] = float(sum of the
// 4 * NB products q * x) for the 16 columns, exact (|sum| <= 4 NB * 63 * 127).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"
#include "vec_u4s8.h"  // u4s8_join

namespace cpu_backend {

#if defined(CPU_BACKEND_ISA_AVX512) || defined(CPU_BACKEND_ISA_AVX2)
// VPMADDUBSW: u8 x s8, adjacent pairs summed into int16 with saturation,
// never reached: a pair is at most 2 * 63 * 127 = 16002, and two blocks'
// pairs are added (32004 < 32767) before VPMADDWD by ones widens them to
// int32. The AVX-512 build runs the same 256-bit code.
template <int MR, int NB>
static CB_ALWAYS_INLINE void u6s8_sum(const uint8_t* q, const int32_t* a, VecF32x16 (&out)[MR]) {
  static_assert(NB % 2 == 0, "blocks come in pairs (one int32 pair of activations)");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s32[MR][2];
  CB_UNROLL for (int m = 0; m < MR; ++m) s32[m][0] = s32[m][1] = _mm256_setzero_si256();
  CB_UNROLL for (int p = 0; p < NB / 2; ++p) {
    CB_UNROLL for (int h = 0; h < 2; ++h) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 * p + 32 * h));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 * p + 64 + 32 * h));
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const int32_t* ap = a + (p * MR + m) * 2;
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(ap[0])),
                                             _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ap[1])));
        s32[m][h] = _mm256_add_epi32(s32[m][h], _mm256_madd_epi16(s16, ones));
      }
    }
  }
  CB_UNROLL for (int m = 0; m < MR; ++m) {
    out[m] = u4s8_join(_mm256_cvtepi32_ps(s32[m][0]), _mm256_cvtepi32_ps(s32[m][1]));
  }
}

#else
// Portable: the same sums with plain integer multiply-adds.
template <int MR, int NB>
static inline void u6s8_sum(const uint8_t* q, const int32_t* a, VecF32x16 (&out)[MR]) {
  int32_t s[MR][16] = {};
  for (int b = 0; b < NB; ++b) {
    for (int m = 0; m < MR; ++m) {
      int8_t x[4];
      std::memcpy(x, a + ((b / 2) * MR + m) * 2 + (b % 2), 4);
      for (int c = 0; c < 16; ++c) {
        const uint8_t* w = q + 64 * b + 4 * c;
        for (int i = 0; i < 4; ++i) s[m][c] += int32_t(w[i]) * x[i];
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < 16; ++c) out[m].v[c] = float(s[m][c]);
  }
}
#endif

}  // namespace cpu_backend
