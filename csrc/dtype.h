// torch dtypes -> the kernels' element types (vec/vec_common.h), in one place.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

}  // namespace cpu_backend
