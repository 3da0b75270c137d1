// Step-graph composites: an elementwise op and the linear reading what it
// wrote, in one call. cpu_backend.worker.step_graphs records one of these in
// place of the two calls when they come back to back in a step (a decoder
// layer's residual add + RMSNorm before qkv and gate_up, SiLU-and-mul before
// down): one Python line and one dispatcher round trip fewer each, which after
// a streaming GEMV cost a few microseconds. The same kernels run in the same
// order, so the results are those of the two calls, bit for bit.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "ops.h"

namespace cpu_backend {

void fused_add_rms_norm_linear_out(at::Tensor& out, at::Tensor& x, at::Tensor& residual,
                                   const std::optional<at::Tensor>& norm_weight, double eps,
                                   const at::Tensor& packed_weight, int64_t n, const std::optional<at::Tensor>& bias) {
  fused_add_rms_norm(x, residual, norm_weight, eps);
  linear_out(out, x, packed_weight, n, bias);
}

void silu_and_mul_linear_out(at::Tensor& out, at::Tensor& act, const at::Tensor& x, const at::Tensor& packed_weight,
                             int64_t n, const std::optional<at::Tensor>& bias) {
  silu_and_mul(act, x);
  linear_out(out, act, packed_weight, n, bias);
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def(
      "fused_add_rms_norm_linear_out(Tensor(a!) out, Tensor(b!) x, Tensor(c!) residual, Tensor? norm_weight, "
      "float eps, Tensor packed_weight, int n, Tensor? bias=None) -> ()");
  m.def(
      "silu_and_mul_linear_out(Tensor(a!) out, Tensor(b!) act, Tensor x, Tensor packed_weight, int n, "
      "Tensor? bias=None) -> ()");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  m.impl("fused_add_rms_norm_linear_out", &cpu_backend::fused_add_rms_norm_linear_out);
  m.impl("silu_and_mul_linear_out", &cpu_backend::silu_and_mul_linear_out);
}
