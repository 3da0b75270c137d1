// W8A8 int8 linear (compressed-tensors W8A8 INT8): int8 weights with one
// scale per output channel, activations quantized to int8 per token
// (dynamic) or with a static per-tensor scale, symmetric or with a zero point:
//   y[m][n] = s_a[m] * s_w[n] * (sum_k q_a[m][k] q_w[n][k] - zp[m] * wsum[n]) + b[n]
// The integer product is exact (int32); scaling happens once per output.
//
// Activation quantization (fused into w8a8_linear; w8a8_quantize exposes it):
//   dynamic symmetric: s = max|x| / 127, q = round(x / s)
//   dynamic asymmetric: lo = min(min x, 0), hi = max(max x, 0), s = (hi - lo) / 254,
//     zp = round(-127 - lo / s), q = round(x / s) + zp (an all-zero row: s = 1, zp = 0)
//   static: s, zp from the checkpoint, q = round(x / s) + zp
// all in fp32, round half to even, clamped to [-127, 127]: the AVX2 sign trick
// needs |q| <= 127 (vec/vec_int8.h); for the dynamic modes this loses nothing,
// for static scales only an input that would round to -128 moves by one step.
//
// Weights (made once at load by cpu_backend/quantization/w8a8.py, pure torch):
//   qweight [P = ceil(N/16)][K4 = ceil(K/4)][64] int8 (vec/vec_int8.h layout),
//   wsum [16 P] int32 = sum_k q_w (the zero-point / VNNI offset term),
//   w_scale [16 P] fp32 (padded columns 0).
// Work split as linear_wna16.cpp: panels x row blocks with at::parallel_for.
// On the amx library, 16 rows and more run on AMX tiles (TDPBUSD, the same
// exact integer products: int8_gemm_amx).
// Registered here with TORCH_LIBRARY_FRAGMENT so registration.cpp stays untouched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "dtype.h"
#include "int8_quant.h"
#include "linear_amx.h"
#include "panel_tasks.h"
#include "vec/vec.h"
#include "vec/vec_int8.h"

