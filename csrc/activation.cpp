// Gated activations of the MLP: out = act(x[..., :d]) * x[..., d:] for
// act = SiLU (SwiGLU) and GELU, exact (erf) or tanh-approximated (GeGLU),
// with the vectorized exp/tanh/erf of vec/vec_math.h.
//
// Rounding follows the host's native forward (F.silu / F.gelu, then `*`):
// the activation is rounded to the model dtype T before the product, which is
// rounded again: out = T(float(T(act(a))) * float(b)). fp32 rounds nowhere.
//
// Also `vec_unary(x, fn)`: the vector math functions on an fp32 tensor, so
// the tests can compare them with torch directly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "dtype.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

enum class Act { kSilu, kGeluErf, kGeluTanh };

template <Act A>
CB_ALWAYS_INLINE VecF32x16 activate(VecF32x16 x) {
  if constexpr (A == Act::kSilu) return silu(x);
  if constexpr (A == Act::kGeluErf) return gelu_erf(x);
  if constexpr (A == Act::kGeluTanh) return gelu_tanh(x);
}

// Round fp32 lanes to T and back (identity for fp32).
template <typename T>
CB_ALWAYS_INLINE VecF32x16 round_to(VecF32x16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[16];
    v.store(tmp);
    return VecF32x16::load(tmp);
  }
}

constexpr int64_t kChunk = 512;  // columns per task

template <typename T, Act A>
void gated(at::Tensor& out, const at::Tensor& x) {
  const int64_t d = out.size(-1), rows = out.numel() / std::max<int64_t>(d, 1);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const T* xp = data_as<const T>(x);
  T* op = data_as<T>(out);
  const int64_t chunks = (d + kChunk - 1) / kChunk;
  // grain: enough elements per task to cover the fork/join
  const int64_t grain = std::max<int64_t>(1, 4096 / std::min(d, kChunk));
  at::parallel_for(0, rows * chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c0 = (task % chunks) * kChunk, c1 = std::min(d, c0 + kChunk);
      const T* a = xp + r * xs;
      const T* b = a + d;
      T* o = op + r * os;
      int64_t i = c0;
      for (; i + 16 <= c1; i += 16)
        (round_to<T>(activate<A>(VecF32x16::load(a + i))) * VecF32x16::load(b + i)).store(o + i);
      if (i < c1) {
        const int n = int(c1 - i);
        VecF32x16 act = activate<A>(VecF32x16::load_partial(a + i, n));
        if constexpr (!std::is_same_v<T, float>) {
          T tmp[16];
          act.store_partial(tmp, n);
          act = VecF32x16::load_partial(tmp, n);
        }
        (act * VecF32x16::load_partial(b + i, n)).store_partial(o + i, n);
      }
    }
  });
}

void run(at::Tensor& out, const at::Tensor& x, Act act, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              op, ": x must be 2-D [tokens, 2*d] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) / 2 && out.scalar_type() == x.scalar_type(),
              op, ": out must be [tokens, d] with x's dtype and contiguous rows");
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (act) {
      case Act::kSilu: return gated<T, Act::kSilu>(out, x);
      case Act::kGeluErf: return gated<T, Act::kGeluErf>(out, x);
      case Act::kGeluTanh: return gated<T, Act::kGeluTanh>(out, x);
    }
  });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) { run(out, x, Act::kSilu, "silu_and_mul"); }

void gelu_and_mul(at::Tensor& out, const at::Tensor& x, const std::string& approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "gelu_and_mul: approximate must be 'none' or 'tanh', got '", approximate, "'");
  run(out, x, approximate == "tanh" ? Act::kGeluTanh : Act::kGeluErf, "gelu_and_mul");
}

at::Tensor vec_unary(const at::Tensor& x, const std::string& fn) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "vec_unary: x must be float32");
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options());
  const float* xp = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = in.numel();
  const auto apply = [&](auto f) {
    for (int64_t i = 0; i < n; i += 16) {
      const int m = int(std::min<int64_t>(16, n - i));
      f(VecF32x16::load_partial(xp + i, m)).store_partial(op + i, m);
    }
  };
  if (fn == "exp") apply([](VecF32x16 v) { return exp(v); });
  else if (fn == "tanh") apply([](VecF32x16 v) { return tanh(v); });
  else if (fn == "erf") apply([](VecF32x16 v) { return erf(v); });
  else if (fn == "silu") apply([](VecF32x16 v) { return silu(v); });
  else if (fn == "gelu") apply([](VecF32x16 v) { return gelu_erf(v); });
  else if (fn == "gelu_tanh") apply([](VecF32x16 v) { return gelu_tanh(v); });
  else TORCH_CHECK(false, "vec_unary: unknown fn '", fn, "'");
  return out;
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor x, str approximate='none') -> ()");
  m.def("vec_unary(Tensor x, str fn) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) {
  m.impl("silu_and_mul", &cpu_backend::silu_and_mul);
  m.impl("gelu_and_mul", &cpu_backend::gelu_and_mul);
  m.impl("vec_unary", &cpu_backend::vec_unary);
}
