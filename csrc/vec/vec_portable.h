// VecF32x16 in plain C++ (float[16] loops): baseline x86-64 or any arch.
#pragma once

#include <cmath>

#include "vec_common.h"

namespace cpu_backend {

#define CPU_BACKEND_ISA_NAME "portable"

struct VecF32x16 {
  float v[16];

  static CB_ALWAYS_INLINE VecF32x16 zero() { return broadcast(0.0f); }
  static CB_ALWAYS_INLINE VecF32x16 broadcast(float f) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = f;
    return r;
  }
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load(const T* p) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = to_f32(p[i]);
    return r;
  }
  // KV-cache elements in kernel units (vec_common.h kKvUnit).
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load_kv(const T* p) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = to_f32_kv(p[i]);
    return r;
  }
  template <typename T>
  static CB_ALWAYS_INLINE VecF32x16 load_partial(const T* p, int n) {
    VecF32x16 r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = to_f32(p[i]);
    return r;
  }
  template <typename T>
  CB_ALWAYS_INLINE void store(T* p) const {
    for (int i = 0; i < 16; ++i) p[i] = from_f32<T>(v[i]);
  }
  template <typename T>
  CB_ALWAYS_INLINE void store_partial(T* p, int n) const {
    for (int i = 0; i < n; ++i) p[i] = from_f32<T>(v[i]);
  }

  friend CB_ALWAYS_INLINE VecF32x16 fma(VecF32x16 a, VecF32x16 b, VecF32x16 c) {
    // a*b+c rounded twice unless the compiler contracts it: both are within
    // the tolerance the tests allow for fp32 accumulation.
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator+(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator*(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator-(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i];
    return r;
  }
  friend CB_ALWAYS_INLINE VecF32x16 operator/(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] / b.v[i];
    return r;
  }
  // x86 MAXPS/MINPS semantics (vec_math.h relies on them): a > b ? a : b,
  // so a NaN in b is returned.
  friend CB_ALWAYS_INLINE VecF32x16 max(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  friend CB_ALWAYS_INLINE VecF32x16 min(VecF32x16 a, VecF32x16 b) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  // a < b ? x : y, per lane
  friend CB_ALWAYS_INLINE VecF32x16 select_lt(VecF32x16 a, VecF32x16 b, VecF32x16 x, VecF32x16 y) {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] < b.v[i] ? x.v[i] : y.v[i];
    return r;
  }
  // Whether a < b in any lane.
  friend CB_ALWAYS_INLINE bool any_lt(VecF32x16 a, VecF32x16 b) {
    bool r = false;
    for (int i = 0; i < 16; ++i) r |= a.v[i] < b.v[i];
    return r;
  }
  // Bit i set where !(a < b) in lane i: a >= b, or either is NaN.
  friend CB_ALWAYS_INLINE int mask_nlt(VecF32x16 a, VecF32x16 b) {
    int r = 0;
    for (int i = 0; i < 16; ++i) r |= int(!(a.v[i] < b.v[i])) << i;
    return r;
  }
  // Round to the nearest integer (ties to even in the default rounding mode).
  CB_ALWAYS_INLINE VecF32x16 round() const {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(v[i]);
    return r;
  }
  // this * 2^n for integer-valued n (NaN n: NaN).
  CB_ALWAYS_INLINE VecF32x16 scale_pow2(VecF32x16 n) const {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = n.v[i] == n.v[i] ? std::ldexp(v[i], int(n.v[i])) : n.v[i];
    return r;
  }
  CB_ALWAYS_INLINE VecF32x16 abs() const {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fabs(v[i]);
    return r;
  }
  // |this| with the sign of s
  CB_ALWAYS_INLINE VecF32x16 copysign(VecF32x16 s) const {
    VecF32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::copysign(v[i], s.v[i]);
    return r;
  }
  CB_ALWAYS_INLINE float reduce_max() const {
    float m = v[0];
    for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  CB_ALWAYS_INLINE float reduce_min() const {
    float m = v[0];
    for (int i = 1; i < 16; ++i) m = v[i] < m ? v[i] : m;
    return m;
  }
  CB_ALWAYS_INLINE float reduce_add() const {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
  }
};

// [v[0].reduce_add(), ..., v[15].reduce_add()]
static CB_ALWAYS_INLINE VecF32x16 reduce_add16(const VecF32x16 v[16]) {
  VecF32x16 r;
  for (int k = 0; k < 16; ++k) r.v[k] = v[k].reduce_add();
  return r;
}

}  // namespace cpu_backend
