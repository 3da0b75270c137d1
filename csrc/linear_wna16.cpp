// Weight-only quantized linear (GPTQ / AWQ / compressed-tensors W4A16, W8A16):
// y = x @ dequant(W)^T + b with W stored as unsigned 4- or 8-bit integers.
//
// Layout (made once at load by cpu_backend.quantization.formats.kernel_layout):
//   qweight [P = ceil(N/16)][B][64] uint8: panel p holds the 16 columns
//     n = 16p..16p+15 (columns >= N are zero); its K inputs, sorted by group,
//     are cut into words of KW = 32/BITS inputs (8 for u4, 4 for u8), each
//     group padded with zero weights to whole words (gsp = round_up(gs, KW));
//     block b is 16 little-endian uint32 words, word c = sum_i
//     q[16p + c][KW*b + i] << (BITS*i). B = G * gsp / KW.
//   scales, zs [P][G][16] fp32, G = K / group_size: the weight is
//     q * scale + zs (zs = -zero * scale, so asymmetric and symmetric are one
//     path). Padded columns have scale 0. Symmetric weights (every zero
//     2^(BITS-1)) may come with an empty zs: the kernels then take
//     -2^(BITS-1) * scale, the same value exactly, and read 4 bytes per group
//     and column fewer (68 instead of 72 for a 4-bit g128 weight).
//   perm [K] int64 (optional): row k of the weight multiplies x[:, perm[k]]
//     (GPTQ act-order: rows sorted by g_idx so every group is contiguous).
// Compute: x rows are packed to fp32 chunks [G * gsp][mr] (gathered through
// perm, zero in group padding), each value times 2^-(BITS*i) for field i of
// its word (vec_quant.h: field i is converted in place, as q * 2^(BITS*i),
// so one 64-byte load gives KW rows of 16 columns for one AND and one
// conversion each). Per group the exact integer products are accumulated,
// then scaled once and the zero term added from the group's sum of x. Two
// other paths: 4-bit weights with bf16 x on the avx512 build (AVX512-BF16)
// run Q4PairKernel (two inputs per VDPBF16PS); from kDenseRows rows each
// task dequantizes its panel once and runs DenseKernel. With int8_act (W4A8,
// 4-bit weights, groups of multiples of 32) x is quantized to int8 per 32
// inputs instead and Q4A8Kernel multiplies in integers (vec/vec_u4s8.h), at
// any number of rows. bits=6 is the 8-bit layout holding values below 64
// (GGUF's 5- and 6-bit block types; the symmetric zero is 32): the float
// paths treat it as 8-bit, and with int8_act (groups of 16 or multiples of
// 32) Q6A8Kernel multiplies it in integers (vec/vec_u6s8.h). Same work split
// as linear.cpp (panels x row blocks with at::parallel_for).
// Registered here with TORCH_LIBRARY_FRAGMENT so registration.cpp stays
// untouched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "dtype.h"
#include "int8_quant.h"
#include "panel_tasks.h"
#include "tile_store.h"
#include "vec/vec.h"
#include "vec/vec_quant.h"
#include "vec/vec_u4s8.h"
#include "vec/vec_u6s8.h"