namespace cpu_backend {
namespace {

using Vec = VecF32x16;
constexpr int kNR = 16;
constexpr int kMR = kInt8MR;


struct ActQuant {
  bool dynamic;
  bool symmetric;
  float scale;   // static only
  int32_t zp;    // static only
};

// One row x[0..K) -> q[0..Kp) (bytes, ^ kActXor; tail zero before the xor),
// its scale and zero point.
template <typename XT>
void quantize_row(const XT* x, int64_t K, int64_t Kp, const ActQuant& aq, uint8_t xor_mask, uint8_t* q,
                  float* s_out, int32_t* zp_out) {
  float s = aq.scale;
  int32_t zp = aq.zp;
  if (aq.dynamic) {
    float mn, mx;
    min_max(x, K, &mn, &mx);
    zp = 0;
    if (!aq.symmetric) {
      mn = std::min(mn, 0.0f);  // 0 stays representable (compressed-tensors' rule),
      mx = std::max(mx, 0.0f);  // so zp is in [-127, 127]
      s = mx > mn ? (mx - mn) / 254.0f : 1.0f;
      zp = int32_t(std::nearbyint(-127.0f - mn / s));
    } else {
      const float amax = std::max(std::fabs(mn), std::fabs(mx));
      s = int8_sym_scale(amax);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = clamp_q(std::nearbyint(to_f32(x[k]) / s) + float(zp));
    q[k] = uint8_t(int8_t(v)) ^ xor_mask;
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = xor_mask;
  *s_out = s;
  *zp_out = zp;
}

template <typename XT>
void quantize_rows(const XT* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, const ActQuant& aq,
                   uint8_t xor_mask, uint8_t* q, float* s, int32_t* zp) {
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * ldx, K, Kp, aq, xor_mask, q + m * Kp, s + m, zp + m);
  });
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, int32_t*);

template <int NP, size_t... I>
constexpr std::array<TileFn, sizeof...(I)> make_table(std::index_sequence<I...>) {
  return {&int8_tile<int(I) + 1, NP>...};
}

#if defined(CPU_BACKEND_HAS_AMX)
// int8_gemm on AMX tiles (amx library, 16 rows and more): a task is a pair of
// panels times a run of 32-row blocks (amx_int8_block). Whole blocks read the
// rows in place when Kp is a multiple of 64 (a tile's 64 k); the rest come
// from a zero-padded copy, so every tile load stays inside its buffer.
template <typename Epi>
void int8_gemm_amx(const uint8_t* aq, int64_t Kp, int64_t M, const int8_t* qw, int64_t P, Epi&& epi) {
  constexpr int64_t kRows = 32;
  const int64_t K4 = Kp / 4;
  const int64_t KA = ceil_div(Kp, 64) * 64;  // bytes a block's tile loads read per row
  const int64_t C = ceil_div(M, kRows);
  const int64_t c_direct = KA == Kp ? M / kRows : 0;
  const int64_t copy_rows = (C - c_direct) * kRows;
  at::Tensor copy;
  uint8_t* a_copy = nullptr;
  if (copy_rows) {
    copy = at::zeros({copy_rows, KA}, at::TensorOptions().dtype(at::kByte));
    a_copy = copy.mutable_data_ptr<uint8_t>();
    for (int64_t r = c_direct * kRows; r < M; ++r)
      std::memcpy(a_copy + (r - c_direct * kRows) * KA, aq + r * Kp, Kp);
  }
  parallel_panels<AmxTiles>(ceil_div(P, 2), C, M * P * kNR * Kp, [&](int64_t pp, int64_t c_begin, int64_t c_end) {
    alignas(64) int32_t tile[2 * kRows * kNR];
    const int64_t p0 = 2 * pp;
    const bool two = p0 + 1 < P;
    const int8_t* w0 = qw + p0 * K4 * 64;
    const int8_t* w1 = two ? w0 + K4 * 64 : w0;  // an odd last panel: computed twice, used once
    for (int64_t c = c_begin; c < c_end; ++c) {
      const bool direct = c < c_direct;
      const uint8_t* a = direct ? aq + c * kRows * Kp : a_copy + (c - c_direct) * kRows * KA;
      amx_int8_block(a, direct ? Kp : KA, w0, w1, K4, tile);
      const int64_t r0 = c * kRows;
      const int mr = int(std::min<int64_t>(kRows, M - r0));
      epi(tile, r0, mr, p0);
      if (two) epi(tile + kRows * kNR, r0, mr, p0 + 1);
    }
  });
}
#endif

// For every (row chunk, panel): the int32 tile of the quantized rows times the
// panel, handed to epi(tile, r0, mr, p). Rows are kMR at a time; from two rows
// on, a task takes kInt8NP adjacent panels per micro-kernel call (the last one
// alone if odd). One row (decode) keeps one panel per call: the GEMV reads its
// weights once either way, and two streams per call measured 1.15x slower.
template <typename Epi>
void int8_gemm(const uint8_t* aq, int64_t Kp, int64_t M, const int8_t* qw, int64_t P, Epi&& epi) {
#if defined(CPU_BACKEND_HAS_AMX)
  if (M >= kAmxMinRows && amx_usable()) return int8_gemm_amx(aq, Kp, M, qw, P, epi);
#endif
  static constexpr auto kernels = make_table<kInt8NP>(std::make_index_sequence<kMR>{});
  static constexpr auto single = make_table<1>(std::make_index_sequence<kMR>{});
  const int64_t K4 = Kp / 4;
  const int64_t C = ceil_div(M, kMR);
  const int64_t per_call = M > 1 ? kInt8NP : 1;
  parallel_panels(ceil_div(P, per_call), C, M * P * kNR * Kp, [&](int64_t pg, int64_t c_begin, int64_t c_end) {
    alignas(64) int32_t tile[kInt8NP * kMR * kNR];
    const int64_t p0 = pg * per_call;
    const int np = int(std::min<int64_t>(per_call, P - p0));
    const int8_t* panel = qw + p0 * K4 * 64;
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t r0 = c * kMR;
      const int mr = int(std::min<int64_t>(kMR, M - r0));
      (np > 1 ? kernels : single)[mr - 1](aq + r0 * Kp, Kp, panel, K4 * 64, K4, tile);
      for (int i = 0; i < np; ++i) epi(tile + i * mr * kNR, r0, mr, p0 + i);
    }
  });
}

void check_weights(const char* op, const at::Tensor& qweight, const at::Tensor& wsum, int64_t n) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kChar && qweight.size(2) == 64 &&
                  qweight.is_contiguous(),
              op, ": qweight must be contiguous int8 [ceil(N/16), ceil(K/4), 64], got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const int64_t P = qweight.size(0);
  TORCH_CHECK(n > 0 && ceil_div(n, kNR) == P, op, ": n=", n, " does not match ", P, " panels of 16");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.dim() == 1 && wsum.size(0) == P * kNR,
              op, ": wsum must be contiguous int32 [", P * kNR, "], got ", wsum.sizes(), " ", wsum.scalar_type());
}

