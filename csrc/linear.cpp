// Linear layer y = x @ W^T + b with W packed once into column panels.
//
// Packed weight: [P = ceil(N/NR)][K][NR], same dtype as W (bf16/fp16/fp32),
// rows n >= N zero. A panel is one contiguous K x NR block, so the kernel
// streams it front to back (the whole weight is one sequential read at M=1).
// On the avx512 and AVX2 builds bf16 panels interleave pairs of K rows (see
// pack_panels): VDPBF16PS takes two k per instruction, and on AVX2 one load
// and a shift and an and widen two rows (PairWidenKernel).
//
// Compute: x is first copied to fp32 in chunks of MR rows, each chunk laid out
// [K][mr] (one broadcast stream per chunk). The microkernel keeps acc[MR][NR]
// in registers and, for every k, widens one panel row to fp32 and does MR
// broadcast-FMAs; it writes the fp32 tile to a small buffer, from which the
// epilogue adds the bias and narrows to the output dtype. bf16 x with bf16
// weights on the avx512 build: x chunks hold bf16 pairs and the microkernel
// does MR x NR/16 VDPBF16PS per pair of k (fp32 accumulation). The
// microkernels prefetch the panel stream 4 KB ahead and, with one or two rows
// (decode), keep 4 or 2 accumulator sets over consecutive k. Work is split over
// panels (and over row blocks when there are few panels) with at::parallel_for,
// so a thread keeps its panel in L1/L2 while it walks the row chunks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>
#include <utility>

#include "dtype.h"
#include "linear_amx.h"
#include "ops.h"
#include "panel_tasks.h"
#include "tile_store.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

using Vec = VecF32x16;

// kNV vectors of 16 lanes per panel row; kMR rows per microkernel call.
#if defined(CPU_BACKEND_ISA_AVX512)
constexpr int kNV = 2;   // NR = 32: 24 accumulators + 2 weight + 1 broadcast zmm
constexpr int kMR = 12;
#elif defined(CPU_BACKEND_ISA_AVX2)
constexpr int kNV = 1;   // NR = 16: 12 accumulators + 2 weight + 1 broadcast ymm
constexpr int kMR = 6;
#else
constexpr int kNV = 1;
constexpr int kMR = 4;
#endif
constexpr int kNR = 16 * kNV;


// ---------------------------------------------------------------- packing ---

// bf16 weights are packed as row pairs where a build has a pair kernel: the
// avx512 build (VDPBF16PS) and the AVX2 builds (cheaper widening).
#if defined(CPU_BACKEND_HAS_DPBF16) || defined(CPU_BACKEND_ISA_AVX2)
#define CB_PAIR_BF16 1
#else
#define CB_PAIR_BF16 0
#endif
constexpr bool kPairBf16 = CB_PAIR_BF16;

// Plain panels: element (k, j) of panel p at [p][k][j] = W[p*NR + j][k].
// Pair panels (bf16 where kPairBf16): rows 2i and 2i+1 interleaved, (k, j)
// at [p][2i][2j + (k & 1)] with i = k / 2; an odd last row stays plain. The
// tensor shape is [P][K][NR] either way.
template <typename T>
void pack_panels(const T* w, T* out, int64_t N, int64_t K, bool pairs) {
  const int64_t P = ceil_div(N, kNR);
  const int64_t K2 = pairs ? K / 2 * 2 : 0;  // rows stored as pairs
  constexpr int64_t kKB = 256;  // k block: the destination block stays in L1
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      T* dst = out + p * K * kNR;
      for (int64_t kb = 0; kb < K; kb += kKB) {
        const int64_t ke = std::min(K, kb + kKB);
        for (int j = 0; j < kNR; ++j) {
          const int64_t n = p * kNR + j;
          const T* src = n < N ? w + n * K : nullptr;
          for (int64_t k = kb; k < ke; ++k) {
            const int64_t at = k < K2 ? (k & ~int64_t(1)) * kNR + 2 * j + (k & 1) : k * kNR + j;
            dst[at] = src ? src[k] : T{};
          }
        }
      }
    }
  });
}

