// Weight-only quantized linear (GPTQ / AWQ / compressed-tensors W4A16, W8A16):
// y = x @ dequant(W)^T + b with W stored as unsigned 4- or 8-bit integers.
//
// Layout (made once at load by cpu_backend.quantization.pack, pure torch):
//   qweight [P = ceil(N/16)][K][RB] uint8: row k of panel p holds the 16
//     columns n = 16p..16p+15; RB = 16 bytes (u8, one per column) or 8 bytes
//     (u4: column j < 8 in the low nibble of byte j, j >= 8 in the high nibble
//     of byte j-8). Columns >= N are zero.
//   scales, zs [P][G][16] fp32, G = K / group_size: the weight is
//     q * scale + zs (zs = -zero * scale, so asymmetric and symmetric are one
//     path). Padded columns have scale 0.
//   perm [K] int64 (optional): row k of the weight multiplies x[:, perm[k]]
//     (GPTQ act-order: rows sorted by g_idx so every group is contiguous).
// Compute: x rows are packed to fp32 chunks [K][mr] (gathered through perm),
// then per k one panel row is widened in registers (u8/u4 -> fp32) and
// multiplied into MR x 16 fp32 group accumulators; at the end of each group
// those are scaled and the zero term added from the group's sum of x. Same work split as linear.cpp
// (panels x row blocks with at::parallel_for). Registered here with
// TORCH_LIBRARY_FRAGMENT so registration.cpp stays untouched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "dtype.h"
#include "panel_tasks.h"
#include "vec/vec.h"
#include "vec/vec_quant.h"

namespace cpu_backend {
namespace {

using Vec = VecF32x16;
constexpr int kNR = 16;
#if defined(CPU_BACKEND_ISA_AVX512)
constexpr int kMR = 8;
#else
constexpr int kMR = 3;  // avx2: 4*MR accumulators (acc, group acc) + 2 ymm w + 1 x
#endif


template <int BITS>
struct RowBytes {
  static constexpr int value = BITS == 4 ? 8 : 16;
};

template <int BITS>
static CB_ALWAYS_INLINE Vec load_q(const uint8_t* p) {
  if constexpr (BITS == 4) {
    return load_u4x16(p);
  } else {
    return load_u8x16(p);
  }
}

// c[MR][16] = a-chunk [K][MR] @ dequantized panel. Per group: gacc = sum_k
// a[k] * q[k] (the integer weights, exact in fp32), then acc += gacc * scale
// + asum * zs, with asum[g][m] the group's sum of a (precomputed per chunk):
// scale and zero cost two FMAs per group instead of one per k.
template <int BITS>
struct QuantKernel {
  template <int MR>
  static void run(const float* __restrict a, const float* __restrict asum, const uint8_t* __restrict q,
                  const float* __restrict s, const float* __restrict zs, int64_t K, int64_t gs,
                  float* __restrict c) {
    constexpr int RB = RowBytes<BITS>::value;
    Vec acc[MR];
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    const int64_t G = K / gs;
    // Few rows: KU independent accumulator sets over k, so consecutive FMAs
    // do not wait on each other (one chain would be FMA-latency bound).
    constexpr int KU = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
    for (int64_t g = 0; g < G; ++g) {
      Vec gacc[KU][MR];
      CB_UNROLL for (int u = 0; u < KU; ++u) {
        CB_UNROLL for (int m = 0; m < MR; ++m) gacc[u][m] = Vec::zero();
      }
      const int64_t k0 = g * gs, k1 = (g + 1) * gs;
      const int64_t ku_end = k0 + (gs / KU) * KU;
      for (int64_t k = k0; k < ku_end; k += KU) {
        CB_UNROLL for (int u = 0; u < KU; ++u) {
          const Vec w = load_q<BITS>(q + (k + u) * RB);
          CB_UNROLL for (int m = 0; m < MR; ++m) {
            gacc[u][m] = fma(Vec::broadcast(a[(k + u) * MR + m]), w, gacc[u][m]);
          }
        }
      }
      for (int64_t k = ku_end; k < k1; ++k) {
        const Vec w = load_q<BITS>(q + k * RB);
        CB_UNROLL for (int m = 0; m < MR; ++m) gacc[0][m] = fma(Vec::broadcast(a[k * MR + m]), w, gacc[0][m]);
      }
      CB_UNROLL for (int u = 1; u < KU; ++u) {
        CB_UNROLL for (int m = 0; m < MR; ++m) gacc[0][m] = gacc[0][m] + gacc[u][m];
      }
      const Vec sv = Vec::load(s + g * kNR);
      const Vec zv = Vec::load(zs + g * kNR);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        acc[m] = fma(Vec::broadcast(asum[g * MR + m]), zv, fma(gacc[0][m], sv, acc[m]));
      }
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) acc[m].store(c + m * kNR);
  }
};

template <int BITS, size_t... I>
constexpr auto make_table(std::index_sequence<I...>) {
  using Fn = void (*)(const float*, const float*, const uint8_t*, const float*, const float*, int64_t,
                      int64_t, float*);
  return std::array<Fn, sizeof...(I)>{&QuantKernel<BITS>::template run<int(I) + 1>...};
}

// x rows (through perm when given) -> fp32 chunks of kMR rows laid out [K][mr].
template <typename XT>
void pack_rows(const XT* x, int64_t ldx, int64_t M, int64_t K, const int64_t* perm, float* ap) {
  const int64_t C = ceil_div(M, kMR);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kMR * K));
  at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      float* dst = ap + c * kMR * K;
      for (int m = 0; m < mr; ++m) {
        const XT* src = x + (r0 + m) * ldx;
        if (perm) {
          for (int64_t k = 0; k < K; ++k) dst[k * mr + m] = to_f32(src[perm[k]]);
        } else {
          for (int64_t k = 0; k < K; ++k) dst[k * mr + m] = to_f32(src[k]);
        }
      }
    }
  });
}

