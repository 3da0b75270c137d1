// torch dtypes -> the kernels' element types (vec/vec_common.h), in one place.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "vec/vec_common.h"

namespace cpu_backend {

// CType<torch scalar>::type is the layout-compatible kernel element type.
template <typename T>
struct CType;
template <>
struct CType<float> {
  using type = float;
};
template <>
struct CType<c10::BFloat16> {
  using type = bf16_t;
};
template <>
struct CType<c10::Half> {
  using type = fp16_t;
};

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Calls f(tag) with tag's ::type the kernel element type for dtype.
template <typename F>
void dispatch_float(at::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(CType<float>{});
    case at::kBFloat16:
      return f(CType<c10::BFloat16>{});
    case at::kHalf:
      return f(CType<c10::Half>{});
    default:
      TORCH_CHECK(false, "cpu_backend: ", what, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

// The tensor's data as the kernel element type E.
template <typename E>
E* data_as(const at::Tensor& t) {
  return reinterpret_cast<E*>(t.data_ptr());
}

// A linear's bias [n] (any float dtype) as contiguous fp32, zero padded to
// `padded` values (whole panels: the epilogues load 16 at a time). One
// allocation and a loop: zeros + narrow + copy_ cost three dispatcher calls,
// ~12 us per decode-step linear on a 2-core VM.
inline at::Tensor padded_f32(const char* op, const at::Tensor& bias, int64_t n, int64_t padded) {
  TORCH_CHECK(bias.device().is_cpu() && bias.dim() == 1 && bias.size(0) == n && padded >= n, op,
              ": bias must be a CPU tensor [", n, "], got ", bias.sizes());
  at::Tensor out = at::empty({padded}, bias.options().dtype(at::kFloat));
  float* dst = out.mutable_data_ptr<float>();
  const at::Tensor src = bias.contiguous();
  dispatch_float(src.scalar_type(), "bias", [&](auto tag) {
    using BT = typename decltype(tag)::type;
    const BT* b = static_cast<const BT*>(src.const_data_ptr());
    for (int64_t j = 0; j < n; ++j) dst[j] = to_f32(b[j]);
  });
  std::fill(dst + n, dst + padded, 0.0f);
  return out;
}

// A linear op's result: x's leading shape with n columns. A given `into` (the
// op's _out form, called by step graphs with preallocated buffers) is checked
// and used; else a fresh contiguous tensor of out_type.
inline at::Tensor linear_result(const char* op, const at::Tensor& x, int64_t n, at::ScalarType out_type,
                                const at::Tensor* into) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  if (into == nullptr) {
    TORCH_CHECK(is_supported_float(out_type), op, ": out_dtype must be float32, bfloat16 or float16, got ",
                out_type);
    return at::empty(shape, x.options().dtype(out_type).memory_format(at::MemoryFormat::Contiguous));
  }
  TORCH_CHECK(into->sizes() == at::IntArrayRef(shape) && into->is_contiguous() && into->device().is_cpu() &&
                  is_supported_float(into->scalar_type()),
              op, ": out must be a contiguous float32/bfloat16/float16 CPU tensor of shape ", at::IntArrayRef(shape),
              ", got ", into->sizes(), " ", into->scalar_type());
  return *into;
}

// x [..., K] as M rows of K unit-stride values: the tensor to read and its
// row stride. A contiguous x is used as it is: no reshape call per decode-step
// linear (~2 us each on a 2-core VM).
struct Rows {
  at::Tensor t;
  int64_t ld;
};
inline Rows as_rows(const at::Tensor& x, int64_t M, int64_t K) {
  if (x.is_contiguous()) return {x, K};
  at::Tensor r = x.reshape({M, K});
  if (K > 1 && r.stride(1) != 1) r = r.contiguous();
  return {r, r.stride(0)};
}

}  // namespace cpu_backend
