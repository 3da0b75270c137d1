// int8 x int8 -> int32 micro-kernel for the W8A8 linear (linear_w8a8.cpp).
// One branch per ISA family, matching vec.h's selection (AVX-512 and AVX-VNNI
// share one VNNI tile over their vector width).
//
// Weight panel layout (made once at load, cpu_backend/quantization/w8a8.py):
//   [K4][16 columns][4 k] int8, K4 = ceil(K / 4), k >= K zero. One k4 step of
//   a panel is 64 bytes: column j's 4 consecutive k at bytes 4j..4j+3 (the
//   VNNI operand layout).
// Activations: one row of Kp = 4 K4 bytes per token, in the form the ISA's
//   dot product wants (kActXor below is applied when they are quantized).
//
// int8_tile<MR, NP>(a, lda, w, wstride, K4, c) covers NP panels (the ISA's
// kInt8NP, or 1 for a last odd panel), panel i at w + i * wstride, and writes
// c[i][m][j] (panel i's [MR][16] block at c + i * MR * 16) = sum_k act[m][k] *
// w_i[k][j] minus kActOffset * sum_k w_i[k][j], i.e. plus kActOffset * wsum
// it is the exact int32 product of the stored activation bytes and the weights.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec_common.h"
#if !defined(CPU_BACKEND_ISA_PORTABLE)
#include <immintrin.h>
#endif

namespace cpu_backend {

static CB_ALWAYS_INLINE int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(CPU_BACKEND_ISA_AVX512) || (defined(CPU_BACKEND_ISA_AVX2) && defined(CPU_BACKEND_HAS_AVX_VNNI))
// VNNI (AVX-512 VNNI, or AVX-VNNI: the 256-bit VEX form on AVX2 CPUs without
// AVX-512): VPDPBUSD multiplies unsigned bytes by signed bytes and adds the
// four products of each 32-bit lane into an int32 accumulator with no
// intermediate saturation: one instruction per 16 (ymm: 8) columns x 4 k.
// Activations (int8, [-127, 127]) are stored offset to unsigned (a ^ 0x80 ==
// a + 128), so the sum carries +128 * sum_k w per column, which the caller
// subtracts (kActOffset, with wsum from the repack).
constexpr uint8_t kActXor = 0x80;
constexpr int32_t kActOffset = 128;

#if defined(CPU_BACKEND_ISA_AVX512)
// Two panels per call: each broadcast activation feeds two VPDPBUSD (one
// broadcast per instruction left the loads, not the dot products, limiting:
// 1.2-1.3x at 16-64 rows). 2 * MR accumulators + 2 w + 1 a of 32 registers.
constexpr int kInt8MR = 8;
constexpr int kInt8NP = 2;
struct VnniOps {
  using V = __m512i;
  static constexpr int kPerPanel = 1;  // vectors per 16-column panel step
  static CB_ALWAYS_INLINE V zero() { return _mm512_setzero_si512(); }
  static CB_ALWAYS_INLINE V load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static CB_ALWAYS_INLINE V broadcast(int32_t v) { return _mm512_set1_epi32(v); }
  static CB_ALWAYS_INLINE V dot(V acc, V a, V w) { return _mm512_dpbusd_epi32(acc, a, w); }
  static CB_ALWAYS_INLINE V add(V x, V y) { return _mm512_add_epi32(x, y); }
  static CB_ALWAYS_INLINE void store(int32_t* p, V v) { _mm512_storeu_si512(p, v); }
};
#else
// One panel is two ymm: 2 * MR accumulators + 2 w + 1 a of 16 registers.
constexpr int kInt8MR = 6;
constexpr int kInt8NP = 1;
struct VnniOps {
  using V = __m256i;
  static constexpr int kPerPanel = 2;
  static CB_ALWAYS_INLINE V zero() { return _mm256_setzero_si256(); }
  static CB_ALWAYS_INLINE V load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const V*>(p)); }
  static CB_ALWAYS_INLINE V broadcast(int32_t v) { return _mm256_set1_epi32(v); }
  static CB_ALWAYS_INLINE V dot(V acc, V a, V w) { return _mm256_dpbusd_avx_epi32(acc, a, w); }
  static CB_ALWAYS_INLINE V add(V x, V y) { return _mm256_add_epi32(x, y); }
  static CB_ALWAYS_INLINE void store(int32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<V*>(p), v); }
};
#endif