// x rows -> chunks of kMR rows, chunk c at ap + c*kMR*KA laid out [KA][mr],
// where a row of the chunk holds for each of its mr rows either one k as fp32
// (KA = K) or a pair of k as two bf16 in a uint32 (KA = ceil(K/2); an odd last
// k is paired with 0).
template <typename XT>
void pack_rows(const XT* x, int64_t ldx, int64_t M, int64_t K, float* ap) {
  const int64_t C = ceil_div(M, kMR);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kMR * K));
  at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      float* dst = ap + c * kMR * K;
      for (int m = 0; m < mr; ++m) {
        const XT* src = x + (r0 + m) * ldx;
        for (int64_t k = 0; k < K; ++k) dst[k * mr + m] = to_f32(src[k]);
      }
    }
  });
}

#if defined(CPU_BACKEND_HAS_DPBF16)
void pack_rows_bf16_pairs(const bf16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* ap) {
  const int64_t C = ceil_div(M, kMR);
  const int64_t KA = ceil_div(K, 2);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kMR * K));
  at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      uint32_t* dst = ap + c * kMR * KA;
      for (int m = 0; m < mr; ++m) {
        const bf16_t* src = x + (r0 + m) * ldx;
        for (int64_t i = 0; i < K / 2; ++i)
          dst[i * mr + m] = uint32_t(src[2 * i].x) | (uint32_t(src[2 * i + 1].x) << 16);
        if (K & 1) dst[(KA - 1) * mr + m] = src[K - 1].x;
      }
    }
  });
}
#endif

// ----------------------------------------------------------- microkernels ---
// Each computes c[MR][NR] (fp32) = a-chunk @ panel for one chunk of MR rows.

// fp32 a [K][MR] x plain panel [K][NR] of WT, widened in registers.
template <typename WT>
struct PlainKernel {
  using AT = float;
  static int64_t a_rows(int64_t K) { return K; }

  template <int MR>
  static void run(const float* __restrict a, const WT* __restrict w, int64_t K, float* __restrict c) {
    constexpr int KU = kSplitK<MR>;
    Vec acc[KU][MR][kNV];
    CB_UNROLL for (int u = 0; u < KU; ++u) {
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = Vec::zero();
      }
    }
    auto row = [&](int u, int64_t k) CB_ALWAYS_INLINE_LAMBDA {
      Vec wv[kNV];
      CB_UNROLL for (int v = 0; v < kNV; ++v) wv[v] = Vec::load(w + k * kNR + v * 16);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const Vec av = Vec::broadcast(a[k * MR + m]);
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = fma(av, wv[v], acc[u][m][v]);
      }
    };
    const int64_t KE = K / KU * KU;
    for (int64_t k = 0; k < KE; k += KU) {
      prefetch_panel<KU * kNR * sizeof(WT)>(w + k * kNR);
      CB_UNROLL for (int u = 0; u < KU; ++u) row(u, k + u);
    }
    for (int64_t k = KE; k < K; ++k) row(0, k);
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      CB_UNROLL for (int v = 0; v < kNV; ++v) {
        CB_UNROLL for (int u = 1; u < KU; ++u) acc[0][m][v] = acc[0][m][v] + acc[u][m][v];
        acc[0][m][v].store(c + m * kNR + v * 16);
      }
    }
  }
};

#if CB_PAIR_BF16
// fp32 a [K][MR] x pair panel of bf16: each pair of rows widened with 2 ALU ops
// (shift, and) from one load, where plain rows take a widening load and a
// shift per row. Few rows (decode) keep KU accumulator sets over consecutive
// pairs, as PlainKernel does over rows.
struct PairWidenKernel {
  using AT = float;
  static int64_t a_rows(int64_t K) { return K; }

