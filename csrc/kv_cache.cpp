// KV-cache write: new tokens' keys and values into their cache slots, stored
// in the cache's format (kv_format.h).
//   plain:            copied (the cache has the model's dtype)
//   fp8, per tensor:  fp8(clamp(x / scale, +-max))           (scale: layer's k/v scale)
//   per (token,head): s = max|x| / qmax; q = enc(x * (1/s)); s kept after the row
//                     (int8: round half to even, clamp +-127; fp8 e4m3: qmax 448)
// Conversions to fp8 are torch's own (c10), so the stored bytes equal
// `tensor.to(torch.float8_*)` of the same fp32 values.
//
// Python reference: cpu_backend/kv_cache/ (one handler per format).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtype.h"
#include "kv_format.h"
#include "ops.h"

namespace cpu_backend {
namespace {

constexpr float kE5M2Max = 57344.f;
constexpr float kE4M3Max = 448.f;
constexpr float kInt8Max = 127.f;

inline uint8_t enc_e5m2(float x) { return c10::detail::fp8e5m2_from_fp32_value(std::clamp(x, -kE5M2Max, kE5M2Max)); }
inline uint8_t enc_e4m3(float x) { return c10::detail::fp8e4m3fn_from_fp32_value(std::clamp(x, -kE4M3Max, kE4M3Max)); }
inline uint8_t enc_int8(float x) {
  return uint8_t(int8_t(std::clamp(std::nearbyint(x), -kInt8Max, kInt8Max)));
}

// One head's D values of type T into `dst` (1-byte elements).
template <typename T>
void quantize_per_tensor(const T* src, int64_t D, float scale, int64_t format, uint8_t* dst) {
  for (int64_t i = 0; i < D; ++i) {
    const float x = to_f32(src[i]) / scale;
    dst[i] = format == kKvFp8E5M2 ? enc_e5m2(x) : enc_e4m3(x);
  }
}

// Returns the scale s (dequantized value = stored * s).
template <typename T>
float quantize_per_row(const T* src, int64_t D, int64_t format, uint8_t* dst) {
  float absmax = 0.f;
  for (int64_t i = 0; i < D; ++i) absmax = std::max(absmax, std::fabs(to_f32(src[i])));
  const float qmax = format == kKvInt8TokenHead ? kInt8Max : kE4M3Max;
  const float scale = absmax / qmax;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float x = to_f32(src[i]) * inv;
    dst[i] = format == kKvInt8TokenHead ? enc_int8(x) : enc_e4m3(x);
  }
  return scale;
}

template <typename T>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                const int64_t* slots, int64_t n, int64_t format, float k_scale, float v_scale) {
  const int64_t H = kv_cache.size(1), BS = kv_cache.size(2), row = kv_cache.size(3);
  const int64_t D = key.size(2);
  const int64_t elem = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const T* k = data_as<const T>(key);
  const T* v = data_as<const T>(value);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / BS, off = slot % BS;
      for (int64_t h = 0; h < H; ++h) {
        char* dst = cache + ((block * H + h) * BS + off) * row * elem;
        const T* kh = k + t * ks0 + h * ks1;
        const T* vh = v + t * vs0 + h * vs1;
        auto* d8 = reinterpret_cast<uint8_t*>(dst);
        switch (format) {
          case kKvPlain:
            std::memcpy(dst, kh, D * elem);
            std::memcpy(dst + D * elem, vh, D * elem);
            break;
          case kKvFp8E5M2:
          case kKvFp8E4M3:
            quantize_per_tensor(kh, D, k_scale, format, d8);
            quantize_per_tensor(vh, D, v_scale, format, d8 + D);
            break;
          default: {  // per-(token, head) scales
            const float scales[2] = {quantize_per_row(kh, D, format, d8),
                                     quantize_per_row(vh, D, format, d8 + D)};
            std::memcpy(d8 + 2 * D, scales, sizeof(scales));
          }
        }
      }
    }
  });
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping, int64_t kv_format, double k_scale, double v_scale) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "write_kv_cache: bad kv_cache");
  TORCH_CHECK(kv_format >= kKvPlain && kv_format <= kKvFp8E4M3TokenHead, "write_kv_cache: unknown kv_format ",
              kv_format);
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_cache: key and value must share one dtype");
  TORCH_CHECK(kv_format == kKvPlain ? key.scalar_type() == kv_cache.scalar_type() : kv_cache.element_size() == 1,
              "write_kv_cache: key/value must have the cache's dtype, or the cache 1-byte elements for kv_format ",
              kv_format);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be contiguous int64");
  TORCH_CHECK(kv_format == kKvPlain || (k_scale > 0 && v_scale > 0), "write_kv_cache: scales must be positive");
  const int64_t H = kv_cache.size(1);
  const int64_t D = key.size(2);
  const bool token_scales = kv_format == kKvInt8TokenHead || kv_format == kKvFp8E4M3TokenHead;
  TORCH_CHECK(kv_cache.size(3) == 2 * D + (token_scales ? 8 : 0), "write_kv_cache: kv_cache rows must be 2*head_size",
              token_scales ? " + 8" : "", " elements for kv_format ", kv_format);
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK(key.size(0) >= n && value.size(0) >= n && key.size(1) == H && value.size(1) == H &&
                  value.size(2) == D && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv_cache: key/value must be [tokens, kv_heads, head_size]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch_float(key.scalar_type(), "write_kv_cache key", [&](auto tag) {
    write_rows<typename decltype(tag)::type>(key, value, kv_cache, slots, n, kv_format, float(k_scale),
                                             float(v_scale));
  });
}

}  // namespace cpu_backend