namespace cpu_backend {
namespace {

using Vec = VecF32x16;
constexpr int kNR = 16;
// kMR: rows per call of the quantized kernel; kMRD: of the dense kernel.
// From kDenseRows rows on, each task dequantizes its panel to fp32 once and
// runs the dense kernel on it, so the unpacking is shared by all its row
// chunks. Measured (Qwen2.5-0.5B linears, 2 threads): on AVX2 that is 1.05x
// at 16 rows and 1.25-1.3x at 64 (as fast as bf16 weights), slower at 8; on
// AVX-512 the quantized kernel's 8 rows already amortize the unpacking and the
// dense path was 1.2-2x slower at 8-64 rows, so it is off there.
#if defined(CPU_BACKEND_ISA_AVX512)
constexpr int kMR = 8;
constexpr int kMRD = 12;
constexpr int64_t kDenseRows = INT64_MAX;
#elif defined(CPU_BACKEND_ISA_AVX2)
constexpr int kMR = 3;   // 4*MR accumulators (acc, group acc) + 2 ymm w + 1 x
constexpr int kMRD = 6;  // 2*MR accumulators + 2 ymm w + 1 x
constexpr int64_t kDenseRows = 16;
#else
constexpr int kMR = 3;
constexpr int kMRD = 4;
constexpr int64_t kDenseRows = 16;
#endif


constexpr int64_t kBlockBytes = 64;  // 16 uint32 words

// Panel p's [G][16] rows of scales or zs; null stays null (symmetric zs).
static inline const float* panel_groups(const float* t, int64_t p, int64_t G) {
  return t ? t + p * G * kNR : nullptr;
}

// Group g's zero term: zs[g], or -2^(BITS-1) * scale for symmetric weights
// stored without zs (zs null; exact, a power of two).
template <int BITS>
static CB_ALWAYS_INLINE Vec zero_term(const float* zs, Vec sv, int64_t g) {
  return zs ? Vec::load(zs + g * kNR) : sv * Vec::broadcast(-float(1 << (BITS - 1)));
}


// Per group the kernels keep S accumulator sets of MR rows (independent
// chains); these zero them and, at the group's end, sum them and add the
// group: acc += sum * scale + asum * zs.
template <int S, int MR>
static CB_ALWAYS_INLINE void zero_sets(Vec (&sets)[S][MR]) {
  CB_UNROLL for (int u = 0; u < S; ++u) {
    CB_UNROLL for (int m = 0; m < MR; ++m) sets[u][m] = Vec::zero();
  }
}
template <int S, int MR>
static CB_ALWAYS_INLINE void add_group(Vec (&acc)[MR], const Vec (&sets)[S][MR], Vec sv, Vec zv,
                                       const float* asum) {
  CB_UNROLL for (int m = 0; m < MR; ++m) {
    Vec t = sets[0][m];
    CB_UNROLL for (int u = 1; u < S; ++u) t = t + sets[u][m];
    acc[m] = fma(Vec::broadcast(asum[m]), zv, fma(t, sv, acc[m]));
  }
}

// c[MR][16] = a-chunk [G*gsp][MR] @ dequantized panel. Per group: gacc =
// sum_k a[k] * q[k] (integer weights, exact in fp32; a carries the field
// scale), then acc += gacc * scale + asum * zs with asum[g][m] the group's
// sum of x: scale and zero cost two FMAs per group instead of one per k.
// ZB: the field width whose half is the symmetric zero (6 for bits=6 in 8-bit fields).
template <int BITS, int ZB = BITS>
struct QuantKernel {
  using AT = float;  // one fp32 x value per input
  static constexpr int kInputsPerA = 1;
  static constexpr int KW = 32 / BITS;

  template <int MR, int KU, int I>
  static CB_ALWAYS_INLINE void field(const uint8_t* q, const float* a, Vec (&gacc)[KU][MR]) {
    const Vec w = qfield<BITS, I>(q);
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      gacc[I % KU][m] = fma(Vec::broadcast(a[I * MR + m]), w, gacc[I % KU][m]);
    }
  }
  template <int MR, int KU, size_t... I>
  static CB_ALWAYS_INLINE void block(const uint8_t* q, const float* a, Vec (&gacc)[KU][MR],
                                     std::index_sequence<I...>) {
    (field<MR, KU, int(I)>(q, a, gacc), ...);
  }

  template <int MR>
  static void run(const float* __restrict a, const float* __restrict asum, const uint8_t* __restrict q,
                  const float* __restrict s, const float* __restrict zs, int64_t G, int64_t group_blocks,
                  float* __restrict c) {
    constexpr int KU = kSplitK<MR>;  // field i goes to accumulator set i % KU
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t g = 0; g < G; ++g) {
      Vec gacc[KU][MR];
      zero_sets(gacc);
      for (int64_t b = 0; b < group_blocks; ++b, q += kBlockBytes, a += KW * MR) {
        prefetch_panel<kBlockBytes>(q);
        block<MR, KU>(q, a, gacc, std::make_index_sequence<KW>{});
      }
      const Vec sv = Vec::load(s + g * kNR);
      add_group(acc, gacc, sv, zero_term<ZB>(zs, sv, g), asum + g * MR);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};

template <typename Kern, size_t... I>
constexpr auto make_table(std::index_sequence<I...>) {
  using Fn = void (*)(const typename Kern::AT*, const float*, const uint8_t*, const float*, const float*, int64_t,
                      int64_t, float*);
  return std::array<Fn, sizeof...(I)>{&Kern::template run<int(I) + 1>...};
}

#if defined(CPU_BACKEND_HAS_DPBF16)
// u4 weights with bf16 x on AVX512-BF16: fields (j, j+4) of a word become a
// bf16 pair (128 + q) and one VDPBF16PS takes two inputs of 16 columns (half
// the instructions per weight of QuantKernel<4>). x is packed as matching
// bf16 pairs, exact for bf16 x. Per group gacc = sum x (128 + q); the 128 is
// folded into the zero term: acc += gacc * scale + asum * (zs - 128 scale).
struct Q4PairKernel {
  using AT = uint32_t;  // two bf16 x values per a value
  static constexpr int kInputsPerA = 2;
  static constexpr int KW = 8;

