// Paged attention over the KV cache, one kernel for decode, prefill, chunked
// prefill and prefix-cache hits.
//
// Every query token t carries its request row (for the block table) and its
// position p: it attends keys at positions max(0, p - window + 1) .. p of that
// request. A decode token is p = seq_len - 1; a prefill chunk over a cached
// prefix of c tokens has p = c, c + 1, ... So a batch mixing decodes and
// prefill chunks is one call.
//
// KV cache: [num_blocks, num_kv_heads, block_size, row], each row a token's
// key then value (vLLM's LBHNC layout), in the model's dtype or a quantized
// format (kv_format.h: fp8 with a per-tensor scale, int8/fp8 with
// per-(token, head) scales). Work items are (query token, kv head); the query
// heads of a GQA group share each key/value row read, widened to fp32 in
// registers. Scales are folded in: a per-tensor key scale into the query, a
// per-row key scale into the score, value scales into the probabilities
// (per row) or the final normalization (per tensor). Online softmax per
// block, in fp32, scores and exp scalar (they are a small part of the work),
// dot products and value accumulation vectorized.
//
// Python reference: cpu_backend/attention/paged_torch.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtype.h"
#include "kv_format.h"
#include "ops.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

constexpr int kMaxHeadSize = 256;
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kMaxBlockSize = 256;

struct Params {
  int64_t num_tokens, num_heads, num_kv_heads, head_size, block_size;
  int64_t bt_stride, max_blocks;
  float scale, softcap;
  float k_scale, v_scale;  // per-tensor (1 unless the format has one)
  int64_t window;  // <= 0: none
  const float* alibi;  // [num_heads] or null
};