template <typename OT>
inline void store_tile(const float* tile, int mr, const float* bias, OT* out, int64_t ldo, int nn) {
  for (int m = 0; m < mr; ++m) {
    Vec r = Vec::load(tile + m * kNR);
    if (bias) r = r + Vec::load(bias);
    if (nn == kNR) {
      r.store(out + m * ldo);
    } else {
      r.store_partial(out + m * ldo, nn);
    }
  }
}

// asum[c][g][mr] = sum over group g of chunk c's packed x (layout [K][mr]).
void group_sums(const float* ap, int64_t M, int64_t K, int64_t gs, float* asum) {
  const int64_t C = ceil_div(M, kMR), G = K / gs;
  for (int64_t c = 0; c < C; ++c) {
    const int mr = int(std::min<int64_t>(kMR, M - c * kMR));
    const float* a = ap + c * kMR * K;
    float* dst = asum + c * kMR * G;
    for (int64_t g = 0; g < G; ++g) {
      for (int m = 0; m < mr; ++m) {
        float t = 0.0f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) t += a[k * mr + m];
        dst[g * mr + m] = t;
      }
    }
  }
}

template <int BITS, typename OT>
void run(const float* ap, const float* asum, const uint8_t* qw, const float* sc, const float* zs, const float* bias, OT* out,
         int64_t M, int64_t N, int64_t K, int64_t gs) {
  static constexpr auto kernels = make_table<BITS>(std::make_index_sequence<kMR>{});
  constexpr int RB = RowBytes<BITS>::value;
  const int64_t G = K / gs;
  const int64_t P = ceil_div(N, kNR);
  const int64_t C = ceil_div(M, kMR);
  parallel_panels(P, C, M * N * K, [&](int64_t p, int64_t c_begin, int64_t c_end) {
    alignas(64) float tile[kMR * kNR];
    const uint8_t* panel = qw + p * K * RB;
    const float* ps = sc + p * G * kNR;
    const float* pz = zs + p * G * kNR;
    const float* pb = bias ? bias + p * kNR : nullptr;
    const int nn = int(std::min<int64_t>(kNR, N - p * kNR));
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      kernels[mr - 1](ap + c * kMR * K, asum + c * kMR * G, panel, ps, pz, K, gs, tile);
      store_tile(tile, mr, pb, out + r0 * N + p * kNR, N, nn);
    }
  });
}

}  // namespace