  template <int MR, int KU, int J>
  static CB_ALWAYS_INLINE void pair(const uint8_t* q, const uint32_t* a, Vec (*gacc)[MR]) {
    const VecBF16x32 w = q4_bf16_pair<J>(q);
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      gacc[J % KU][m] = dot2_bf16(gacc[J % KU][m], VecBF16x32::broadcast_pair(a[J * MR + m]), w);
    }
  }
  template <int MR, int KU, size_t... J>
  static CB_ALWAYS_INLINE void block(const uint8_t* q, const uint32_t* a, Vec (*gacc)[MR],
                                     std::index_sequence<J...>) {
    prefetch_panel<kBlockBytes>(q);
    (pair<MR, KU, int(J)>(q, a, gacc), ...);
  }

  template <int MR>
  static void run(const uint32_t* __restrict a, const float* __restrict asum, const uint8_t* __restrict q,
                  const float* __restrict s, const float* __restrict zs, int64_t G, int64_t group_blocks,
                  float* __restrict c) {
    // Two blocks per step, each with its own KU accumulator sets: the
    // VDPBF16PS latency needs more independent chains than the FMA path.
    constexpr int KU = kSplitK<MR>;
    constexpr auto pairs = std::make_index_sequence<KW / 2>{};
    constexpr int64_t kA = KW / 2 * MR;  // a values per block
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t g = 0; g < G; ++g) {
      Vec gacc[2 * KU][MR];  // sets 0..KU-1: even blocks, KU..2KU-1: odd blocks
      zero_sets(gacc);
      int64_t b = 0;
      for (; b + 2 <= group_blocks; b += 2, q += 2 * kBlockBytes, a += 2 * kA) {
        block<MR, KU>(q, a, gacc, pairs);
        block<MR, KU>(q + kBlockBytes, a + kA, gacc + KU, pairs);
      }
      if (b < group_blocks) {
        block<MR, KU>(q, a, gacc, pairs);
        q += kBlockBytes;
        a += kA;
      }
      const Vec sv = Vec::load(s + g * kNR);
      add_group(acc, gacc, sv, fma(Vec::broadcast(-kQ4PairBias), sv, zero_term<4>(zs, sv, g)), asum + g * MR);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};
#endif

// W4A8 (int8_act, 4-bit weights, any number of rows): x quantized to int8
// per 32 inputs (scale sx), the products exact per 32 inputs (vec_u4s8.h):
// acc += isum * (scale * sx) per unit, then asum * zs per group with asum the
// group's sum of the dequantized x (sx * q). On AVX2 this is ~3x fewer
// instructions per weight than QuantKernel<4>, which is compute bound there.
constexpr int kMRA8 = 2;  // 2 * MR int16 sums + 2 * MR accumulators of 16 ymm

struct Q4A8Kernel {
  template <int MR>
  static void run(const int32_t* __restrict a, const float* __restrict sx, const float* __restrict asum,
                  const uint8_t* __restrict q, const float* __restrict s, const float* __restrict zs, int64_t G,
                  int64_t group_units, float* __restrict c) {
    constexpr int64_t kUnitBytes = kU4S8Blocks * kBlockBytes;
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t g = 0; g < G; ++g) {
      const Vec sv = Vec::load(s + g * kNR);
      for (int64_t u = 0; u < group_units; ++u, q += kUnitBytes, a += kU4S8Blocks * MR * 2, sx += MR) {
        prefetch_panel<kUnitBytes>(q);
        Vec isum[MR];
        u4s8_unit<MR>(q, a, isum);
        CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = fma(isum[m], sv * Vec::broadcast(sx[m]), acc[m]);
      }
      const Vec zv = zero_term<4>(zs, sv, g);
      CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = fma(Vec::broadcast(asum[g * MR + m]), zv, acc[m]);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};

// bits=6 with int8_act: 8-bit fields below 64 times x quantized to int8 per
// 32 inputs, the products exact per NB blocks (vec_u6s8.h; NB = 4, 16
// inputs, for groups of 16, else 8): acc += isum * (scale * sx) per NB
// blocks, then asum * zs per group (zs, or -32 * scale when symmetric).
template <int NB>
struct Q6A8Kernel {
  template <int MR>
  static void run(const int32_t* __restrict a, const float* __restrict sx, const float* __restrict asum,
                  const uint8_t* __restrict q, const float* __restrict s, const float* __restrict zs, int64_t G,
                  int64_t group_steps, float* __restrict c) {
    constexpr int64_t kStepBytes = NB * kBlockBytes;
    constexpr int64_t kStepInputs = 4 * NB;
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    int64_t k = 0;
    for (int64_t g = 0; g < G; ++g) {
      const Vec sv = Vec::load(s + g * kNR);
      for (int64_t t = 0; t < group_steps; ++t, q += kStepBytes, a += NB * MR, k += kStepInputs) {
        prefetch_panel<kStepBytes>(q);
        Vec isum[MR];
        u6s8_sum<MR, NB>(q, a, isum);
        const float* su = sx + (k / kU4S8Inputs) * MR;
        CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = fma(isum[m], sv * Vec::broadcast(su[m]), acc[m]);
      }
      const Vec zv = zero_term<6>(zs, sv, g);
      CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = fma(Vec::broadcast(asum[g * MR + m]), zv, acc[m]);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};

template <typename Kern, size_t... I>
constexpr auto make_a8_table(std::index_sequence<I...>) {
  using Fn = void (*)(const int32_t*, const float*, const float*, const uint8_t*, const float*, const float*,
                      int64_t, int64_t, float*);
  return std::array<Fn, sizeof...(I)>{&Kern::template run<int(I) + 1>...};
}

// The kernel's view of the input dimension: G groups of gs inputs, each
// padded to gsp = round_up(gs, KW) rows; field scales xs[i] for i < KW.
struct KLayout {
  int64_t G, gs, gsp;
  int kw;
  float xs[8];
};

template <int BITS, size_t... I>
KLayout make_layout(int64_t G, int64_t gs, std::index_sequence<I...>) {
  constexpr int KW = 32 / BITS;
  KLayout l{G, gs, ceil_div(gs, KW) * KW, KW, {}};
  ((l.xs[I] = QField<BITS, int(I)>::kXScale), ...);
  return l;
}

// Calls f(c, r, m, mr) for every row r of x, row m of the mr rows of chunk
// c (chunks of `chunk` rows), chunks in parallel; per_row sizes the grain.
template <typename F>
void for_chunk_rows(int64_t M, int chunk, int64_t per_row, F&& f) {
  const int64_t C = ceil_div(M, chunk);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, chunk * per_row));
  at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int mr = int(std::min<int64_t>(chunk, M - c * chunk));
      for (int m = 0; m < mr; ++m) f(c, c * chunk + m, m, mr);
    }
  });
}