template <typename T, typename KV>
void attend_token(const Params& P, const T* q, const typename KV::elem* kv_cache,
                  const int32_t* block_row, int64_t pos, int64_t kv_head, T* out) {
  using E = typename KV::elem;
  const int64_t D = P.head_size, G = P.num_heads / P.num_kv_heads, NV = D / 16;
  const int64_t first_head = kv_head * G;
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
  const int64_t token_stride = KV::row_elems(D);
  const int64_t head_stride = P.block_size * token_stride;
  const int64_t block_stride = P.num_kv_heads * head_stride;

  alignas(64) float qs[kMaxGroup][kMaxHeadSize];
  alignas(64) float acc[kMaxGroup][kMaxHeadSize];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  alignas(64) float scores[kMaxGroup * kMaxBlockSize];

  const VecF32x16 q_scale = VecF32x16::broadcast(P.scale * P.k_scale);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + (first_head + g) * D;
    for (int64_t i = 0; i < NV; ++i) {
      (VecF32x16::load(qg + 16 * i) * q_scale).store(qs[g] + 16 * i);
      VecF32x16::zero().store(acc[g] + 16 * i);
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
  }

  for (int64_t b = start / P.block_size; b * P.block_size <= pos; ++b) {
    const E* block = kv_cache + int64_t(block_row[b]) * block_stride + kv_head * head_stride;
    const int64_t t0 = std::max(start, b * P.block_size);
    const int64_t t1 = std::min(pos + 1, (b + 1) * P.block_size);
    const int64_t n = t1 - t0;
    // scores[g][j] for keys t0 + j
    for (int64_t j = 0; j < n; ++j) {
      const E* k = block + (t0 + j - b * P.block_size) * token_stride;
      VecF32x16 kv[kMaxHeadSize / 16];
      for (int64_t i = 0; i < NV; ++i) kv[i] = VecF32x16::load(k + 16 * i);
      float row_scale = 1.f;
      if constexpr (KV::kTokenScales) row_scale = KV::key_scale(k, D);
      for (int64_t g = 0; g < G; ++g) {
        VecF32x16 s = VecF32x16::zero();
        for (int64_t i = 0; i < NV; ++i) s = fma(VecF32x16::load(qs[g] + 16 * i), kv[i], s);
        float score = s.reduce_add();
        if constexpr (KV::kTokenScales) score *= row_scale;
        if (P.softcap > 0.f) score = P.softcap * std::tanh(score / P.softcap);
        if (P.alibi) score += P.alibi[first_head + g] * float(t0 + j - pos);
        scores[g * P.block_size + j] = score;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * P.block_size;
      float block_max = *std::max_element(sg, sg + n);
      const float new_max = std::max(running_max[g], block_max);
      const float correction = std::exp(running_max[g] - new_max);
      float block_sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - new_max);
        block_sum += sg[j];
      }
      running_sum[g] = running_sum[g] * correction + block_sum;
      running_max[g] = new_max;
      if (correction != 1.f) {
        const VecF32x16 c = VecF32x16::broadcast(correction);
        for (int64_t i = 0; i < NV; ++i) (VecF32x16::load(acc[g] + 16 * i) * c).store(acc[g] + 16 * i);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const E* row = block + (t0 + j - b * P.block_size) * token_stride;
      const E* v = row + D;
      float probs[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) probs[g] = scores[g * P.block_size + j];
      if constexpr (KV::kTokenScales) {
        const float vs = KV::value_scale(row, D);
        for (int64_t g = 0; g < G; ++g) probs[g] *= vs;
      }
      for (int64_t i = 0; i < NV; ++i) {
        const VecF32x16 vv = VecF32x16::load(v + 16 * i);
        for (int64_t g = 0; g < G; ++g) {
          const VecF32x16 p = VecF32x16::broadcast(probs[g]);
          fma(p, vv, VecF32x16::load(acc[g] + 16 * i)).store(acc[g] + 16 * i);
        }
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    const VecF32x16 inv = VecF32x16::broadcast(P.v_scale / running_sum[g]);
    T* og = out + (first_head + g) * D;
    for (int64_t i = 0; i < NV; ++i) (VecF32x16::load(acc[g] + 16 * i) * inv).store(og + 16 * i);
  }
}

template <typename T, typename KV>
void run(const Params& P, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& token_req, const at::Tensor& token_pos) {
  const T* q = data_as<const T>(query);
  const auto* kv = data_as<const typename KV::elem>(kv_cache);
  T* o = data_as<T>(out);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* req = token_req.data_ptr<int32_t>();
  const int32_t* pos = token_pos.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, P.num_tokens * P.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / P.num_kv_heads, h = item % P.num_kv_heads;
      attend_token<T, KV>(P, q + t * q_stride, kv, bt + int64_t(req[t]) * P.bt_stride, pos[t], h,
                      o + t * o_stride);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& token_req,
                     const at::Tensor& token_pos, double scale, int64_t sliding_window,
                     double softcap, const std::optional<at::Tensor>& alibi_slopes,
                     int64_t kv_format, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention: query/out must be [tokens, heads, head_size]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be a contiguous [blocks, kv_heads, block_size, 2*head_size]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_attention: query and out must share one dtype");
  TORCH_CHECK(kv_format == kKvPlain ? kv_cache.scalar_type() == query.scalar_type() : kv_cache.element_size() == 1,
              "paged_attention: kv_cache must have the query's dtype, or 1-byte elements for kv_format ",
              kv_format);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "paged_attention: query/out heads must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "paged_attention: block_table must be int32 with contiguous rows");
  TORCH_CHECK(token_req.scalar_type() == at::kInt && token_pos.scalar_type() == at::kInt &&
                  token_req.is_contiguous() && token_pos.is_contiguous() &&
                  token_req.numel() == query.size(0) && token_pos.numel() == query.size(0),
              "paged_attention: token_req/token_pos must be contiguous int32 [tokens]");
  Params P;
  P.num_tokens = query.size(0);
  P.num_heads = query.size(1);
  P.head_size = query.size(2);
  P.num_kv_heads = kv_cache.size(1);
  P.block_size = kv_cache.size(2);
  P.bt_stride = block_table.stride(0);
  P.max_blocks = block_table.size(1);
  const bool token_scales = kv_format == kKvInt8TokenHead || kv_format == kKvFp8E4M3TokenHead;
  TORCH_CHECK(kv_cache.size(3) == 2 * P.head_size + (token_scales ? 8 : 0),
              "paged_attention: kv_cache rows must be 2*head_size", token_scales ? " + 8" : "",
              " elements for kv_format ", kv_format, ", got ", kv_cache.size(3));
  TORCH_CHECK(P.head_size % 16 == 0 && P.head_size <= kMaxHeadSize,
              "paged_attention: head_size must be a multiple of 16 up to 256, got ", P.head_size);
  TORCH_CHECK(P.num_heads % P.num_kv_heads == 0 && P.num_heads / P.num_kv_heads <= kMaxGroup,
              "paged_attention: num_heads must be a multiple of num_kv_heads, at most ", kMaxGroup, "x");
  TORCH_CHECK(P.block_size <= kMaxBlockSize, "paged_attention: block_size must be at most ", kMaxBlockSize);
  P.scale = float(scale);
  P.softcap = float(softcap);
  P.window = sliding_window;
  P.k_scale = token_scales ? 1.f : float(k_scale);
  P.v_scale = token_scales ? 1.f : float(v_scale);
  at::Tensor alibi;
  P.alibi = nullptr;
  if (alibi_slopes.has_value()) {
    alibi = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(alibi.numel() == P.num_heads, "paged_attention: one ALiBi slope per head");
    P.alibi = alibi.data_ptr<float>();
  }
  dispatch_float(query.scalar_type(), "paged_attention query", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool known = dispatch_kv_format<T>(kv_format, [&](auto layout) {
      run<T, decltype(layout)>(P, out, query, kv_cache, block_table, token_req, token_pos);
    });
    TORCH_CHECK(known, "paged_attention: unknown kv_format ", kv_format);
  });
}

}  // namespace cpu_backend