// x [..., K] (any float dtype) -> int8 rows [M][Kp] ^ kActXor, scales, zero points.
struct Quantized {
  at::Tensor q, s, zp;
  int64_t M, K, Kp;
};

Quantized quantize(const char* op, const at::Tensor& x, int64_t K4, std::optional<double> input_scale,
                   std::optional<int64_t> input_zp, bool symmetric, uint8_t xor_mask) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  const int64_t K = x.size(-1);
  TORCH_CHECK(ceil_div(K, 4) == K4, op, ": x [..., ", K, "] does not match the weight's ", K4, " groups of 4 k");
  ActQuant aq{!input_scale.has_value(), symmetric, 1.0f, 0};
  if (input_scale.has_value()) {
    TORCH_CHECK(std::isfinite(*input_scale) && *input_scale > 0, op, ": input_scale must be > 0, got ",
                *input_scale);
    aq.scale = float(*input_scale);
    aq.zp = symmetric ? 0 : int32_t(input_zp.value_or(0));
  } else {
    TORCH_CHECK(!input_zp.has_value(), op, ": input_zp needs a static input_scale");
  }
  const int64_t M = x.numel() / std::max<int64_t>(1, K);
  const int64_t Kp = K4 * 4;
  Quantized r{at::empty({M, Kp}, x.options().dtype(at::kByte)), at::empty({M}, x.options().dtype(at::kFloat)),
              at::empty({M}, x.options().dtype(at::kInt)), M, K, Kp};
  if (M == 0) return r;
  const Rows xr = as_rows(x, M, K);
  const at::Tensor& x2 = xr.t;
  const int64_t ldx = xr.ld;
  dispatch_float(x2.scalar_type(), "x", [&](auto tag) {
    using XT = typename decltype(tag)::type;
    quantize_rows(static_cast<const XT*>(x2.const_data_ptr()), ldx, M, K, Kp, aq, xor_mask,
                  r.q.mutable_data_ptr<uint8_t>(), r.s.mutable_data_ptr<float>(), r.zp.mutable_data_ptr<int32_t>());
  });
  return r;
}

// w8a8_linear into `into` when given (w8a8_linear_out), else into a new tensor of x's dtype.
at::Tensor w8a8_linear_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wsum,
                            const at::Tensor& w_scale, int64_t n, std::optional<double> input_scale,
                            std::optional<int64_t> input_zp, bool symmetric, const std::optional<at::Tensor>& bias,
                            const at::Tensor* into) {
  const char* op = into != nullptr ? "cpu_backend::w8a8_linear_out" : "cpu_backend::w8a8_linear";
  check_weights(op, qweight, wsum, n);
  const int64_t P = qweight.size(0);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.dim() == 1 &&
                  w_scale.size(0) == P * kNR,
              op, ": w_scale must be contiguous float32 [", P * kNR, "], got ", w_scale.sizes());
  Quantized qa = quantize(op, x, qweight.size(1), input_scale, input_zp, symmetric, kActXor);

  at::Tensor out = linear_result(op, x, n, x.scalar_type(), into);
  if (qa.M == 0) return out;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = padded_f32(op, *bias, n, P * kNR);
  const float* bp = bias_f32.defined() ? bias_f32.const_data_ptr<float>() : nullptr;
  const float* ws = w_scale.const_data_ptr<float>();
  const int32_t* wsm = wsum.const_data_ptr<int32_t>();
  const float* sa = qa.s.const_data_ptr<float>();
  const int32_t* zpa = qa.zp.const_data_ptr<int32_t>();
  dispatch_float(out.scalar_type(), "x", [&](auto otag) {
    using OT = typename decltype(otag)::type;
    OT* o = static_cast<OT*>(out.mutable_data_ptr());
    int8_gemm(qa.q.const_data_ptr<uint8_t>(), qa.Kp, qa.M, qweight.const_data_ptr<int8_t>(), P,
              [&](const int32_t* tile, int64_t r0, int mr, int64_t p) {
                const int64_t c0 = p * kNR;
                const int nn = int(std::min<int64_t>(kNR, n - c0));
                alignas(64) float f[kNR];
                for (int m = 0; m < mr; ++m) {
                  // exact integer correction in int64: (offset + zp) * wsum can exceed int32
                  const int64_t off = int64_t(kActOffset) + zpa[r0 + m];
                  for (int j = 0; j < kNR; ++j) {
                    f[j] = float(int64_t(tile[m * kNR + j]) - off * wsm[c0 + j]);
                  }
                  const Vec r = fma(Vec::load(f) * Vec::broadcast(sa[r0 + m]), Vec::load(ws + c0),
                                    bp ? Vec::load(bp + c0) : Vec::zero());
                  OT* dst = o + (r0 + m) * n + c0;
                  if (nn == kNR) {
                    r.store(dst);
                  } else {
                    r.store_partial(dst, nn);
                  }
                }
              });
  });
  return out;
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wsum,
                       const at::Tensor& w_scale, int64_t n, std::optional<double> input_scale,
                       std::optional<int64_t> input_zp, bool symmetric, const std::optional<at::Tensor>& bias) {
  return w8a8_linear_into(x, qweight, wsum, w_scale, n, input_scale, input_zp, symmetric, bias, nullptr);
}