// x rows (through perm when given) -> fp32 chunks of `chunk` rows laid out
// [G * gsp][mr], value times l.xs of its field, zero in group padding; and,
// unless asum is null, asum[c][g][mr] = the group's sum of the unscaled values.
template <typename XT>
void pack_rows(const XT* x, int64_t ldx, int64_t M, const KLayout& l, const int64_t* perm, int chunk,
               float* ap, float* asum) {
  const int64_t Kp = l.G * l.gsp;
  for_chunk_rows(M, chunk, Kp, [&](int64_t c, int64_t r, int m, int mr) {
    const XT* src = x + r * ldx;
    for (int64_t g = 0; g < l.G; ++g) {
      float* d = ap + c * chunk * Kp + g * l.gsp * mr + m;
      float t = 0.0f;
      for (int64_t j = 0; j < l.gs; ++j) {
        const int64_t k = g * l.gs + j;
        const float v = to_f32(perm ? src[perm[k]] : src[k]);
        t += v;
        d[j * mr] = v * l.xs[j & (l.kw - 1)];
      }
      for (int64_t j = l.gs; j < l.gsp; ++j) d[j * mr] = 0.0f;
      if (asum) asum[c * chunk * l.G + g * mr + m] = t;
    }
  });
}

#if defined(CPU_BACKEND_HAS_DPBF16)
// bf16 x rows -> chunks of kMR rows laid out [G * gsp / 2][mr] of bf16 pairs
// for Q4PairKernel: pair J of word b holds inputs 8b + J (low half) and
// 8b + J + 4 (high half), zero in group padding; asum as pack_rows.
void pack_rows_q4_pairs(const bf16_t* x, int64_t ldx, int64_t M, const KLayout& l, const int64_t* perm,
                        uint32_t* ap, float* asum) {
  const int64_t KA = l.G * l.gsp / 2;
  for_chunk_rows(M, kMR, KA, [&](int64_t c, int64_t r, int m, int mr) {
    const bf16_t* src = x + r * ldx;
    for (int64_t g = 0; g < l.G; ++g) {
      uint32_t* d = ap + c * kMR * KA + g * (l.gsp / 2) * mr + m;
      float t = 0.0f;
      auto input = [&](int64_t j) -> uint32_t {
        if (j >= l.gs) return 0;
        const int64_t k = g * l.gs + j;
        const bf16_t v = perm ? src[perm[k]] : src[k];
        t += to_f32(v);
        return v.x;
      };
      for (int64_t w = 0; w < l.gsp / 8; ++w) {
        for (int J = 0; J < 4; ++J) {
          const uint32_t lo = input(8 * w + J);
          const uint32_t hi = input(8 * w + J + 4);
          d[(4 * w + J) * mr] = lo | (hi << 16);
        }
      }
      asum[c * kMR * l.G + g * mr + m] = t;
    }
  });
}
#endif