  template <int MR>
  static void run(const float* __restrict a, const bf16_t* __restrict w, int64_t K, float* __restrict c) {
    constexpr int KU = kSplitK<MR>;
    Vec acc[KU][MR][kNV];
    CB_UNROLL for (int u = 0; u < KU; ++u) {
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = Vec::zero();
      }
    }
    auto pair = [&](int u, int64_t k) CB_ALWAYS_INLINE_LAMBDA {
      Vec w0[kNV], w1[kNV];
      CB_UNROLL for (int v = 0; v < kNV; ++v) Vec::load_pairs(w + k * kNR + v * 32, &w0[v], &w1[v]);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const Vec a0 = Vec::broadcast(a[k * MR + m]);
        const Vec a1 = Vec::broadcast(a[(k + 1) * MR + m]);
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = fma(a1, w1[v], fma(a0, w0[v], acc[u][m][v]));
      }
    };
    const int64_t K2 = K / 2 * 2, KE = K2 / (2 * KU) * (2 * KU);
    for (int64_t k = 0; k < KE; k += 2 * KU) {
      prefetch_panel<KU * 2 * kNR * sizeof(bf16_t)>(w + k * kNR);
      CB_UNROLL for (int u = 0; u < KU; ++u) pair(u, k + 2 * u);
    }
    for (int64_t k = KE; k < K2; k += 2) pair(0, k);
    if (K2 < K) {  // odd last row, plain
      Vec wv[kNV];
      CB_UNROLL for (int v = 0; v < kNV; ++v) wv[v] = Vec::load(w + K2 * kNR + v * 16);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const Vec av = Vec::broadcast(a[K2 * MR + m]);
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[0][m][v] = fma(av, wv[v], acc[0][m][v]);
      }
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      CB_UNROLL for (int v = 0; v < kNV; ++v) {
        CB_UNROLL for (int u = 1; u < KU; ++u) acc[0][m][v] = acc[0][m][v] + acc[u][m][v];
        acc[0][m][v].store(c + m * kNR + v * 16);
      }
    }
  }
};
#endif

#if defined(CPU_BACKEND_HAS_DPBF16)
// bf16 pairs a [ceil(K/2)][MR] x pair panel of bf16 with VDPBF16PS: one
// instruction does two k for 16 columns.
struct DpBf16Kernel {
  using AT = uint32_t;
  static int64_t a_rows(int64_t K) { return ceil_div(K, 2); }

  template <int MR>
  static void run(const uint32_t* __restrict a, const bf16_t* __restrict w, int64_t K, float* __restrict c) {
    constexpr int KU = kSplitK<MR>;
    Vec acc[KU][MR][kNV];
    CB_UNROLL for (int u = 0; u < KU; ++u) {
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = Vec::zero();
      }
    }
    auto pair = [&](int u, int64_t i) CB_ALWAYS_INLINE_LAMBDA {
      VecBF16x32 wv[kNV];
      CB_UNROLL for (int v = 0; v < kNV; ++v) wv[v] = VecBF16x32::load(w + 2 * i * kNR + v * 32);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const VecBF16x32 av = VecBF16x32::broadcast_pair(a[i * MR + m]);
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[u][m][v] = dot2_bf16(acc[u][m][v], av, wv[v]);
      }
    };
    const int64_t KP = K / 2, KE = KP / KU * KU;
    for (int64_t i = 0; i < KE; i += KU) {
      prefetch_panel<KU * 2 * kNR * sizeof(bf16_t)>(w + 2 * i * kNR);
      CB_UNROLL for (int u = 0; u < KU; ++u) pair(u, i + u);
    }
    for (int64_t i = KE; i < KP; ++i) pair(0, i);
    if (K & 1) {  // odd last row: plain bf16 -> pairs (w, 0); a holds (x, 0)
      VecBF16x32 wv[kNV];
      CB_UNROLL for (int v = 0; v < kNV; ++v) wv[v] = VecBF16x32::load_zero_odd(w + 2 * KP * kNR + v * 16);
      CB_UNROLL for (int m = 0; m < MR; ++m) {
        const VecBF16x32 av = VecBF16x32::broadcast_pair(a[KP * MR + m]);
        CB_UNROLL for (int v = 0; v < kNV; ++v) acc[0][m][v] = dot2_bf16(acc[0][m][v], av, wv[v]);
      }
    }
    CB_UNROLL for (int m = 0; m < MR; ++m) {
      CB_UNROLL for (int v = 0; v < kNV; ++v) {
        CB_UNROLL for (int u = 1; u < KU; ++u) acc[0][m][v] = acc[0][m][v] + acc[u][m][v];
        acc[0][m][v].store(c + m * kNR + v * 16);
      }
    }
  }
};
#endif