// w8a8_linear into a given tensor: step graphs (cpu_backend.worker.step_graphs)
// call this with preallocated buffers.
void w8a8_linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wsum,
                     const at::Tensor& w_scale, int64_t n, std::optional<double> input_scale,
                     std::optional<int64_t> input_zp, bool symmetric, const std::optional<at::Tensor>& bias) {
  w8a8_linear_into(x, qweight, wsum, w_scale, n, input_scale, input_zp, symmetric, bias, &out);
}

// The activation quantization alone: (q int8 [M, K], scale fp32 [M], zp int32 [M]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w8a8_quantize(const at::Tensor& x, std::optional<double> input_scale,
                                                             std::optional<int64_t> input_zp, bool symmetric) {
  const int64_t K = x.size(-1);
  Quantized qa = quantize("cpu_backend::w8a8_quantize", x, ceil_div(K, 4), input_scale, input_zp, symmetric, 0);
  return {qa.q.view(at::kChar).narrow(1, 0, K).contiguous(), qa.s, qa.zp};
}

// The exact int32 product of int8 rows q [M, K] and the packed weights.
at::Tensor w8a8_int_mm(const at::Tensor& q, const at::Tensor& qweight, const at::Tensor& wsum, int64_t n) {
  const char* op = "cpu_backend::w8a8_int_mm";
  check_weights(op, qweight, wsum, n);
  const int64_t P = qweight.size(0), K4 = qweight.size(1);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && ceil_div(q.size(1), 4) == K4, op,
              ": q must be int8 [M, K] with ceil(K/4) = ", K4, ", got ", q.sizes(), " ", q.scalar_type());
  const int64_t M = q.size(0), Kp = K4 * 4;
  at::Tensor aq = at::zeros({M, Kp}, q.options().dtype(at::kByte));
  aq.narrow(1, 0, q.size(1)).copy_(q.view(at::kByte));
  if (kActXor) aq.bitwise_xor_(int64_t(kActXor));  // padding too: it must read as 0
  at::Tensor out = at::empty({M, n}, q.options().dtype(at::kInt));
  if (M == 0) return out;
  int32_t* o = out.mutable_data_ptr<int32_t>();
  const int32_t* wsm = wsum.const_data_ptr<int32_t>();
  int8_gemm(aq.const_data_ptr<uint8_t>(), Kp, M, qweight.const_data_ptr<int8_t>(), P,
            [&](const int32_t* tile, int64_t r0, int mr, int64_t p) {
              const int64_t c0 = p * kNR;
              const int nn = int(std::min<int64_t>(kNR, n - c0));
              for (int m = 0; m < mr; ++m) {
                for (int j = 0; j < nn; ++j) o[(r0 + m) * n + c0 + j] = tile[m * kNR + j] - kActOffset * wsm[c0 + j];
              }
            });
  return out;
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def(
      "w8a8_linear(Tensor x, Tensor qweight, Tensor wsum, Tensor w_scale, int n, float? input_scale=None, "
      "int? input_zp=None, bool symmetric=True, Tensor? bias=None) -> Tensor");
  m.def(
      "w8a8_linear_out(Tensor(a!) out, Tensor x, Tensor qweight, Tensor wsum, Tensor w_scale, int n, "
      "float? input_scale=None, int? input_zp=None, bool symmetric=True, Tensor? bias=None) -> ()");
  m.def("w8a8_quantize(Tensor x, float? input_scale=None, int? input_zp=None, bool symmetric=True) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("w8a8_int_mm(Tensor q, Tensor qweight, Tensor wsum, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  m.impl("w8a8_linear", &cpu_backend::w8a8_linear);
  m.impl("w8a8_linear_out", &cpu_backend::w8a8_linear_out);
  m.impl("w8a8_quantize", &cpu_backend::w8a8_quantize);
  m.impl("w8a8_int_mm", &cpu_backend::w8a8_int_mm);
}