// x rows -> int8 chunks of kMRA8 rows for Q4A8Kernel / Q6A8Kernel: per 32
// inputs (through perm when given) sx = max|x| / 127 (1 for all zeros) and
// q = round(x / sx) (fp32, half to even), stored per block of 8 inputs and row
// as two words: inputs (0, 2, 4, 6) and (1, 3, 5, 7) for 4-bit fields
// (kPairs), (0..3) and (4..7) for 8-bit ones: a [K / 8][mr][2], sx
// [K / 32][mr]; asum [G][mr] = the group's sum of sx * q (groups of 16 or
// multiples of 32).
template <bool kPairs, typename XT>
void pack_rows_a8(const XT* x, int64_t ldx, int64_t M, const KLayout& l, const int64_t* perm, int32_t* ap,
                  float* sx, float* asum) {
  const int64_t K = l.G * l.gs, U = K / kU4S8Inputs;
  const int step = int(std::min<int64_t>(l.gs, kU4S8Inputs));  // inputs of one group in a unit
  for_chunk_rows(M, kMRA8, K, [&](int64_t c, int64_t r, int m, int mr) {
    const XT* src = x + r * ldx;
    int32_t* a = ap + c * kMRA8 * (K / 4);
    float* cs = sx + c * kMRA8 * U;
    float* ca = asum + c * kMRA8 * l.G;
    for (int64_t g = 0; g < l.G; ++g) ca[g * mr + m] = 0.0f;
    for (int64_t u = 0; u < U; ++u) {
      const int64_t k0 = u * kU4S8Inputs;
      Vec v0, v1;
      if (perm) {
        alignas(64) float v[kU4S8Inputs];
        for (int j = 0; j < kU4S8Inputs; ++j) v[j] = to_f32(src[perm[k0 + j]]);
        v0 = Vec::load(v);
        v1 = Vec::load(v + 16);
      } else {
        v0 = Vec::load(src + k0);
        v1 = Vec::load(src + k0 + 16);
      }
      const float scale = int8_sym_scale(max(v0.abs(), v1.abs()).reduce_max());
      const Vec sv = Vec::broadcast(scale);
      alignas(64) float qf[kU4S8Inputs];
      quantize_sym(v0, sv).store(qf);
      quantize_sym(v1, sv).store(qf + 16);
      int8_t qv[kU4S8Inputs];
      for (int j = 0; j < kU4S8Inputs; ++j) qv[j] = int8_t(int32_t(qf[j]));
      for (int j0 = 0; j0 < kU4S8Inputs; j0 += step) {
        int32_t qsum = 0;
        for (int j = j0; j < j0 + step; ++j) qsum += qv[j];
        ca[((k0 + j0) / l.gs) * mr + m] += scale * float(qsum);
      }
      for (int b = 0; b < kU4S8Blocks; ++b) {
        int8_t ev[4], od[4];
        for (int j = 0; j < 4; ++j) {
          ev[j] = qv[8 * b + (kPairs ? 2 * j : j)];
          od[j] = qv[8 * b + (kPairs ? 2 * j + 1 : j + 4)];
        }
        int32_t* d = a + ((u * kU4S8Blocks + b) * mr + m) * 2;
        std::memcpy(d, ev, 4);
        std::memcpy(d + 1, od, 4);
      }
      cs[u * mr + m] = scale;
    }
  });
}

// Panel [B][64] -> fp32 [G * gsp][16] with w = q * scale + zs (group
// padding rows get zs; the packed x is zero there).
template <int BITS, int ZB = BITS>
struct Dequant {
  template <size_t... I>
  static CB_ALWAYS_INLINE void block(const uint8_t* q, Vec sv, Vec zv, float* w, std::index_sequence<I...>) {
    (fma(qfield<BITS, int(I)>(q), sv * Vec::broadcast(QField<BITS, int(I)>::kXScale), zv).store(w + I * kNR), ...);
  }
  static void panel(const uint8_t* q, const float* s, const float* zs, int64_t G, int64_t group_blocks, float* w) {
    constexpr int KW = 32 / BITS;
    for (int64_t g = 0; g < G; ++g) {
      const Vec sv = Vec::load(s + g * kNR), zv = zero_term<ZB>(zs, sv, g);
      for (int64_t b = 0; b < group_blocks; ++b, q += kBlockBytes, w += KW * kNR) {
        block(q, sv, zv, w, std::make_index_sequence<KW>{});
      }
    }
  }
};

