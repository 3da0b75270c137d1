// Rotary position embedding, in place on query and key, as vLLM's
// `rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`.
//
// cos_sin_cache: [max_position, rotary_dim], a row = cos[rotary_dim/2] then
// sin[rotary_dim/2] (bf16/fp16/fp32, any of them with any query dtype). Only
// the first rotary_dim elements of each head rotate (partial rotary); the
// rest pass through. Pairs are (x[i], x[i + rotary_dim/2]) in the neox style
// and (x[2i], x[2i+1]) in the gpt-j style:
//   x1' = x1 cos - x2 sin;  x2' = x2 cos + x1 sin
// computed in fp32 and rounded once to the query dtype. Parallel over tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "dtype.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

template <typename T, typename C>
void rotate_heads(T* x, int64_t num_heads, int64_t head_size, const C* cos, const C* sin, int64_t half,
                  bool neox) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* xh = x + h * head_size;
    if (neox) {
      for (int64_t i = 0; i < half; i += 16) {
        const int n = int(std::min<int64_t>(16, half - i));
        const VecF32x16 c = VecF32x16::load_partial(cos + i, n), s = VecF32x16::load_partial(sin + i, n);
        const VecF32x16 x1 = VecF32x16::load_partial(xh + i, n), x2 = VecF32x16::load_partial(xh + half + i, n);
        (x1 * c - x2 * s).store_partial(xh + i, n);
        (x2 * c + x1 * s).store_partial(xh + half + i, n);
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float c = to_f32(cos[i]), s = to_f32(sin[i]);
        const float x1 = to_f32(xh[2 * i]), x2 = to_f32(xh[2 * i + 1]);
        xh[2 * i] = from_f32<T>(x1 * c - x2 * s);
        xh[2 * i + 1] = from_f32<T>(x2 * c + x1 * s);
      }
    }
  }
}

// The heads of one token in t ([tokens, H*D] or [tokens, H, D], heads
// contiguous within a token) and the token stride. Read off the sizes and
// strides: no view per call (a decode step calls this once per layer).
struct TokenHeads {
  int64_t heads;
  int64_t stride;
};
TokenHeads heads_of(const at::Tensor& t, int64_t tokens, int64_t head_size, const char* name) {
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(0) == tokens && t.stride(-1) == 1, "rotary_embedding: ",
              name, " must be [tokens, heads * head_size] or [tokens, heads, head_size] with its first dim "
              "matching positions and a contiguous last dim, got ", t.sizes());
  const int64_t per_token = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK(per_token % head_size == 0, "rotary_embedding: ", name, " holds ", per_token,
              " elements per token, not a multiple of head_size ", head_size);
  TORCH_CHECK(t.dim() == 2 || t.size(1) <= 1 || t.stride(1) == t.size(2), "rotary_embedding: ", name,
              " heads must be contiguous within a token");
  return {per_token / head_size, t.stride(0)};
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  // positions as contiguous int64: the engine's own tensor as it is, else a copy
  const bool direct = positions.scalar_type() == at::kLong && positions.is_contiguous();
  const at::Tensor pos = direct ? positions : positions.reshape(-1).to(at::kLong).contiguous();
  const int64_t tokens = pos.numel();
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "rotary_embedding: cos_sin_cache must be a contiguous [max_position, rotary_dim]");
  const int64_t rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= head_size, "rotary_embedding: rotary_dim ", rot,
              " must be even and at most head_size ", head_size);
  const TokenHeads q = heads_of(query, tokens, head_size, "query");
  TokenHeads k{0, 0};
  if (key.has_value()) {
    TORCH_CHECK(key->scalar_type() == query.scalar_type(), "rotary_embedding: key must have query's dtype");
    k = heads_of(*key, tokens, head_size, "key");
  }
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding: position ", pp[t],
                " outside the cos/sin cache of ", max_pos, " positions");
  const int64_t hq = q.heads, hk = k.heads, qs = q.stride, ks = k.stride;
  dispatch_float(query.scalar_type(), "rotary_embedding query", [&](auto qtag) {
    using T = typename decltype(qtag)::type;
    dispatch_float(cos_sin_cache.scalar_type(), "rotary_embedding cos_sin_cache", [&](auto ctag) {
      using C = typename decltype(ctag)::type;
      T* qp = data_as<T>(query);
      T* kp = key.has_value() ? data_as<T>(*key) : nullptr;
      const C* cache = data_as<const C>(cos_sin_cache);
      at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const C* cos = cache + pp[t] * rot;
          rotate_heads(qp + t * qs, hq, head_size, cos, cos + half, half, is_neox);
          if (kp) rotate_heads(kp + t * ks, hk, head_size, cos, cos + half, half, is_neox);
        }
      });
    });
  });
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
}

TORCH_LIBRARY_IMPL(cpu_backend, CPU, m) { m.impl("rotary_embedding", &cpu_backend::rotary_embedding); }
