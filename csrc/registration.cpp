// Op schemas and their CPU kernels. Each ISA's library registers the same
// names; cpu_backend.ops.load() loads exactly one library per process.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(cpu_backend, m) {
  m.def("isa() -> str", &cpu_backend::isa);
  m.def("linear_pack_nr() -> int", &cpu_backend::linear_pack_nr);
  m.def("linear_pack_pairs(ScalarType dtype) -> bool", &cpu_backend::linear_pack_pairs);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed_weight, int n, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor token_req, Tensor token_pos, float scale, int sliding_window, float softcap, "
      "Tensor? alibi_slopes, int kv_format=0, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "int kv_format=0, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor? weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  m.impl("pack_linear_weight", &cpu_backend::pack_linear_weight);
  m.impl("linear", &cpu_backend::linear);
  m.impl("paged_attention", &cpu_backend::paged_attention);
  m.impl("write_kv_cache", &cpu_backend::write_kv_cache);
  m.impl("rms_norm", &cpu_backend::rms_norm);
  m.impl("fused_add_rms_norm", &cpu_backend::fused_add_rms_norm);
}