// c[MR][16] = a-chunk [Kp][MR] @ fp32 panel [Kp][16].
struct DenseKernel {
  template <int MR>
  static void run(const float* __restrict a, const float* __restrict w, int64_t Kp, float* __restrict c) {
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t k = 0; k < Kp; ++k) {
      const Vec wv = Vec::load(w + k * kNR);
      CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = fma(Vec::broadcast(a[k * MR + m]), wv, acc[m]);
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};

template <size_t... I>
constexpr auto make_dense_table(std::index_sequence<I...>) {
  using Fn = void (*)(const float*, const float*, int64_t, float*);
  return std::array<Fn, sizeof...(I)>{&DenseKernel::template run<int(I) + 1>...};
}

// Every (panel p, chunk c of CH rows) tile, split over threads by
// parallel_panels. A task of panel p calls task(p) once (its set-up) for a
// chunk_fn; chunk_fn(c, mr, tile) fills chunk c's fp32 tile (mr rows), which
// is then stored with the bias.
template <int CH, typename OT, typename Task>
void for_tiles(int64_t M, int64_t N, int64_t work, const float* bias, OT* out, Task&& task) {
  const int64_t P = ceil_div(N, kNR);
  parallel_panels(P, ceil_div(M, CH), work, [&](int64_t p, int64_t c_begin, int64_t c_end) {
    alignas(64) float tile[CH * kNR];
    auto chunk_fn = task(p);
    const float* pb = bias ? bias + p * kNR : nullptr;
    const int nn = int(std::min<int64_t>(kNR, N - p * kNR));
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t r0 = c * CH;
      const int mr = int(std::min<int64_t>(CH, M - r0));
      chunk_fn(c, mr, tile);
      store_tile_rows<1>(tile, mr, pb, out + r0 * N + p * kNR, N, nn);
    }
  });
}

// Dense path: each task dequantizes its panel once, then DenseKernel per chunk.
template <int BITS, int ZB, typename OT>
void run_dense(const float* ap, const uint8_t* qw, const float* sc, const float* zs, const float* bias, OT* out,
               int64_t M, int64_t N, const KLayout& l) {
  static constexpr auto kernels = make_dense_table(std::make_index_sequence<kMRD>{});
  const int64_t Kp = l.G * l.gsp, group_blocks = l.gsp / l.kw;
  for_tiles<kMRD>(M, N, M * N * Kp, bias, out, [&](int64_t p) {
    thread_local std::vector<float> wbuf;
    if (wbuf.size() < size_t(Kp * kNR)) wbuf.resize(Kp * kNR);
    Dequant<BITS, ZB>::panel(qw + p * l.G * group_blocks * kBlockBytes, panel_groups(sc, p, l.G),
                         panel_groups(zs, p, l.G), l.G, group_blocks, wbuf.data());
    const float* w = wbuf.data();
    return [=](int64_t c, int mr, float* tile) { kernels[mr - 1](ap + c * kMRD * Kp, w, Kp, tile); };
  });
}

// Quantized path: Kern straight on the packed panel.
template <typename Kern, typename OT>
void run(const typename Kern::AT* ap, const float* asum, const uint8_t* qw, const float* sc, const float* zs,
         const float* bias, OT* out, int64_t M, int64_t N, const KLayout& l) {
  static constexpr auto kernels = make_table<Kern>(std::make_index_sequence<kMR>{});
  const int64_t Kp = l.G * l.gsp, group_blocks = l.gsp / l.kw;
  const int64_t KA = Kp / Kern::kInputsPerA;  // a values per row of a chunk
  for_tiles<kMR>(M, N, M * N * Kp, bias, out, [&](int64_t p) {
    const uint8_t* panel = qw + p * l.G * group_blocks * kBlockBytes;
    const float* ps = panel_groups(sc, p, l.G);
    const float* pz = panel_groups(zs, p, l.G);
    const int64_t G = l.G;
    return [=](int64_t c, int mr, float* tile) {
      kernels[mr - 1](ap + c * kMR * KA, asum + c * kMR * G, panel, ps, pz, G, group_blocks, tile);
    };
  });
}

// int8_act path: Kern (Q4A8Kernel, Q6A8Kernel) on the packed panel, group_steps
// kernel steps per group.
template <typename Kern, typename OT>
void run_a8(const int32_t* ap, const float* sx, const float* asum, const uint8_t* qw, const float* sc,
            const float* zs, const float* bias, OT* out, int64_t M, int64_t N, const KLayout& l,
            int64_t group_steps) {
  static constexpr auto kernels = make_a8_table<Kern>(std::make_index_sequence<kMRA8>{});
  const int64_t K = l.G * l.gs, group_blocks = l.gsp / l.kw, U = K / kU4S8Inputs;
  for_tiles<kMRA8>(M, N, M * N * K / 4, bias, out, [&](int64_t p) {
    const uint8_t* panel = qw + p * l.G * group_blocks * kBlockBytes;
    const float* ps = panel_groups(sc, p, l.G);
    const float* pz = panel_groups(zs, p, l.G);
    const int64_t G = l.G;
    return [=](int64_t c, int mr, float* tile) {
      kernels[mr - 1](ap + c * kMRA8 * (K / 4), sx + c * kMRA8 * U, asum + c * kMRA8 * G, panel, ps, pz, G,
                      group_steps, tile);
    };
  });
}

}  // namespace