template <int MR, int NP>
static inline void int8_tile(const uint8_t* __restrict a, int64_t lda, const int8_t* __restrict w, int64_t wstride,
                             int64_t K4, int32_t* __restrict c) {
  using O = VnniOps;
  using V = typename O::V;
  constexpr int NV = NP * O::kPerPanel;  // vectors per row: vector j is panel j / kPerPanel's part j % kPerPanel
  constexpr int kBytes = 64 / O::kPerPanel, kCols = 16 / O::kPerPanel;
  // Few rows: KU independent accumulators per row and panel (VPDPBUSD latency ~5).
  constexpr int KU = MR * NP == 1 ? 4 : (MR * NP == 2 ? 2 : 1);
  V acc[KU][MR][NV];
  CB_UNROLL for (int u = 0; u < KU; ++u) {
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      CB_UNROLL for (int j = 0; j < NV; ++j) acc[u][m][j] = O::zero();
    }
  }
  auto step = [&](int64_t k, int u) CB_ALWAYS_INLINE_LAMBDA {
    V wv[NV];
    CB_UNROLL for (int j = 0; j < NV; ++j) {
      wv[j] = O::load(w + (j / O::kPerPanel) * wstride + k * 64 + (j % O::kPerPanel) * kBytes);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      const V av = O::broadcast(load_i32(a + m * lda + k * 4));
      CB_UNROLL for (int j = 0; j < NV; ++j) acc[u][m][j] = O::dot(acc[u][m][j], av, wv[j]);
    }
  };
  const int64_t k_end = (K4 / KU) * KU;
  for (int64_t k = 0; k < k_end; k += KU) {
    CB_UNROLL for (int u = 0; u < KU; ++u) step(k + u, u);
  }
  for (int64_t k = k_end; k < K4; ++k) step(k, 0);
  CB_UNROLL for (int m = 0; m < MR; ++m) {
    CB_UNROLL for (int j = 0; j < NV; ++j) {
      V s = acc[0][m][j];
      CB_UNROLL for (int u = 1; u < KU; ++u) s = O::add(s, acc[u][m][j]);
      O::store(c + ((j / O::kPerPanel) * MR + m) * 16 + (j % O::kPerPanel) * kCols, s);
    }
  }
}

#elif defined(CPU_BACKEND_ISA_AVX2)
// AVX2: VPMADDUBSW (u8 x s8, adjacent pairs summed into int16 WITH
// saturation) then VPMADDWD by ones (int16 pairs -> int32, exact).
// Saturation-free by the sign trick: the unsigned operand is |w| (at most
// 128; abs_epi8(-128) is 0x80 = 128 read as unsigned) and the signed operand
// is a * sign(w) (sign_epi8; a is in [-127, 127] so negation never wraps,
// which is why activations are quantized to [-127, 127]). Each pair sum is
// then at most 2 * 128 * 127 = 32512 < 32767, and |w| * (a sgn w) = a * w
// exactly (w = 0 gives 0 from both). The +128 offset trick would not do:
// (a + 128) * w reaches 2 * 255 * 128 and saturates.
constexpr uint8_t kActXor = 0;
constexpr int32_t kActOffset = 0;
constexpr int kInt8MR = 4;
constexpr int kInt8NP = 1;

template <int MR, int NP>
static inline void int8_tile(const uint8_t* __restrict a, int64_t lda, const int8_t* __restrict w, int64_t,
                             int64_t K4, int32_t* __restrict c) {
  static_assert(NP == 1, "one panel per call");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][2];
  CB_UNROLL for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K4; ++k) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64 + 32));
    const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256i av = _mm256_set1_epi32(load_i32(a + m * lda + k * 4));
      const __m256i p0 = _mm256_maddubs_epi16(aw0, _mm256_sign_epi8(av, w0));
      const __m256i p1 = _mm256_maddubs_epi16(aw1, _mm256_sign_epi8(av, w1));
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(p0, ones));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(p1, ones));
    }
  }
  CB_UNROLL for (int m = 0; m < MR; ++m) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + m * 16), acc[m][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + m * 16 + 8), acc[m][1]);
  }
}

#else
// Portable: plain int32 multiply-adds.
constexpr uint8_t kActXor = 0;
constexpr int32_t kActOffset = 0;
constexpr int kInt8MR = 4;
constexpr int kInt8NP = 1;

template <int MR, int NP>
static inline void int8_tile(const uint8_t* __restrict a, int64_t lda, const int8_t* __restrict w, int64_t,
                             int64_t K4, int32_t* __restrict c) {
  static_assert(NP == 1, "one panel per call");
  int32_t acc[MR][16] = {};
  for (int64_t k = 0; k < K4; ++k) {
    const int8_t* wk = w + k * 64;
    for (int m = 0; m < MR; ++m) {
      const int8_t* ak = reinterpret_cast<const int8_t*>(a + m * lda + k * 4);
      for (int j = 0; j < 16; ++j) {
        acc[m][j] += int32_t(ak[0]) * wk[4 * j] + int32_t(ak[1]) * wk[4 * j + 1] +
                     int32_t(ak[2]) * wk[4 * j + 2] + int32_t(ak[3]) * wk[4 * j + 3];
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(c + m * 16, acc[m], sizeof(acc[m]));
}
#endif

}  // namespace cpu_backend
