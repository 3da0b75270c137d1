// The symmetric int8 activation rule shared by the W8A8 linear
// (linear_w8a8.cpp, dynamic per token) and the W4A8 path of the weight-only
// linear (linear_wna16.cpp, per 32 inputs): s = max|x| / 127 (1 for all
// zeros), q = round(x / s) in fp32, half to even, clamped to [-127, 127]
// (never -128: the AVX2 sign trick of vec/vec_int8.h needs that).
// The vector forms below give the same bits as the scalar ones for finite x
// (max, min, division and round-half-even are exact per lane); they exist
// because the scalar max over a row is one dependent 4-cycle instruction per
// input, which was most of the activation quantization's time.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vec/vec.h"

namespace cpu_backend {

inline float int8_sym_scale(float amax) { return amax > 0.0f ? amax / 127.0f : 1.0f; }

inline int32_t clamp_q(float r) { return int32_t(std::min(127.0f, std::max(-127.0f, r))); }

// clamp_q(round(v / s)) per lane, as floats (integers in [-127, 127]).
static CB_ALWAYS_INLINE VecF32x16 quantize_sym(VecF32x16 v, VecF32x16 s) {
  return min(max((v / s).round(), VecF32x16::broadcast(-127.0f)), VecF32x16::broadcast(127.0f));
}

// Minimum and maximum of x[0..K), K >= 1, 16 lanes at a time (the last
// vector overlaps the one before it: min and max do not mind).
template <typename XT>
inline void min_max(const XT* x, int64_t K, float* mn, float* mx) {
  if (K < 16) {
    float lo = to_f32(x[0]), hi = lo;
    for (int64_t k = 1; k < K; ++k) {
      lo = std::min(lo, to_f32(x[k]));
      hi = std::max(hi, to_f32(x[k]));
    }
    *mn = lo;
    *mx = hi;
    return;
  }
  VecF32x16 lo = VecF32x16::load(x), hi = lo;
  for (int64_t k = 16; k < K; k += 16) {
    const VecF32x16 v = VecF32x16::load(x + std::min(k, K - 16));
    lo = min(lo, v);
    hi = max(hi, v);
  }
  *mn = lo.reduce_min();
  *mx = hi.reduce_max();
}

}  // namespace cpu_backend