at::Tensor wna16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t n,
                        const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias) {
  const char* op = "cpu_backend::wna16_linear";
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  const int64_t RB = bits == 4 ? 8 : 16;
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.size(2) == RB &&
                  qweight.is_contiguous(),
              op, ": qweight must be contiguous uint8 [ceil(N/16), K, ", RB, "], got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const int64_t P = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(n > 0 && ceil_div(n, kNR) == P, op, ": n=", n, " does not match ", P, " panels of 16");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, op, ": group_size=", group_size,
              " must divide K=", K);
  const int64_t G = K / group_size;
  for (const at::Tensor* t : {&scales, &zs}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == P &&
                    t->size(1) == G && t->size(2) == kNR,
                op, ": scales and zs must be contiguous float32 [", P, ", ", G, ", 16], got ", t->sizes(),
                " ", t->scalar_type());
  }
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x must be [..., ", K, "], got ", x.sizes());
  const int64_t* perm_ptr = nullptr;
  at::Tensor perm_c;
  if (perm.has_value() && perm->defined()) {
    perm_c = perm->contiguous();
    TORCH_CHECK(perm_c.scalar_type() == at::kLong && perm_c.dim() == 1 && perm_c.size(0) == K, op,
                ": perm must be int64 [", K, "]");
    perm_ptr = perm_c.const_data_ptr<int64_t>();
  }

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = out.numel() / n;
  if (M == 0) return out;

  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [", n, "], got ", bias->sizes());
    bias_f32 = at::zeros({P * kNR}, x.options().dtype(at::kFloat));
    bias_f32.narrow(0, 0, n).copy_(*bias);
  }
  const float* bias_ptr = bias_f32.defined() ? bias_f32.const_data_ptr<float>() : nullptr;

  at::Tensor x2 = x.reshape({M, K});
  if (K > 1 && x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t ldx = x2.stride(0);
  at::Tensor apack;
  const float* ap;
  if (M == 1 && !perm_ptr && x2.scalar_type() == at::kFloat) {
    ap = x2.const_data_ptr<float>();
  } else {
    apack = at::empty({ceil_div(M, kMR) * kMR * K}, x.options().dtype(at::kFloat));
    dispatch_float(x2.scalar_type(), "x", [&](auto tag) {
      using XT = typename decltype(tag)::type;
      pack_rows(static_cast<const XT*>(x2.const_data_ptr()), ldx, M, K, perm_ptr,
                apack.mutable_data_ptr<float>());
    });
    ap = apack.const_data_ptr<float>();
  }
  at::Tensor asum_t = at::empty({ceil_div(M, kMR) * kMR * G}, x.options().dtype(at::kFloat));
  float* asum = asum_t.mutable_data_ptr<float>();
  group_sums(ap, M, K, group_size, asum);
  const uint8_t* qw = qweight.const_data_ptr<uint8_t>();
  dispatch_float(out.scalar_type(), "x", [&](auto otag) {
    using OT = typename decltype(otag)::type;
    OT* o = static_cast<OT*>(out.mutable_data_ptr());
    if (bits == 4) {
      run<4>(ap, asum, qw, scales.const_data_ptr<float>(), zs.const_data_ptr<float>(), bias_ptr, o, M, n, K, group_size);
    } else {
      run<8>(ap, asum, qw, scales.const_data_ptr<float>(), zs.const_data_ptr<float>(), bias_ptr, o, M, n, K, group_size);
    }
  });
  return out;
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def(
      "wna16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zs, int bits, int group_size, int n, "
      "Tensor? perm=None, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) { m.impl("wna16_linear", &cpu_backend::wna16_linear); }
