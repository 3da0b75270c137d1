// VecF32x16 on AVX-512: one __m512. Built only into _kernels_avx512.so
// (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include "vec_common.h"

namespace cpu_backend {

#if defined(CPU_BACKEND_HAS_AMX)
#define CPU_BACKEND_ISA_NAME "amx"  // the avx512 kernels plus AMX tiles (linear_amx.cpp)
#else
#define CPU_BACKEND_ISA_NAME "avx512"
#endif
// bf16 weights are packed pair-interleaved and multiplied with VDPBF16PS.
#define CPU_BACKEND_HAS_DPBF16 1

struct VecF32x16 {
  __m512 v;

  static CB_ALWAYS_INLINE VecF32x16 zero() { return {_mm512_setzero_ps()}; }
  static CB_ALWAYS_INLINE VecF32x16 broadcast(float f) { return {_mm512_set1_ps(f)}; }

  static CB_ALWAYS_INLINE VecF32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static CB_ALWAYS_INLINE VecF32x16 load(const bf16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp8_e5m2_t* p) {
    return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load16(p)), 8))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp8_e4m3_t* p) {
    return {_mm512_mul_ps(load_kv(p).v, _mm512_set1_ps(kKvUnit<fp8_e4m3_t>))};
  }
  // KV-cache elements in kernel units (vec_common.h kKvUnit).
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load_kv(const T* p) {
    return load(p);
  }
  static CB_ALWAYS_INLINE VecF32x16 load_kv(const fp8_e4m3_t* p) {
    return {_mm512_cvtph_ps(e4m3_as_half(_mm256_cvtepi8_epi16(load16(p))))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(p)))};
  }
  // n in [0, 16]: lanes >= n are zero and their memory is not touched.
  static CB_ALWAYS_INLINE VecF32x16 load_partial(const float* p, int n) {
    return {_mm512_maskz_loadu_ps(mask(n), p)};
  }
  static CB_ALWAYS_INLINE VecF32x16 load_partial(const bf16_t* p, int n) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(n), p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load_partial(const fp16_t* p, int n) {
    return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p))};
  }

  CB_ALWAYS_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  CB_ALWAYS_INLINE void store(bf16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16());
  }
  CB_ALWAYS_INLINE void store(fp16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_fp16());
  }
  CB_ALWAYS_INLINE void store_partial(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  CB_ALWAYS_INLINE void store_partial(bf16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, mask(n), narrow_bf16());
  }
  CB_ALWAYS_INLINE void store_partial(fp16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, mask(n), narrow_fp16());
  }

  // p: 16 columns x 2 k as bf16 pairs [c0k0 c0k1 c1k0 c1k1 ...]: k0 -> *even, k1 -> *odd.
  static CB_ALWAYS_INLINE void load_pairs(const bf16_t* p, VecF32x16* even, VecF32x16* odd) {
    __m512i u = _mm512_loadu_si512(p);
    even->v = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    odd->v = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }

  friend CB_ALWAYS_INLINE VecF32x16 fma(VecF32x16 a, VecF32x16 b, VecF32x16 c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator+(VecF32x16 a, VecF32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend CB_ALWAYS_INLINE VecF32x16 operator*(VecF32x16 a, VecF32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend CB_ALWAYS_INLINE VecF32x16 operator-(VecF32x16 a, VecF32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend CB_ALWAYS_INLINE VecF32x16 operator/(VecF32x16 a, VecF32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  // x86 MAXPS/MINPS semantics (vec_math.h relies on them): a > b ? a : b,
  // so a NaN in b is returned.
  friend CB_ALWAYS_INLINE VecF32x16 max(VecF32x16 a, VecF32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend CB_ALWAYS_INLINE VecF32x16 min(VecF32x16 a, VecF32x16 b) { return {_mm512_min_ps(a.v, b.v)}; }
  // a < b ? x : y, per lane
  friend CB_ALWAYS_INLINE VecF32x16 select_lt(VecF32x16 a, VecF32x16 b, VecF32x16 x, VecF32x16 y) {
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), y.v, x.v)};
  }
  // Whether a < b in any lane.
  friend CB_ALWAYS_INLINE bool any_lt(VecF32x16 a, VecF32x16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ) != 0; }
  // Bit i set where !(a < b) in lane i: a >= b, or either is NaN.
  friend CB_ALWAYS_INLINE int mask_nlt(VecF32x16 a, VecF32x16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_NLT_UQ); }
  // Round to the nearest integer (ties to even), as a float.
  CB_ALWAYS_INLINE VecF32x16 round() const {
    return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  // this * 2^n for integer-valued n (overflow -> inf, underflow -> subnormal/0).
  CB_ALWAYS_INLINE VecF32x16 scale_pow2(VecF32x16 n) const { return {_mm512_scalef_ps(v, n.v)}; }
  CB_ALWAYS_INLINE VecF32x16 abs() const {
    return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)))};
  }
  // |this| with the sign of s
  CB_ALWAYS_INLINE VecF32x16 copysign(VecF32x16 s) const {
    return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v), _mm512_castps_si512(s.v),
                                                          _mm512_set1_epi32(0x7fffffff), 0xE4))};
  }
  CB_ALWAYS_INLINE float reduce_add() const { return _mm512_reduce_add_ps(v); }
  CB_ALWAYS_INLINE float reduce_max() const { return _mm512_reduce_max_ps(v); }
  CB_ALWAYS_INLINE float reduce_min() const { return _mm512_reduce_min_ps(v); }

 private:
  static CB_ALWAYS_INLINE __m128i load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  // 16 e4m3 bytes, sign-extended to 16 bits, as halves worth 2^-8 of their
  // value (vec_common.h to_f32): << 7 puts exponent and mantissa in place and
  // the sign in bit 15; bit 14, a copy of the sign, is cleared.
  static CB_ALWAYS_INLINE __m256i e4m3_as_half(__m256i b) {
    return _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xbfff)));
  }
  static CB_ALWAYS_INLINE __mmask16 mask(int n) { return __mmask16((1u << n) - 1u); }
  // Round to nearest even in integer arithmetic (same bits as the portable
  // path, subnormals kept), NaN -> quiet NaN.
  CB_ALWAYS_INLINE __m256i narrow_bf16() const {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
  }
  CB_ALWAYS_INLINE __m256i narrow_fp16() const {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

// 16 lanes of bf16 pairs (32 bf16) for VDPBF16PS.
struct VecBF16x32 {
  __m512i v;
  static CB_ALWAYS_INLINE VecBF16x32 load(const bf16_t* p) { return {_mm512_loadu_si512(p)}; }
  // 16 bf16 as pairs (x, 0): the odd row of a panel whose K is odd
  static CB_ALWAYS_INLINE VecBF16x32 load_zero_odd(const bf16_t* p) {
    return {_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static CB_ALWAYS_INLINE VecBF16x32 broadcast_pair(uint32_t pair) { return {_mm512_set1_epi32(int(pair))}; }
};

// acc[i] += a.k0[i] * b.k0[i] + a.k1[i] * b.k1[i]  (fp32 accumulate)
static CB_ALWAYS_INLINE VecF32x16 dot2_bf16(VecF32x16 acc, VecBF16x32 a, VecBF16x32 b) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)a.v, (__m512bh)b.v)};
}

// [v[0].reduce_add(), ..., v[15].reduce_add()]: a transpose-and-add tree.
// unpack{lo,hi}_ps pairs vectors within 128-bit lanes, unpack{lo,hi}_pd
// pairs those, then two rounds of 128-bit lane shuffles finish the sums and
// leave them in order.
static CB_ALWAYS_INLINE VecF32x16 reduce_add16(const VecF32x16 v[16]) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k)
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k].v, v[2 * k + 1].v),
                         _mm512_unpackhi_ps(v[2 * k].v, v[2 * k + 1].v));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(x[2 * k]), b = _mm512_castps_pd(x[2 * k + 1]);
    y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd))};
}

}  // namespace cpu_backend