namespace {

// wna16_linear into `into` when given (wna16_linear_out), else into a new tensor.
at::Tensor wna16_linear_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t n,
                             const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias,
                             std::optional<at::ScalarType> out_dtype, bool int8_act, const at::Tensor* into) {
  const char* op = into != nullptr ? "cpu_backend::wna16_linear_out" : "cpu_backend::wna16_linear";
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.size(2) == kBlockBytes &&
                  qweight.is_contiguous(),
              op, ": qweight must be contiguous uint8 [ceil(N/16), blocks, 64], got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const int64_t P = qweight.size(0);
  TORCH_CHECK(n > 0 && ceil_div(n, kNR) == P, op, ": n=", n, " does not match ", P, " panels of 16");
  TORCH_CHECK(scales.dim() == 3, op, ": scales must be float32 [", P, ", groups, 16], got ", scales.sizes());
  const int64_t G = scales.size(1);
  const bool sym_zs = zs.numel() == 0;  // symmetric: zs = -2^(bits-1) * scale
  for (const at::Tensor* t : {&scales, &zs}) {
    if (t == &zs && sym_zs) continue;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == P &&
                    t->size(1) == G && t->size(2) == kNR,
                op, ": scales and zs must be contiguous float32 [", P, ", ", G,
                ", 16] (zs may be empty for symmetric weights), got ", t->sizes(), " ", t->scalar_type());
  }
  TORCH_CHECK(group_size > 0 && G > 0 && x.dim() >= 1 && x.size(-1) == G * group_size, op, ": x must be [..., ",
              G * group_size, "] (", G, " groups of group_size=", group_size, "), got ", x.sizes());
  const int64_t K = x.size(-1);
  const KLayout l = bits == 4 ? make_layout<4>(G, group_size, std::make_index_sequence<8>{})
                              : make_layout<8>(G, group_size, std::make_index_sequence<4>{});
  TORCH_CHECK(qweight.size(1) * l.kw == G * l.gsp, op, ": qweight has ", qweight.size(1), " blocks, ", G,
              " groups of ", group_size, " need ", G * l.gsp / l.kw);
  TORCH_CHECK(!int8_act || (bits == 4 && group_size % kU4S8Inputs == 0) ||
                  (bits == 6 && (group_size == 16 || group_size % kU4S8Inputs == 0) && K % kU4S8Inputs == 0),
              op, ": int8_act needs 4-bit weights in groups of a multiple of ", kU4S8Inputs,
              ", or 6-bit ones in groups of 16 or a multiple of ", kU4S8Inputs, " (K a multiple of ",
              kU4S8Inputs, "), got bits=", bits, " group_size=", group_size, " K=", K);
  const int64_t* perm_ptr = nullptr;
  at::Tensor perm_c;
  if (perm.has_value() && perm->defined()) {
    perm_c = perm->contiguous();
    TORCH_CHECK(perm_c.scalar_type() == at::kLong && perm_c.dim() == 1 && perm_c.size(0) == K, op,
                ": perm must be int64 [", K, "]");
    perm_ptr = perm_c.const_data_ptr<int64_t>();
  }

  at::Tensor out = linear_result(op, x, n, out_dtype.value_or(x.scalar_type()), into);
  const int64_t M = out.numel() / n;
  if (M == 0) return out;

  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = padded_f32(op, *bias, n, P * kNR);
  const float* bias_ptr = bias_f32.defined() ? bias_f32.const_data_ptr<float>() : nullptr;

  const Rows xr = as_rows(x, M, K);
  const at::Tensor& x2 = xr.t;
  const int64_t ldx = xr.ld;
  const uint8_t* qw = qweight.const_data_ptr<uint8_t>();
  const float* sc = scales.const_data_ptr<float>();
  const float* zp = sym_zs ? nullptr : zs.const_data_ptr<float>();
  if (int8_act) {
    const int64_t C = ceil_div(M, kMRA8);
    // One scratch allocation: packed int8 pairs, then the fp32 scales and sums.
    const int64_t n_ap = C * kMRA8 * K / 4, n_sx = C * kMRA8 * (K / kU4S8Inputs);
    at::Tensor scratch = at::empty({n_ap + n_sx + C * kMRA8 * G}, x.options().dtype(at::kInt));
    int32_t* ap = scratch.mutable_data_ptr<int32_t>();
    float* sx = reinterpret_cast<float*>(ap + n_ap);
    float* asum = sx + n_sx;
    dispatch_float(x2.scalar_type(), "x", [&](auto tag) {
      using XT = typename decltype(tag)::type;
      const XT* xp = static_cast<const XT*>(x2.const_data_ptr());
      bits == 4 ? pack_rows_a8<true>(xp, ldx, M, l, perm_ptr, ap, sx, asum)
                : pack_rows_a8<false>(xp, ldx, M, l, perm_ptr, ap, sx, asum);
    });
    dispatch_float(out.scalar_type(), "x", [&](auto otag) {
      using OT = typename decltype(otag)::type;
      OT* o = static_cast<OT*>(out.mutable_data_ptr());
      if (bits == 4) {
        run_a8<Q4A8Kernel>(ap, sx, asum, qw, sc, zp, bias_ptr, o, M, n, l, group_size / kU4S8Inputs);
      } else if (group_size == 16) {
        run_a8<Q6A8Kernel<4>>(ap, sx, asum, qw, sc, zp, bias_ptr, o, M, n, l, 1);
      } else {
        run_a8<Q6A8Kernel<8>>(ap, sx, asum, qw, sc, zp, bias_ptr, o, M, n, l, group_size / kU4S8Inputs);
      }
    });
    return out;
  }
  const bool dense = M >= kDenseRows;
