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
#include <utility>

#include "ops.h"

namespace cpu_backend {
namespace {

// The composites ending in linear out form `Linear(out, x, args...)`.
template <auto Linear>
struct Then;

template <typename... LinearArgs, void (*Linear)(at::Tensor&, const at::Tensor&, LinearArgs...)>
struct Then<Linear> {
  static void fused_add_rms_norm(at::Tensor& out, at::Tensor& x, at::Tensor& residual,
                                 const std::optional<at::Tensor>& norm_weight, double eps, LinearArgs... args) {
    cpu_backend::fused_add_rms_norm(x, residual, norm_weight, eps);
    Linear(out, x, args...);
  }

  static void silu_and_mul(at::Tensor& out, at::Tensor& act, const at::Tensor& x, LinearArgs... args) {
    cpu_backend::silu_and_mul(act, x);
    Linear(out, act, args...);
  }
};

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
  m.impl(composite(kNorm, kLinear).c_str(), &Then<&linear_out>::fused_add_rms_norm);
  m.impl(composite(kNorm, kWna16).c_str(), &Then<&wna16_linear_out>::fused_add_rms_norm);
  m.impl(composite(kNorm, kW8a8).c_str(), &Then<&w8a8_linear_out>::fused_add_rms_norm);
  m.impl(composite(kSilu, kLinear).c_str(), &Then<&linear_out>::silu_and_mul);
  m.impl(composite(kSilu, kWna16).c_str(), &Then<&wna16_linear_out>::silu_and_mul);
  m.impl(composite(kSilu, kW8a8).c_str(), &Then<&w8a8_linear_out>::silu_and_mul);
}