template <typename Kern, typename WT, size_t... I>
constexpr auto make_kernel_table(std::index_sequence<I...>) {
  using Fn = void (*)(const typename Kern::AT*, const WT*, int64_t, float*);
  // entry mr-1 handles mr rows
  return std::array<Fn, sizeof...(I)>{&Kern::template run<int(I) + 1>...};
}

// --------------------------------------------------------------- driver ---

template <typename Kern, typename WT, typename OT>
void run_linear(const typename Kern::AT* ap, const WT* wp, const float* bias, OT* out, int64_t M,
                int64_t N, int64_t K) {
  static constexpr auto kernels = make_kernel_table<Kern, WT>(std::make_index_sequence<kMR>{});
  const int64_t KA = Kern::a_rows(K);
  const int64_t P = ceil_div(N, kNR);
  const int64_t C = ceil_div(M, kMR);
  parallel_panels(P, C, M * N * K, [&](int64_t p, int64_t c_begin, int64_t c_end) {
    alignas(64) float tile[kMR * kNR];
    const WT* panel = wp + p * K * kNR;
    const float* pbias = bias ? bias + p * kNR : nullptr;
    const int nn = int(std::min<int64_t>(kNR, N - p * kNR));
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      kernels[mr - 1](ap + c * kMR * KA, panel, K, tile);
      store_tile_rows<kNV>(tile, mr, pbias, out + r0 * N + p * kNR, N, nn);
    }
  });
}

}  // namespace

std::string isa() { return CPU_BACKEND_ISA_NAME; }

int64_t linear_pack_nr() { return kNR; }

bool linear_pack_pairs(at::ScalarType dtype) { return kPairBf16 && dtype == at::kBFloat16; }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "cpu_backend::pack_linear_weight: weight must be on CPU");
  TORCH_CHECK(weight.dim() == 2, "cpu_backend::pack_linear_weight: weight must be [N, K], got ",
              weight.sizes());
  TORCH_CHECK(is_supported_float(weight.scalar_type()),
              "cpu_backend::pack_linear_weight: weight must be float32, bfloat16 or float16, got ",
              weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({ceil_div(N, kNR), K, kNR}, w.options());
  if (w.element_size() == 2) {
    pack_panels(static_cast<const uint16_t*>(w.const_data_ptr()),
                static_cast<uint16_t*>(out.mutable_data_ptr()), N, K, linear_pack_pairs(w.scalar_type()));
  } else {
    pack_panels(w.const_data_ptr<float>(), out.mutable_data_ptr<float>(), N, K, false);
  }
  return out;
}

namespace {

// The checks both entry points make of x and the packed weight.
void check_linear_args(const at::Tensor& x, const at::Tensor& packed_weight, int64_t n) {
  const at::Tensor& pw = packed_weight;
  TORCH_CHECK(x.device().is_cpu() && pw.device().is_cpu(), "cpu_backend::linear: tensors must be on CPU");
  TORCH_CHECK(pw.dim() == 3 && pw.size(2) == kNR,
              "cpu_backend::linear: packed_weight must be [ceil(N/", kNR, "), K, ", kNR,
              "] from cpu_backend::pack_linear_weight of this build (", CPU_BACKEND_ISA_NAME, "), got ",
              pw.sizes());
  TORCH_CHECK(pw.is_contiguous(), "cpu_backend::linear: packed_weight must be contiguous");
  TORCH_CHECK(is_supported_float(pw.scalar_type()), "cpu_backend::linear: packed_weight must be float32, "
              "bfloat16 or float16, got ", pw.scalar_type());
  const int64_t K = pw.size(1);
  TORCH_CHECK(n >= 0 && ceil_div(n, kNR) == pw.size(0), "cpu_backend::linear: n=", n,
              " does not match packed_weight with ", pw.size(0), " panels of ", kNR);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "cpu_backend::linear: x must be [..., ", K, "], got ",
              x.sizes());
  TORCH_CHECK(is_supported_float(x.scalar_type()),
              "cpu_backend::linear: x must be float32, bfloat16 or float16, got ", x.scalar_type());
}

