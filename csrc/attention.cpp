// Paged attention over the KV cache, one kernel for decode, prefill, chunked
// prefill and prefix-cache hits, and the KV-cache write.
//
// Every query token t carries its request row (for the block table) and its
// position p: it attends keys at positions max(0, p - window + 1) .. p of that
// request. A decode token is p = seq_len - 1; a prefill chunk over a cached
// prefix of c tokens has p = c, c + 1, ... So a batch mixing decodes and
// prefill chunks is one call.
//
// KV cache: [num_blocks, num_kv_heads, block_size, 2 * head_size], each
// token's key then value (vLLM's LBHNC layout). Work items are
// (query token, kv head); the query heads of a GQA group share each key/value
// row read. Online softmax per block, in fp32, scores and exp scalar (they are
// a small part of the work), dot products and value accumulation vectorized.
//
// Python reference: cpu_backend/attention/paged_torch.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dtype.h"
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
  int64_t window;  // <= 0: none
  const float* alibi;  // [num_heads] or null
};

template <typename T>
void attend_token(const Params& P, const T* q, const T* kv_cache, const int32_t* block_row,
                  int64_t pos, int64_t kv_head, T* out) {
  const int64_t D = P.head_size, G = P.num_heads / P.num_kv_heads, NV = D / 16;
  const int64_t first_head = kv_head * G;
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
  const int64_t token_stride = 2 * D;
  const int64_t head_stride = P.block_size * token_stride;
  const int64_t block_stride = P.num_kv_heads * head_stride;

  alignas(64) float qs[kMaxGroup][kMaxHeadSize];
  alignas(64) float acc[kMaxGroup][kMaxHeadSize];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  alignas(64) float scores[kMaxGroup * kMaxBlockSize];

  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + (first_head + g) * D;
    for (int64_t i = 0; i < NV; ++i) {
      (VecF32x16::load(qg + 16 * i) * VecF32x16::broadcast(P.scale)).store(qs[g] + 16 * i);
      VecF32x16::zero().store(acc[g] + 16 * i);
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
  }

  for (int64_t b = start / P.block_size; b * P.block_size <= pos; ++b) {
    const T* block = kv_cache + int64_t(block_row[b]) * block_stride + kv_head * head_stride;
    const int64_t t0 = std::max(start, b * P.block_size);
    const int64_t t1 = std::min(pos + 1, (b + 1) * P.block_size);
    const int64_t n = t1 - t0;
    // scores[g][j] for keys t0 + j
    for (int64_t j = 0; j < n; ++j) {
      const T* k = block + (t0 + j - b * P.block_size) * token_stride;
      VecF32x16 kv[kMaxHeadSize / 16];
      for (int64_t i = 0; i < NV; ++i) kv[i] = VecF32x16::load(k + 16 * i);
      for (int64_t g = 0; g < G; ++g) {
        VecF32x16 s = VecF32x16::zero();
        for (int64_t i = 0; i < NV; ++i) s = fma(VecF32x16::load(qs[g] + 16 * i), kv[i], s);
        float score = s.reduce_add();
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
      const T* v = block + (t0 + j - b * P.block_size) * token_stride + D;
      for (int64_t i = 0; i < NV; ++i) {
        const VecF32x16 vv = VecF32x16::load(v + 16 * i);
        for (int64_t g = 0; g < G; ++g) {
          const VecF32x16 p = VecF32x16::broadcast(scores[g * P.block_size + j]);
          fma(p, vv, VecF32x16::load(acc[g] + 16 * i)).store(acc[g] + 16 * i);
        }
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    const VecF32x16 inv = VecF32x16::broadcast(1.f / running_sum[g]);
    T* og = out + (first_head + g) * D;
    for (int64_t i = 0; i < NV; ++i) (VecF32x16::load(acc[g] + 16 * i) * inv).store(og + 16 * i);
  }
}

template <typename T>
void run(const Params& P, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& token_req, const at::Tensor& token_pos) {
  const T* q = data_as<const T>(query);
  const T* kv = data_as<const T>(kv_cache);
  T* o = data_as<T>(out);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* req = token_req.data_ptr<int32_t>();
  const int32_t* pos = token_pos.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, P.num_tokens * P.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / P.num_kv_heads, h = item % P.num_kv_heads;
      attend_token<T>(P, q + t * q_stride, kv, bt + int64_t(req[t]) * P.bt_stride, pos[t], h,
                      o + t * o_stride);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& token_req,
                     const at::Tensor& token_pos, double scale, int64_t sliding_window,
                     double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention: query/out must be [tokens, heads, head_size]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be a contiguous [blocks, kv_heads, block_size, 2*head_size]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention: query, out and kv_cache must share one dtype");
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
  TORCH_CHECK(kv_cache.size(3) == 2 * P.head_size, "paged_attention: kv_cache last dim must be 2*head_size");
  TORCH_CHECK(P.head_size % 16 == 0 && P.head_size <= kMaxHeadSize,
              "paged_attention: head_size must be a multiple of 16 up to 256, got ", P.head_size);
  TORCH_CHECK(P.num_heads % P.num_kv_heads == 0 && P.num_heads / P.num_kv_heads <= kMaxGroup,
              "paged_attention: num_heads must be a multiple of num_kv_heads, at most ", kMaxGroup, "x");
  TORCH_CHECK(P.block_size <= kMaxBlockSize, "paged_attention: block_size must be at most ", kMaxBlockSize);
  P.scale = float(scale);
  P.softcap = float(softcap);
  P.window = sliding_window;
  at::Tensor alibi;
  P.alibi = nullptr;
  if (alibi_slopes.has_value()) {
    alibi = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(alibi.numel() == P.num_heads, "paged_attention: one ALiBi slope per head");
    P.alibi = alibi.data_ptr<float>();
  }
  dispatch_float(query.scalar_type(), "paged_attention query", [&](auto tag) {
    run<typename decltype(tag)::type>(P, out, query, kv_cache, block_table, token_req, token_pos);
  });
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "write_kv_cache: bad kv_cache");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv_cache: key/value must have the cache's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be contiguous int64");
  const int64_t H = kv_cache.size(1), BS = kv_cache.size(2), D = kv_cache.size(3) / 2;
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK(key.size(0) >= n && key.size(1) == H && key.size(2) == D && key.stride(2) == 1 &&
                  value.stride(2) == 1,
              "write_kv_cache: key/value must be [tokens, kv_heads, head_size]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks0 = key.stride(0) * elem, ks1 = key.stride(1) * elem;
  const int64_t vs0 = value.stride(0) * elem, vs1 = value.stride(1) * elem;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / BS, off = slot % BS;
      for (int64_t h = 0; h < H; ++h) {
        char* dst = cache + (((block * H + h) * BS + off) * 2 * D) * elem;
        std::memcpy(dst, k + t * ks0 + h * ks1, D * elem);
        std::memcpy(dst + D * elem, v + t * vs0 + h * vs1, D * elem);
      }
    }
  });
}

}  // namespace cpu_backend
