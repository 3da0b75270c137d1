// RMSNorm and fused residual-add + RMSNorm, rounding exactly where vLLM's
// native implementation (vllm/ir/ops/layernorm.py) rounds:
//   s   = x (+ residual)                     in fp32; residual <- T(s)
//   n   = s * rsqrt(mean(s^2) + eps)         in fp32
//   out = T( float(T(n)) * float(weight) )   (weight has x's dtype T)
// One row per task; the row is read twice (sum of squares, then scale), which
// stays in L1/L2 for hidden sizes up to several thousand.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "ops.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

// Round fp32 lanes to T and back (identity for fp32).
template <typename T>
CB_ALWAYS_INLINE VecF32x16 round_to(VecF32x16 v, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[16];
    v.store_partial(tmp, n);
    return VecF32x16::load_partial(tmp, n);
  }
}

// sum: fp32 row (x + residual), already in `buf`; writes out (and nothing else).
template <typename T>
void normalize_row(const float* buf, const T* weight, float eps, int64_t H, T* out) {
  VecF32x16 sq = VecF32x16::zero();
  for (int64_t i = 0; i < H; i += 16) {
    const int n = int(std::min<int64_t>(16, H - i));
    VecF32x16 v = VecF32x16::load_partial(buf + i, n);
    sq = fma(v, v, sq);
  }
  const float inv = 1.f / std::sqrt(sq.reduce_add() / float(H) + eps);
  const VecF32x16 scale = VecF32x16::broadcast(inv);
  for (int64_t i = 0; i < H; i += 16) {
    const int n = int(std::min<int64_t>(16, H - i));
    VecF32x16 v = round_to<T>(VecF32x16::load_partial(buf + i, n) * scale, n);
    if (weight) v = v * VecF32x16::load_partial(weight + i, n);
    v.store_partial(out + i, n);
  }
}

template <typename T>
void run(const at::Tensor& x, at::Tensor* residual, const std::optional<at::Tensor>& weight,
         double eps, at::Tensor& out) {
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t rs = residual ? residual->stride(0) : 0;
  const T* xp = data_as<const T>(x);
  T* op = data_as<T>(out);
  T* rp = residual ? data_as<T>(*residual) : nullptr;
  const T* wp = weight ? data_as<const T>(*weight) : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      for (int64_t i = 0; i < H; i += 16) {
        const int n = int(std::min<int64_t>(16, H - i));
        VecF32x16 v = VecF32x16::load_partial(xr + i, n);
        if (rp) {
          v = v + VecF32x16::load_partial(rp + r * rs + i, n);
          v.store_partial(rp + r * rs + i, n);  // residual <- T(x + residual)
        }
        v.store_partial(buf.data() + i, n);
      }
      normalize_row<T>(buf.data(), wp, float(eps), H, op + r * os);
    }
  });
}

void check(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be 2-D with contiguous rows");
  TORCH_CHECK(!weight.has_value() || (weight->is_contiguous() && weight->numel() == x.size(1) &&
                                      weight->scalar_type() == x.scalar_type()),
              op, ": weight must be contiguous [hidden] with x's dtype");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
              double eps) {
  check(x, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must match x");
  dispatch_float(x.scalar_type(), "rms_norm x", [&](auto tag) {
    run<typename decltype(tag)::type>(x, nullptr, weight, eps, out);
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                        double eps) {
  check(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must match x");
  dispatch_float(x.scalar_type(), "fused_add_rms_norm x", [&](auto tag) {
    run<typename decltype(tag)::type>(x, &residual, weight, eps, x);
  });
}

}  // namespace cpu_backend
