// The GEMM epilogue shared by linear.cpp and linear_amx.cpp: an fp32 tile of
// mr rows x NV * 16 columns plus the bias, narrowed into the output rows.
#pragma once

#include <cstdint>

#include "vec/vec.h"

namespace cpu_backend {

// tile rows (stride NV * 16 floats) + bias -> out rows (only the nn valid columns)
template <int NV, typename OT>
inline void store_tile_rows(const float* tile, int mr, const float* bias, OT* out, int64_t ldo, int nn) {
  using Vec = VecF32x16;
  for (int m = 0; m < mr; ++m) {
    OT* dst = out + m * ldo;
    CB_UNROLL for (int v = 0; v < NV; ++v) {
      Vec r = Vec::load(tile + m * NV * 16 + v * 16);
      if (bias) r = r + Vec::load(bias + v * 16);
      const int cols = nn - v * 16;
      if (cols >= 16) {
        r.store(dst + v * 16);
      } else if (cols > 0) {
        r.store_partial(dst + v * 16, cols);
      }
    }
  }
}

}  // namespace cpu_backend