// out[..., n] = x @ W^T + bias; out is contiguous, of x's leading shape.
void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed_weight, int64_t n,
                 const std::optional<at::Tensor>& bias) {
  const at::Tensor& pw = packed_weight;
  const int64_t K = pw.size(1);
  const int64_t M = n == 0 ? 0 : out.numel() / n;
  if (M == 0 || n == 0) return;

  // bias -> fp32, zero padded to whole panels
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = padded_f32("cpu_backend::linear", *bias, n, pw.size(0) * kNR);
  const float* bias_ptr = bias_f32.defined() ? bias_f32.const_data_ptr<float>() : nullptr;

  const Rows xr = as_rows(x, M, K);
  const at::Tensor& x2 = xr.t;
  const int64_t ldx = xr.ld;

  const auto dispatch_out = [&](auto&& run) {
    dispatch_float(out.scalar_type(), "x", [&](auto otag) {
      using OT = typename decltype(otag)::type;
      run(static_cast<OT*>(out.mutable_data_ptr()));
    });
  };

#if defined(CPU_BACKEND_HAS_DPBF16)
  if (pw.scalar_type() == at::kBFloat16 && x2.scalar_type() == at::kBFloat16) {
#if defined(CPU_BACKEND_HAS_AMX)
    if (M >= kAmxMinRows && K % 2 == 0 && amx_usable()) {
      dispatch_out([&](auto* o) {
        linear_amx_bf16(static_cast<const bf16_t*>(x2.const_data_ptr()), ldx, M, n, K,
                        static_cast<const bf16_t*>(pw.const_data_ptr()), bias_ptr, o);
      });
      return;
    }
#endif
    // bf16 x bf16: two k per VDPBF16PS
    at::Tensor apack = at::empty({ceil_div(M, kMR) * kMR * ceil_div(K, 2)}, x.options().dtype(at::kInt));
    uint32_t* ap = static_cast<uint32_t*>(apack.mutable_data_ptr());
    pack_rows_bf16_pairs(static_cast<const bf16_t*>(x2.const_data_ptr()), ldx, M, K, ap);
    dispatch_out([&](auto* o) {
      run_linear<DpBf16Kernel>(ap, static_cast<const bf16_t*>(pw.const_data_ptr()), bias_ptr, o, M, n, K);
    });
    return;
  }
#endif

  at::Tensor apack;
  const float* ap = nullptr;
  if (M == 1 && x2.scalar_type() == at::kFloat) {
    ap = x2.const_data_ptr<float>();  // one row: [K][1] is the row itself
  } else {
    apack = at::empty({ceil_div(M, kMR) * kMR * K}, x.options().dtype(at::kFloat));
    dispatch_float(x2.scalar_type(), "x", [&](auto tag) {
      using XT = typename decltype(tag)::type;
      pack_rows(static_cast<const XT*>(x2.const_data_ptr()), ldx, M, K, apack.mutable_data_ptr<float>());
    });
    ap = apack.const_data_ptr<float>();
  }

#if CB_PAIR_BF16
  if (pw.scalar_type() == at::kBFloat16) {
    dispatch_out([&](auto* o) {
      run_linear<PairWidenKernel>(ap, static_cast<const bf16_t*>(pw.const_data_ptr()), bias_ptr, o, M, n, K);
    });
    return;
  }
#endif

  dispatch_float(pw.scalar_type(), "packed_weight", [&](auto wtag) {
    using WT = typename decltype(wtag)::type;
    dispatch_out([&](auto* o) {
      run_linear<PlainKernel<WT>>(ap, static_cast<const WT*>(pw.const_data_ptr()), bias_ptr, o, M, n, K);
    });
  });
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed_weight, int64_t n,
                  const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  check_linear_args(x, packed_weight, n);
  at::Tensor out = linear_result("cpu_backend::linear", x, n, out_dtype.value_or(x.scalar_type()), nullptr);
  linear_into(out, x, packed_weight, n, bias);
  return out;
}

// linear into a given tensor: step graphs (cpu_backend.worker.step_graphs)
// call this with preallocated activation buffers.
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed_weight, int64_t n,
                const std::optional<at::Tensor>& bias) {
  check_linear_args(x, packed_weight, n);
  linear_result("cpu_backend::linear_out", x, n, out.scalar_type(), &out);
  linear_into(out, x, packed_weight, n, bias);
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def("linear_out(Tensor(a!) out, Tensor x, Tensor packed_weight, int n, Tensor? bias=None) -> ()");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) { m.impl("linear_out", &cpu_backend::linear_out); }