#if defined(CPU_BACKEND_HAS_DPBF16)
  const bool q4_pairs = bits == 4 && !dense && x2.scalar_type() == at::kBFloat16;
#else
  constexpr bool q4_pairs = false;
#endif
  const int chunk = dense ? kMRD : kMR;
  KLayout xl = l;  // the dense kernel's weights are already dequantized: x unscaled
  if (dense) std::fill(std::begin(xl.xs), std::end(xl.xs), 1.0f);
  const int64_t C = ceil_div(M, chunk);
  // One scratch allocation: packed x, then (not on the dense path, which has
  // no zero term) the sums of x per group.
  const int64_t n_ap = C * chunk * G * l.gsp;
  at::Tensor scratch = at::empty({n_ap + (dense ? 0 : C * chunk * G)}, x.options().dtype(at::kFloat));
  float* ap = scratch.mutable_data_ptr<float>();
  float* asum = dense ? nullptr : ap + n_ap;
  if (q4_pairs) {
#if defined(CPU_BACKEND_HAS_DPBF16)
    pack_rows_q4_pairs(static_cast<const bf16_t*>(x2.const_data_ptr()), ldx, M, l, perm_ptr,
                       reinterpret_cast<uint32_t*>(ap), asum);
#endif
  } else {
    dispatch_float(x2.scalar_type(), "x", [&](auto tag) {
      using XT = typename decltype(tag)::type;
      pack_rows(static_cast<const XT*>(x2.const_data_ptr()), ldx, M, xl, perm_ptr, chunk, ap, asum);
    });
  }
  dispatch_float(out.scalar_type(), "x", [&](auto otag) {
    using OT = typename decltype(otag)::type;
    OT* o = static_cast<OT*>(out.mutable_data_ptr());
    if (dense) {
      if (bits == 4) {
        run_dense<4, 4>(ap, qw, sc, zp, bias_ptr, o, M, n, l);
      } else if (bits == 6) {
        run_dense<8, 6>(ap, qw, sc, zp, bias_ptr, o, M, n, l);
      } else {
        run_dense<8, 8>(ap, qw, sc, zp, bias_ptr, o, M, n, l);
      }
    } else if (q4_pairs) {
#if defined(CPU_BACKEND_HAS_DPBF16)
      run<Q4PairKernel>(reinterpret_cast<const uint32_t*>(ap), asum, qw, sc, zp, bias_ptr, o, M, n, l);
#endif
    } else if (bits == 4) {
      run<QuantKernel<4>>(ap, asum, qw, sc, zp, bias_ptr, o, M, n, l);
    } else if (bits == 6) {
      run<QuantKernel<8, 6>>(ap, asum, qw, sc, zp, bias_ptr, o, M, n, l);
    } else {
      run<QuantKernel<8>>(ap, asum, qw, sc, zp, bias_ptr, o, M, n, l);
    }
  });
  return out;
}

}  // namespace

at::Tensor wna16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t n,
                        const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype, bool int8_act) {
  return wna16_linear_into(x, qweight, scales, zs, bits, group_size, n, perm, bias, out_dtype, int8_act, nullptr);
}

// wna16_linear into a given tensor (its dtype is the output's): step graphs
// (cpu_backend.worker.step_graphs) call this with preallocated buffers.
void wna16_linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t n,
                      const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias,
                      bool int8_act) {
  wna16_linear_into(x, qweight, scales, zs, bits, group_size, n, perm, bias, out.scalar_type(), int8_act, &out);
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def(
      "wna16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zs, int bits, int group_size, int n, "
      "Tensor? perm=None, Tensor? bias=None, ScalarType? out_dtype=None, bool int8_act=False) -> Tensor");
  m.def(
      "wna16_linear_out(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor zs, int bits, "
      "int group_size, int n, Tensor? perm=None, Tensor? bias=None, bool int8_act=False) -> ()");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  m.impl("wna16_linear", &cpu_backend::wna16_linear);
  m.impl("wna16_linear_out", &cpu_backend::wna16_linear_out);
}
