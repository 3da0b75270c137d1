// The symmetric int8 activation rule shared by the W8A8 linear
// (linear_w8a8.cpp, dynamic per token) and the W4A8 path of the weight-only
// linear (linear_wna16.cpp, per 32 inputs): s = max|x| / 127 (1 for all
// zeros), q = round(x / s) in fp32, half to even, clamped to [-127, 127]
// (never -128: the AVX2 sign trick of vec/vec_int8.h needs that).
#pragma once

#include <algorithm>
#include <cstdint>

namespace cpu_backend {

inline float int8_sym_scale(float amax) { return amax > 0.0f ? amax / 127.0f : 1.0f; }

inline int32_t clamp_q(float r) { return int32_t(std::min(127.0f, std::max(-127.0f, r))); }

}  // namespace cpu_backend
