// Step-graph composites: an elementwise op and the linear reading what it
// wrote, in one call. cpu_backend.worker.step_graphs records one of these in
// place of the two calls when they come back to back in a step (a decoder
// layer's residual add + RMSNorm before qkv and gate_up, SiLU-and-mul before
// down): one Python line and one dispatcher round trip fewer each, which after
// a streaming GEMV cost a few microseconds. The same kernels run in the same
// order, so the results are those of the two calls, bit for bit.
//
// Every prologue pairs with every linear out form (float, int4/int8 weights
// with 16-bit activations, W8A8): a composite's schema is the prologue's
// arguments, then the linear's without its x.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "ops.h"

namespace cpu_backend {
namespace {

template <auto Linear, typename... LinearArgs>
void fused_add_rms_norm_then(at::Tensor& out, at::Tensor& x, at::Tensor& residual,
                             const std::optional<at::Tensor>& norm_weight, double eps, LinearArgs... args) {
  fused_add_rms_norm(x, residual, norm_weight, eps);
  Linear(out, x, args...);
}

template <auto Linear, typename... LinearArgs>
void silu_and_mul_then(at::Tensor& out, at::Tensor& act, const at::Tensor& x, LinearArgs... args) {
  silu_and_mul(act, x);
  Linear(out, act, args...);
}

using OptTensor = const std::optional<at::Tensor>&;
using Tensor = const at::Tensor&;

// Each linear out form: its name and its arguments after (out, x).
constexpr const char* kLinear = "linear_out";
constexpr const char* kLinearArgs = "Tensor packed_weight, int n, Tensor? bias=None";
constexpr const char* kWna16 = "wna16_linear_out";
constexpr const char* kWna16Args =
    "Tensor qweight, Tensor scales, Tensor zs, int bits, int group_size, int n, Tensor? perm=None, "
    "Tensor? bias=None, bool int8_act=False";
constexpr const char* kW8a8 = "w8a8_linear_out";
constexpr const char* kW8a8Args =
    "Tensor qweight, Tensor wsum, Tensor w_scale, int n, float? input_scale=None, int? input_zp=None, "
    "bool symmetric=True, Tensor? bias=None";

// Each prologue: its name and its arguments (x being the one the linear reads).
constexpr const char* kNorm = "fused_add_rms_norm";
constexpr const char* kNormArgs = "Tensor(b!) x, Tensor(c!) residual, Tensor? norm_weight, float eps";
constexpr const char* kSilu = "silu_and_mul";
constexpr const char* kSiluArgs = "Tensor(b!) act, Tensor x";

std::string composite(const char* prologue, const char* linear) {
  return std::string(prologue) + "_" + linear;
}

std::string schema(const char* prologue, const char* prologue_args, const char* linear,
                   const char* linear_args) {
  return composite(prologue, linear) + "(Tensor(a!) out, " + prologue_args + ", " + linear_args + ") -> ()";
}

}  // namespace
}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  using namespace cpu_backend;
  for (auto [prologue, args] : {std::pair{kNorm, kNormArgs}, std::pair{kSilu, kSiluArgs}}) {
    m.def(schema(prologue, args, kLinear, kLinearArgs).c_str());
    m.def(schema(prologue, args, kWna16, kWna16Args).c_str());
    m.def(schema(prologue, args, kW8a8, kW8a8Args).c_str());
  }
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  using namespace cpu_backend;
  // (x, packed_weight, n, bias) / (x, qweight, ..., int8_act) / (x, qweight, ..., bias) after out
#define CB_LINEAR_ARGS Tensor, int64_t, OptTensor
#define CB_WNA16_ARGS Tensor, Tensor, Tensor, int64_t, int64_t, int64_t, OptTensor, OptTensor, bool
#define CB_W8A8_ARGS Tensor, Tensor, Tensor, int64_t, std::optional<double>, std::optional<int64_t>, bool, OptTensor
  m.impl(composite(kNorm, kLinear).c_str(), &fused_add_rms_norm_then<&linear_out, CB_LINEAR_ARGS>);
  m.impl(composite(kNorm, kWna16).c_str(), &fused_add_rms_norm_then<&wna16_linear_out, CB_WNA16_ARGS>);
  m.impl(composite(kNorm, kW8a8).c_str(), &fused_add_rms_norm_then<&w8a8_linear_out, CB_W8A8_ARGS>);
  m.impl(composite(kSilu, kLinear).c_str(), &silu_and_mul_then<&linear_out, CB_LINEAR_ARGS>);
  m.impl(composite(kSilu, kWna16).c_str(), &silu_and_mul_then<&wna16_linear_out, CB_WNA16_ARGS>);
  m.impl(composite(kSilu, kW8a8).c_str(), &silu_and_mul_then<&w8a8_linear_out, CB_W8A8_ARGS>);
#undef CB_LINEAR_ARGS
#undef CB_WNA16_ARGS
#undef CB_W8A8_ARGS
}
