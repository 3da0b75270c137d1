// RMSNorm and fused residual-add + RMSNorm, rounding exactly where vLLM's
// native implementation (vllm/ir/ops/layernorm.py) rounds:
//   s   = x (+ residual)                     in fp32; residual <- T(s)
//   n   = s * rsqrt(mean(s^2) + eps)         in fp32
//   out = T( float(W(n)) * float(weight) )   weight of dtype W: x's dtype T,
//                                            or fp32 (Gemma's 1 + w, which
//                                            GemmaRMSNorm passes in fp32)
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
template <typename T, typename W>
void normalize_row(const float* buf, const W* weight, float eps, int64_t H, T* out) {
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
    VecF32x16 v = round_to<W>(VecF32x16::load_partial(buf + i, n) * scale, n);
    if (weight) v = v * VecF32x16::load_partial(weight + i, n);
    v.store_partial(out + i, n);
  }
}

// x: [rows, hidden], or [tokens, heads, head_dim] with contiguous head_dim
// (the per-head q/k norms of Qwen3 and Gemma3, a view into the fused qkv
// output): each head is a row. out is contiguous.
template <typename T, typename W>
void run(const at::Tensor& x, at::Tensor* residual, const std::optional<at::Tensor>& weight,
         double eps, at::Tensor& out) {
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1;
  const int64_t xs = x.stride(0), hs = x.dim() == 3 ? x.stride(1) : 0;
  const int64_t os = out.dim() == 3 ? H : out.stride(0);  // a 3-D out is contiguous
  const int64_t rs = residual ? residual->stride(0) : 0;
  const T* xp = data_as<const T>(x);
  T* op = data_as<T>(out);
  T* rp = residual ? data_as<T>(*residual) : nullptr;
  const W* wp = weight ? data_as<const W>(*weight) : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + (r / heads) * xs + (r % heads) * hs;
      for (int64_t i = 0; i < H; i += 16) {
        const int n = int(std::min<int64_t>(16, H - i));
        VecF32x16 v = VecF32x16::load_partial(xr + i, n);
        if (rp) {
          v = v + VecF32x16::load_partial(rp + r * rs + i, n);
          v.store_partial(rp + r * rs + i, n);  // residual <- T(x + residual)
        }
        v.store_partial(buf.data() + i, n);
      }
      normalize_row<T, W>(buf.data(), wp, float(eps), H, op + r * os);
    }
  });
}

void check_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op) {
  TORCH_CHECK(!weight.has_value() ||
                  (weight->is_contiguous() && weight->numel() == x.size(-1) &&
                   (weight->scalar_type() == x.scalar_type() || weight->scalar_type() == at::kFloat)),
              op, ": weight must be contiguous [hidden] with x's dtype or fp32");
}

void check(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be 2-D with contiguous rows");
  check_weight(x, weight, op);
}

// run<T, W> for x's dtype T and the weight's dtype W (T, or fp32).
template <typename F>
void dispatch_x_and_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op,
                           F&& f) {
  const bool fp32_weight = weight.has_value() && weight->scalar_type() == at::kFloat;
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (fp32_weight) {
      f(T{}, float{});
    } else {
      f(T{}, T{});
    }
  });
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
              double eps) {
  if (x.dim() == 3) {  // per-head rows: [tokens, heads, head_dim] into a contiguous out
    TORCH_CHECK(x.stride(2) == 1, "rms_norm: a 3-D x must have a contiguous last dimension");
    TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous(), "rms_norm: a 3-D out must be contiguous");
    check_weight(x, weight, "rms_norm");
  } else {
    check(x, weight, "rms_norm");
    TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1, "rms_norm: out must match x");
  }
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "rms_norm: out must have x's dtype");
  dispatch_x_and_weight(x, weight, "rms_norm x", [&](auto t, auto w) {
    run<decltype(t), decltype(w)>(x, nullptr, weight, eps, out);
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                        double eps) {
  check(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must match x");
  dispatch_x_and_weight(x, weight, "fused_add_rms_norm x", [&](auto t, auto w) {
    run<decltype(t), decltype(w)>(x, &residual, weight, eps, x);
  });
}

}  // namespace cpu_backend
