// AMX tile kernels, for the amx library only: the bf16 x bf16 linear
// (TDPBF16PS, the GEMM half of linear.cpp) and the W8A8 int8 block (TDPBUSD,
// for linear_w8a8.cpp) on Sapphire Rapids and newer. See linear_amx.cpp.
#pragma once

#if defined(CPU_BACKEND_HAS_AMX)

#include <cstdint>

#include "dtype.h"

namespace cpu_backend {

// Fewer rows than this stay on the vector (VDPBF16PS, VPDPBUSD) kernels: a
// tile holds 16 rows, and a GEMV is bound by reading the weight, not by the
// dot products.
constexpr int64_t kAmxMinRows = 16;

// Whether this process may use AMX tiles: Linux grants the tile state on
// request (arch_prctl ARCH_REQ_XCOMP_PERM), once per process.
bool amx_usable();

// The calling thread's tile configuration, set for the object's lifetime
// (around any amx_int8_block calls; a task scope of parallel_panels).
void amx_begin();
void amx_end();
struct AmxTiles {
  AmxTiles() { amx_begin(); }
  ~AmxTiles() { amx_end(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// c[2][32][16] int32 (panel 0, then panel 1; rows at a stride of 16) = the 32
// byte rows at a (stride lda; 4 * ceil(K4 / 16) * 16 bytes readable per row)
// times the W8A8 panels w0 and w1 ([K4][16 columns][4 k] int8), with TDPBUSD
// (unsigned activation bytes x signed weights, as VPDPBUSD: vec/vec_int8.h).
void amx_int8_block(const uint8_t* a, int64_t lda, const int8_t* w0, const int8_t* w1, int64_t K4,
                    int32_t* c);

// out[M, N] = x[M, K] @ W^T + bias for the pair-interleaved bf16 panels of
// linear.cpp ([ceil(N/32)][K][32], K even); bias is fp32 padded to whole
// panels, or null.
template <typename OT>
void linear_amx_bf16(const bf16_t* x, int64_t ldx, int64_t M, int64_t N, int64_t K,
                     const bf16_t* packed, const float* bias, OT* out);

}  // namespace cpu_backend

#endif
