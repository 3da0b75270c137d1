// VecF32x16 on AVX2: two __m256. Built into _kernels_avx2.so (-mavx2 -mfma
// -mf16c) and _kernels_avx_vnni.so (the same plus -mavxvnni and
// CPU_BACKEND_HAS_AVX_VNNI, which only the int8 dot products read).
#pragma once

#include <immintrin.h>

#include "vec_common.h"

namespace cpu_backend {

#if defined(CPU_BACKEND_HAS_AVX_VNNI)
#define CPU_BACKEND_ISA_NAME "avx_vnni"
#else
#define CPU_BACKEND_ISA_NAME "avx2"
#endif

struct VecF32x16 {
  __m256 lo, hi;

  static CB_ALWAYS_INLINE VecF32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static CB_ALWAYS_INLINE VecF32x16 broadcast(float f) {
    __m256 b = _mm256_set1_ps(f);
    return {b, b};
  }

  static CB_ALWAYS_INLINE VecF32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static CB_ALWAYS_INLINE VecF32x16 load(const bf16_t* p) {
    return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  // 16 (even, odd) bf16 pairs -> the 16 even and the 16 odd values as fp32
  // (a bf16 is the high half of its fp32): one load and two ALU ops per 8.
  static CB_ALWAYS_INLINE void load_pairs(const bf16_t* p, VecF32x16* even, VecF32x16* odd) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i high_half = _mm256_set1_epi32(int(0xffff0000u));
    even->lo = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    even->hi = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    odd->lo = _mm256_castsi256_ps(_mm256_and_si256(lo, high_half));
    odd->hi = _mm256_castsi256_ps(_mm256_and_si256(hi, high_half));
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp8_e5m2_t* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(load16(p)), 8);
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const fp8_e4m3_t* p) {
    return load_kv(p) * broadcast(kKvUnit<fp8_e4m3_t>);
  }
  // KV-cache elements in kernel units (vec_common.h kKvUnit).
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load_kv(const T* p) {
    return load(p);
  }
  static CB_ALWAYS_INLINE VecF32x16 load_kv(const fp8_e4m3_t* p) {
    const __m256i h = e4m3_as_half(_mm256_cvtepi8_epi16(load16(p)));
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  }
  static CB_ALWAYS_INLINE VecF32x16 load(const int8_t* p) {
    const __m128i b = load16(p);
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load_partial(const T* p, int n) {
    alignas(64) T tmp[16] = {};
    for (int i = 0; i < n; ++i) tmp[i] = p[i];
    return load(tmp);
  }

  CB_ALWAYS_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  CB_ALWAYS_INLINE void store(bf16_t* p) const {
    __m256i packed = _mm256_packus_epi32(narrow_bf16(lo), narrow_bf16(hi));  // lanes: lo0-3 hi0-3 lo4-7 hi4-7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  CB_ALWAYS_INLINE void store(fp16_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <typename T>
  CB_ALWAYS_INLINE void store_partial(T* p, int n) const {
    alignas(64) T tmp[16];
    store(tmp);
    for (int i = 0; i < n; ++i) p[i] = tmp[i];
  }

  friend CB_ALWAYS_INLINE VecF32x16 fma(VecF32x16 a, VecF32x16 b, VecF32x16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator+(VecF32x16 a, VecF32x16 b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator*(VecF32x16 a, VecF32x16 b) {
    return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator-(VecF32x16 a, VecF32x16 b) {
    return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator/(VecF32x16 a, VecF32x16 b) {
    return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
  }
  // x86 MAXPS/MINPS semantics (vec_math.h relies on them): a > b ? a : b,
  // so a NaN in b is returned.
  friend CB_ALWAYS_INLINE VecF32x16 max(VecF32x16 a, VecF32x16 b) {
    return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
  }
  friend CB_ALWAYS_INLINE VecF32x16 min(VecF32x16 a, VecF32x16 b) {
    return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
  }
  // a < b ? x : y, per lane
  friend CB_ALWAYS_INLINE VecF32x16 select_lt(VecF32x16 a, VecF32x16 b, VecF32x16 x, VecF32x16 y) {
    return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
            _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
  }
  // Whether a < b in any lane.
  friend CB_ALWAYS_INLINE bool any_lt(VecF32x16 a, VecF32x16 b) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))) != 0;
  }
  // Bit i set where !(a < b) in lane i: a >= b, or either is NaN.
  friend CB_ALWAYS_INLINE int mask_nlt(VecF32x16 a, VecF32x16 b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_NLT_UQ)) |
           (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_NLT_UQ)) << 8);
  }
  // Round to the nearest integer (ties to even), as a float.
  CB_ALWAYS_INLINE VecF32x16 round() const {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(lo, kMode), _mm256_round_ps(hi, kMode)};
  }
  // this * 2^n for integer-valued n in [-252, 254]: two exact power-of-two
  // factors, each a normal float, so results round like one scaling.
  CB_ALWAYS_INLINE VecF32x16 scale_pow2(VecF32x16 n) const {
    return {scale_pow2(lo, n.lo), scale_pow2(hi, n.hi)};
  }
  CB_ALWAYS_INLINE VecF32x16 abs() const {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return {_mm256_and_ps(lo, m), _mm256_and_ps(hi, m)};
  }
  // |this| with the sign of s
  CB_ALWAYS_INLINE VecF32x16 copysign(VecF32x16 s) const {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
    return {_mm256_or_ps(_mm256_andnot_ps(sign, lo), _mm256_and_ps(sign, s.lo)),
            _mm256_or_ps(_mm256_andnot_ps(sign, hi), _mm256_and_ps(sign, s.hi))};
  }
  CB_ALWAYS_INLINE float reduce_max() const {
    __m256 s = _mm256_max_ps(lo, hi);
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    q = _mm_max_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  CB_ALWAYS_INLINE float reduce_min() const {
    __m256 s = _mm256_min_ps(lo, hi);
    __m128 q = _mm_min_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_min_ps(q, _mm_movehl_ps(q, q));
    q = _mm_min_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  CB_ALWAYS_INLINE float reduce_add() const {
    __m256 s = _mm256_add_ps(lo, hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }

 private:
  static CB_ALWAYS_INLINE __m128i load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  // 16 e4m3 bytes, sign-extended to 16 bits, as halves worth 2^-8 of their
  // value (vec_common.h to_f32): << 7 puts exponent and mantissa in place and
  // the sign in bit 15; bit 14, a copy of the sign, is cleared.
  static CB_ALWAYS_INLINE __m256i e4m3_as_half(__m256i b) {
    return _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xbfff)));
  }
  static CB_ALWAYS_INLINE __m256 pow2i(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  }
  static CB_ALWAYS_INLINE __m256 scale_pow2(__m256 x, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    return _mm256_mul_ps(_mm256_mul_ps(x, pow2i(n1)), pow2i(_mm256_sub_epi32(ni, n1)));
  }
  static CB_ALWAYS_INLINE __m256 widen_bf16(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // 8 floats -> 8 bf16 in the low half of each 32-bit lane (RNE, NaN quiet).
  static CB_ALWAYS_INLINE __m256i narrow_bf16(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(nan));
  }
};

// [v[0].reduce_add(), ..., v[15].reduce_add()]: each vector's halves added,
// then per 8 vectors a tree of horizontal adds and one 128-bit lane exchange.
static CB_ALWAYS_INLINE __m256 reduce_add8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
static CB_ALWAYS_INLINE VecF32x16 reduce_add16(const VecF32x16 v[16]) {
  __m256 a[16];
  for (int k = 0; k < 16; ++k) a[k] = _mm256_add_ps(v[k].lo, v[k].hi);
  return {reduce_add8(a), reduce_add8(a + 8)};
}

}  // namespace cpu_backend
