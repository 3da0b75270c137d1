// KV-cache storage formats, shared by the attention kernel (reads) and the
// KV-cache write (kv_cache.cpp). The Python side has one handler per format
// (cpu_backend/kv_cache/) carrying the same code.
//
// A cache row is one (block, kv head, token) entry of the LBHNC cache
// [num_blocks, num_kv_heads, block_size, row_elems]:
//   [key: D elems][value: D elems][key scale: fp32][value scale: fp32]
// the two scales only for per-(token, head) formats (1-byte elements, so a
// row is 2*D + 8 elements). Per-tensor formats use the layer's k_scale /
// v_scale (stored value = x / scale).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec/vec.h"

namespace cpu_backend {

enum KvFormat : int64_t {
  kKvPlain = 0,              // the model's dtype (bf16 / fp16 / fp32)
  kKvFp8E5M2 = 1,            // per-tensor scale
  kKvFp8E4M3 = 2,            // per-tensor scale
  kKvInt8TokenHead = 3,      // symmetric int8, per-(token, head) scales
  kKvFp8E4M3TokenHead = 4,   // e4m3, per-(token, head) scales
};

template <typename E, bool TokenScales>
struct KvLayout {
  using elem = E;
  static constexpr bool kTokenScales = TokenScales;
  static_assert(!TokenScales || sizeof(E) == 1, "per-token scales follow 1-byte elements");

  static int64_t row_elems(int64_t head_size) { return 2 * head_size + (TokenScales ? 8 : 0); }
  static float key_scale(const E* row, int64_t head_size) { return scale_at(row, head_size, 0); }
  static float value_scale(const E* row, int64_t head_size) { return scale_at(row, head_size, 1); }

 private:
  static float scale_at(const E* row, int64_t head_size, int which) {
    float s;
    std::memcpy(&s, reinterpret_cast<const char*>(row + 2 * head_size) + 4 * which, 4);
    return s;
  }
};

// Calls f(layout) for a cache of `format` holding model dtype T.
template <typename T, typename F>
bool dispatch_kv_format(int64_t format, F&& f) {
  switch (format) {
    case kKvPlain:
      f(KvLayout<T, false>{});
      return true;
    case kKvFp8E5M2:
      f(KvLayout<fp8_e5m2_t, false>{});
      return true;
    case kKvFp8E4M3:
      f(KvLayout<fp8_e4m3_t, false>{});
      return true;
    case kKvInt8TokenHead:
      f(KvLayout<int8_t, true>{});
      return true;
    case kKvFp8E4M3TokenHead:
      f(KvLayout<fp8_e4m3_t, true>{});
      return true;
    default:
      return false;
  }
}

}  // namespace cpu_backend
