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
// per-(token, head) scales). Scales are folded in: a per-tensor key scale into
// the query, a per-row key scale into the score, value scales into the
// probabilities (per row) or the final normalization (per tensor).
//
// Work items. Consecutive tokens of one request at consecutive positions (a
// prefill chunk) are cut into query blocks of up to kMaxRows / G tokens; a
// work item is (query block, kv head): its M = tokens x G query rows (G query
// heads per kv head) share every key/value row read. Keys and values are read
// in tiles of up to kTile rows, widened to fp32 once per tile, and the tile is
// two small GEMMs with register-blocked fp32 accumulators:
//   S^T[key][row] = K_tile . Q^T  (Q^T [head_size][rows] built once per item)
//   acc[row][:]  += P^T[key][row] * V_tile[key][:]
// The softmax runs online over tiles, vectorized across the rows (S^T keeps
// rows contiguous), with the vectorized exp of vec/vec_math.h; the causal
// mask and the sliding window are applied only to tiles that need them.
// A lone token (decode) is its own item on the per-token path below, which
// keeps the dot products along head_size (no lanes wasted when G is small).
// Items run longest first, taken dynamically by the pool's threads, since
// causal prefill blocks differ in cost. A batch with too few items for the
// threads (batch-1 decode: one item per kv head) has its decode items split
// along the keys, the parts merged afterwards (split_decodes, combine_parts).
//
// Python reference: cpu_backend/attention/paged_torch.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "kv_format.h"
#include "ops.h"
#include "panel_tasks.h"
#include "vec/vec.h"
#include "vec/vec_i16dot.h"

namespace cpu_backend {
namespace {

constexpr int kMaxHeadSize = 256;
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kMaxBlockSize = 256;
constexpr int kMaxRows = 64;  // query rows (tokens x GQA heads) per work item
constexpr int kTile = 64;     // keys per softmax tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Decode softmax: how far (in logits) a score may exceed the running max
// before the max is moved (attend_token); probabilities stay below e^8.
constexpr float kMaxSlack = 8.f;

// Register blocking of the two tile GEMMs, by the ISA's register file
// (avx512: 32 zmm; avx2: 16 ymm, two per VecF32x16).
#if defined(CPU_BACKEND_ISA_AVX512)
constexpr int kScoreAccs = 16;  // key x row-vector accumulators in S^T
constexpr int kPvRows = 4, kPvVecs = 4;
#elif defined(CPU_BACKEND_ISA_AVX2)
constexpr int kScoreAccs = 6;
constexpr int kPvRows = 2, kPvVecs = 2;
#else
constexpr int kScoreAccs = 8;
constexpr int kPvRows = 2, kPvVecs = 2;
#endif

struct Params {
  int64_t num_tokens, num_heads, num_kv_heads, head_size, block_size;
  int64_t bt_stride, max_blocks;
  float scale, softcap;
  float k_scale, v_scale;  // per-tensor (1 unless the format has one)
  int64_t window;  // <= 0: none
  const float* alibi;  // [num_heads] or null
};

// ---------------------------------------------------------------------------
// One query token (decode): one work item is the token's G query heads that
// share a kv head, so every key and value row read is widened to fp32 once,
// in registers, and used by all G heads (no fp32 copy of the rows). Rows are
// taken in chunks of up to 16 of one block. A head's 16 scores are 16 partial
// dot-product vectors summed across lanes together (reduce_add16, a
// transpose-and-add tree), so masking, softcap, ALiBi and the exp run 16
// scores at a time; the online softmax moves a head's max only when a score
// exceeds it by more than kMaxSlack, so most chunks need no horizontal max and
// no rescale. The value pass keeps a block of (heads x output vectors)
// accumulators in registers across the chunk's rows, so each widened value
// vector feeds several heads. NV = head_size / 16 as a constant (rows fully
// unrolled) for the common head sizes, or 0 for any other.

constexpr float kLane[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static_assert(kMaxGroup == 16, "decode keeps one value per head in one VecF32x16");

// Value-pass register block: up to kDecodeAccs accumulators, output vectors
// per block up to kDecodeCols, heads per block up to 4.
// For int8 values (decode_pv_i16_block): heads x 32-column units per block,
// two VecI32x16 accumulators each.
#if defined(CPU_BACKEND_ISA_AVX512)
constexpr int kDecodeAccs = 16, kDecodeCols = 8;
constexpr int kDecodeI16Heads = 4, kDecodeI16Units = 2;
#elif defined(CPU_BACKEND_ISA_AVX2)
constexpr int kDecodeAccs = 6, kDecodeCols = 2;
constexpr int kDecodeI16Heads = 2, kDecodeI16Units = 1;
#else
constexpr int kDecodeAccs = 8, kDecodeCols = 2;
constexpr int kDecodeI16Heads = 2, kDecodeI16Units = 1;
#endif

#ifndef CB_DECODE_PF_ROWS
#define CB_DECODE_PF_ROWS 48
#endif
#ifndef CB_DECODE_PF_LOCALITY
#define CB_DECODE_PF_LOCALITY 3
#endif
constexpr int64_t kDecodePrefetchRows = CB_DECODE_PF_ROWS;

// acc[h][c0*16 ..] = acc[h][..] * corr[h] + sum_{j<n} probs[h][j] * value_j[c0*16 ..], h < GB.
template <int GB, int CV, typename E>
CB_ALWAYS_INLINE void decode_pv_block(float (*acc)[kMaxHeadSize], const float* corr, const float (*probs)[16],
                                      const E* values, int64_t token_stride, int64_t n, int64_t c0) {
  using V = VecF32x16;
  V a[GB][CV];
  CB_UNROLL for (int h = 0; h < GB; ++h) {
    const V c = V::broadcast(corr[h]);
    CB_UNROLL for (int v = 0; v < CV; ++v) a[h][v] = V::load(acc[h] + 16 * (c0 + v)) * c;
  }
  for (int64_t j = 0; j < n; ++j) {
    const E* vrow = values + j * token_stride + 16 * c0;
    CB_UNROLL for (int v = 0; v < CV; ++v) {
      const V x = V::load_kv(vrow + 16 * v);
      CB_UNROLL for (int h = 0; h < GB; ++h) a[h][v] = fma(V::broadcast(probs[h][j]), x, a[h][v]);
    }
  }
  CB_UNROLL for (int h = 0; h < GB; ++h) CB_UNROLL for (int v = 0; v < CV; ++v) a[h][v].store(acc[h] + 16 * (c0 + v));
}

// Output vectors c0 .. c0+CV-1 of heads 0 .. G-1, in blocks of up to GBMAX heads.
template <int CV, typename E>
CB_ALWAYS_INLINE void decode_pv_cols(float (*acc)[kMaxHeadSize], const float* corr, const float (*probs)[16],
                                     const E* values, int64_t token_stride, int64_t n, int64_t c0, int64_t G) {
  constexpr int GBMAX = std::max(1, std::min(4, kDecodeAccs / CV));
  for (int64_t g = 0; g < G; g += GBMAX) {
    switch (std::min<int64_t>(GBMAX, G - g)) {
      case 1: decode_pv_block<1, CV>(acc + g, corr + g, probs + g, values, token_stride, n, c0); break;
      case 2: decode_pv_block<std::min(2, GBMAX), CV>(acc + g, corr + g, probs + g, values, token_stride, n, c0); break;
      case 3: decode_pv_block<std::min(3, GBMAX), CV>(acc + g, corr + g, probs + g, values, token_stride, n, c0); break;
      default: decode_pv_block<GBMAX, CV>(acc + g, corr + g, probs + g, values, token_stride, n, c0); break;
    }
  }
}

// The same for int8 value rows and int16 weights w[h][j] (step[h] each; zero
// past n): acc[h][32*u0 ..] = acc[h][..] * corr[h] + step[h] * sum_j w[h][j] *
// value_j[32*u0 ..], NU 32-column units. Rows are taken in pairs, one pair
// product per column (vec_i16dot.h interleave); an odd last row is paired with
// itself under the zero weight w[h][n], so nothing past the chunk is read.
template <int GB, int NU>
CB_ALWAYS_INLINE void decode_pv_i16_block(float (*acc)[kMaxHeadSize], const float* corr, const float* step,
                                          const int16_t (*w)[16], const int8_t* values, int64_t token_stride,
                                          int64_t n, int64_t u0) {
  using V = VecF32x16;
  VecI32x16 a[GB][NU][2];
  CB_UNROLL for (int h = 0; h < GB; ++h) CB_UNROLL for (int u = 0; u < NU; ++u) a[h][u][0] = a[h][u][1] = VecI32x16::zero();
  for (int64_t j = 0; j < n; j += 2) {
    const int8_t* r0 = values + j * token_stride + 32 * u0;
    const int8_t* r1 = j + 1 < n ? r0 + token_stride : r0;
    CB_UNROLL for (int u = 0; u < NU; ++u) {
      VecI16x32 p0, p1;
      interleave(VecI16x32::load(r0 + 32 * u), VecI16x32::load(r1 + 32 * u), p0, p1);
      CB_UNROLL for (int h = 0; h < GB; ++h) {
        const VecI16x32 wp = VecI16x32::broadcast_pair(w[h] + j);
        a[h][u][0] = dot2(a[h][u][0], p0, wp);
        a[h][u][1] = dot2(a[h][u][1], p1, wp);
      }
    }
  }
  CB_UNROLL for (int h = 0; h < GB; ++h) {
    const V c = V::broadcast(corr[h]), s = V::broadcast(step[h]);
    CB_UNROLL for (int u = 0; u < NU; ++u) {
      V lo, hi;
      columns(to_f32(a[h][u][0]), to_f32(a[h][u][1]), lo, hi);
      float* o = acc[h] + 32 * (u0 + u);
      fma(lo, s, V::load(o) * c).store(o);
      fma(hi, s, V::load(o + 16) * c).store(o + 16);
    }
  }
}

// All nu units of heads 0 .. G-1, in blocks of up to kDecodeI16Heads x kDecodeI16Units.
template <int NU>
CB_ALWAYS_INLINE void decode_pv_i16_units(float (*acc)[kMaxHeadSize], const float* corr, const float* step,
                                          const int16_t (*w)[16], const int8_t* values, int64_t token_stride,
                                          int64_t n, int64_t u0, int64_t G) {
  constexpr int GBMAX = kDecodeI16Heads;
  for (int64_t g = 0; g < G; g += GBMAX) {
    switch (std::min<int64_t>(GBMAX, G - g)) {
      case 1: decode_pv_i16_block<1, NU>(acc + g, corr + g, step + g, w + g, values, token_stride, n, u0); break;
      case 2: decode_pv_i16_block<std::min(2, GBMAX), NU>(acc + g, corr + g, step + g, w + g, values, token_stride, n, u0); break;
      case 3: decode_pv_i16_block<std::min(3, GBMAX), NU>(acc + g, corr + g, step + g, w + g, values, token_stride, n, u0); break;
      default: decode_pv_i16_block<GBMAX, NU>(acc + g, corr + g, step + g, w + g, values, token_stride, n, u0); break;
    }
  }
}

// part[g][j] = 16 partial sums of key row . query of head g, g < G: the row
// widened once, in registers, for all heads.
template <int NV, typename E>
CB_ALWAYS_INLINE void decode_scores(const E* row, const float (*qs)[kMaxHeadSize], int64_t G, int64_t nv,
                                    VecF32x16 (*part)[16], int64_t j) {
  using V = VecF32x16;
  V k[NV > 0 ? NV : kMaxHeadSize / 16];
  CB_UNROLL for (int64_t i = 0; i < nv; ++i) k[i] = V::load_kv(row + 16 * i);
  for (int64_t g = 0; g < G; ++g) {
    V s0 = V::load(qs[g]) * k[0], s1 = V::zero();
    CB_UNROLL for (int64_t i = 1; i + 1 < nv; i += 2) {
      s1 = fma(V::load(qs[g] + 16 * i), k[i], s1);
      s0 = fma(V::load(qs[g] + 16 * (i + 1)), k[i + 1], s0);
    }
    if (nv % 2 == 0) s1 = fma(V::load(qs[g] + 16 * (nv - 1)), k[nv - 1], s1);
    part[g][j] = s0 + s1;
  }
}

// The same for an int8 key row and int16 queries (nv even), in units of q_step x key scale.
template <int NV>
CB_ALWAYS_INLINE void decode_scores_i16(const int8_t* row, const int16_t (*qi)[kMaxHeadSize], int64_t G,
                                        int64_t nv, VecF32x16 (*part)[16], int64_t j) {
  VecI16x32 k[NV > 0 ? (NV + 1) / 2 : kMaxHeadSize / 32];
  CB_UNROLL for (int64_t i = 0; i < nv / 2; ++i) k[i] = VecI16x32::load(row + 32 * i);
  for (int64_t g = 0; g < G; ++g) {
    VecI32x16 s = VecI32x16::zero();
    CB_UNROLL for (int64_t i = 0; i < nv / 2; ++i) s = dot2(s, VecI16x32::load(qi[g] + 32 * i), k[i]);
    part[g][j] = to_f32(s);
  }
}

// Where a decode item's results go: normalized into out, or, for one part of
// a split key range (see split_decodes), the unnormalized sums of its keys.
struct DecodePartial {
  float* acc;  // [G][head_size]: sum_j p_j * value_j, p_j = exp(score_j - max)
  float* max;  // [G]: the running max the p_j are relative to
  float* sum;  // [G]: sum_j p_j
};

template <typename T, typename KV, int NV>
void attend_token(const Params& P, const T* q, const typename KV::elem* kv_cache,
                  const int32_t* block_row, int64_t pos, int64_t k_first, int64_t k_last, int64_t kv_head,
                  T* out, const DecodePartial* partial) {
  using E = typename KV::elem;
  using V = VecF32x16;
  constexpr int kNvMax = NV > 0 ? NV : kMaxHeadSize / 16;
  const int64_t D = P.head_size, G = P.num_heads / P.num_kv_heads, nv = NV > 0 ? NV : D / 16;
  const int64_t first_head = kv_head * G;
  const int64_t token_stride = KV::row_elems(D);
  const int64_t head_stride = P.block_size * token_stride;
  const int64_t block_stride = P.num_kv_heads * head_stride;

  alignas(64) float qs[kMaxGroup][kMaxHeadSize];
  alignas(64) float acc[kMaxGroup][kMaxHeadSize];
  alignas(64) float probs[kMaxGroup][16];
  V part[kMaxGroup][16];
  // Per head: the running max, the running sum as 16 lane partial sums, and
  // this chunk's correction of the earlier sums.
  alignas(64) float run_max[kMaxGroup], corr[kMaxGroup];
  V run_sum[kMaxGroup];
  alignas(64) float key_scales[16] = {}, value_scales[16] = {};

  const V q_scale = V::broadcast(P.scale * P.k_scale);
  for (int64_t g = 0; g < G; ++g) {
    run_max[g] = kNegInf;
    run_sum[g] = V::zero();
    const T* qg = q + (first_head + g) * D;
    for (int64_t i = 0; i < nv; ++i) {
      (V::load(qg + 16 * i) * q_scale).store(qs[g] + 16 * i);
      V::zero().store(acc[g] + 16 * i);
    }
  }
  // int8 keys: each head's query quantized to int16 (step q_step[g], error
  // ~1.5e-5 of its largest element, far below the keys' own int8 error), so
  // a score is int16 x int8 pair products (vec_i16dot.h): about half the
  // instructions of widening every key to fp32. int8 values likewise: each
  // chunk's weights (probability x value scale) are quantized to int16 per
  // head, step w_step[g] (error <= 1.5e-5 of the chunk's largest weight).
  constexpr bool kInt8Kv = std::is_same_v<E, int8_t>;
  const bool int8_dots = kInt8Kv && nv % 2 == 0;
  alignas(64) int16_t w16[kMaxGroup][kInt8Kv ? 16 : 1];
  alignas(64) float w_step[kMaxGroup];
  alignas(64) int16_t qi[kMaxGroup][kInt8Kv ? kMaxHeadSize : 1];
  alignas(64) float q_step[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    q_step[g] = 1.f;
    if (!int8_dots) continue;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(qs[g][d]));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t d = 0; d < D; ++d)
      qi[g][d] = int16_t(std::clamp(std::nearbyint(qs[g][d] * inv), -32767.f, 32767.f));
    q_step[g] = amax / 32767.f;
  }
  const V lane = V::load(kLane), neg_inf = V::broadcast(kNegInf), cap = V::broadcast(P.softcap),
          inv_cap = V::broadcast(P.softcap > 0.f ? 1.f / P.softcap : 0.f);

  for (int64_t t0 = k_first, n = 0; t0 <= k_last; t0 += n) {
    const int64_t b = t0 / P.block_size;
    n = std::min<int64_t>({16, k_last + 1 - t0, (b + 1) * P.block_size - t0});
    const E* rows = kv_cache + int64_t(block_row[b]) * block_stride + kv_head * head_stride +
                    (t0 - b * P.block_size) * token_stride;
    // Rows kDecodePrefetchRows ahead (usually another block, elsewhere in
    // memory) are prefetched into L1 while this chunk is computed: decode
    // streams many short runs that the hardware prefetcher picks up too late,
    // and one chunk ahead leaves the memory latency exposed (measured: the
    // cost per chunk then barely depends on the bytes per row). Three chunks
    // of bf16 K and V rows are 12 KB at head size 64, 48 KB (all of Zen 5's
    // L1) at 256; into L1 rather than L2 is 10-17% faster for 1-byte rows at
    // head size 64 (Zen 5, AVX-512 and AVX2 builds).
    if (const int64_t t_pf = t0 + kDecodePrefetchRows; t_pf <= k_last) {
      const int64_t bn = t_pf / P.block_size;
      const int64_t nn = std::min<int64_t>({16, k_last + 1 - t_pf, (bn + 1) * P.block_size - t_pf});
      const char* next = reinterpret_cast<const char*>(kv_cache + int64_t(block_row[bn]) * block_stride +
                                                       kv_head * head_stride + (t_pf - bn * P.block_size) * token_stride);
      const int64_t bytes = nn * token_stride * int64_t(sizeof(E));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, CB_DECODE_PF_LOCALITY);
    }

    // Scores: each key row widened once, dotted with every head's query.
    for (int64_t j = 0; j < n; ++j) {
      const E* row = rows + j * token_stride;
      if constexpr (kInt8Kv) {
        if (int8_dots) {
          decode_scores_i16<NV>(row, qi, G, nv, part, j);
        } else {
          decode_scores<NV>(row, qs, G, nv, part, j);
        }
      } else {
        decode_scores<NV>(row, qs, G, nv, part, j);
      }
      if constexpr (KV::kTokenScales) {
        key_scales[j] = KV::key_scale(row, D);
        value_scales[j] = KV::value_scale(row, D);
      }
    }
    if (n < 16)  // lanes past the chunk: finite placeholders, masked below
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = n; j < 16; ++j) part[g][j] = V::zero();

    // Per head: the 16 scores, rules and probabilities exp(score - running
    // max). The running max moves only when a score exceeds it by more than
    // kMaxSlack (always on the first chunk): then the head's earlier sums are
    // rescaled by corr. Probabilities stay below e^kMaxSlack, and almost every
    // chunk skips the horizontal max, the correction's exp and the rescale.
    const V key_pos = lane + V::broadcast(float(t0));
    for (int64_t g = 0; g < G; ++g) {
      V s = reduce_add16(part[g]);
      if constexpr (KV::kTokenScales) s = s * V::load(key_scales) * V::broadcast(q_step[g]);
      if (P.softcap > 0.f) s = cap * tanh(s * inv_cap);
      if (P.alibi) s = fma(V::broadcast(P.alibi[first_head + g]), key_pos - V::broadcast(float(pos)), s);
      if (n < 16) s = select_lt(lane, V::broadcast(float(n)), s, neg_inf);
      corr[g] = 1.f;
      if (any_lt(V::broadcast(run_max[g] + kMaxSlack), s)) {
        const float m = std::max(run_max[g], s.reduce_max());
        corr[g] = std::exp(run_max[g] - m);
        run_sum[g] = run_sum[g] * V::broadcast(corr[g]);
        run_max[g] = m;
      }
      V p = exp(s - V::broadcast(run_max[g]));
      run_sum[g] = run_sum[g] + p;
      if constexpr (KV::kTokenScales) p = p * V::load(value_scales);
      if constexpr (kInt8Kv) {
        if (int8_dots) {
          // (a chunk whose weights are all below 1e-30 adds nothing: 32767 / w_max must stay finite)
          const float w_max = p.reduce_max(), inv = w_max > 1e-30f ? 32767.f / w_max : 0.f;
          w_step[g] = inv > 0.f ? w_max / 32767.f : 0.f;
          store_i16(p * V::broadcast(inv), w16[g]);
          continue;
        }
      }
      p.store(probs[g]);
    }
    // Values: acc = acc * corr + probs . V, register-blocked over heads and output vectors.
    const E* values = rows + D;
    if constexpr (kInt8Kv) {
      if (int8_dots) {
        constexpr int NU = std::min(std::max(kNvMax / 2, 1), kDecodeI16Units);
        int64_t u0 = 0;
        for (; u0 + NU <= nv / 2; u0 += NU) decode_pv_i16_units<NU>(acc, corr, w_step, w16, values, token_stride, n, u0, G);
        for (; u0 < nv / 2; ++u0) decode_pv_i16_units<1>(acc, corr, w_step, w16, values, token_stride, n, u0, G);
        continue;
      }
    }
    constexpr int CV = std::min(kNvMax, kDecodeCols);
    int64_t c0 = 0;
    for (; c0 + CV <= nv; c0 += CV) decode_pv_cols<CV>(acc, corr, probs, values, token_stride, n, c0, G);
    for (; c0 < nv; ++c0) decode_pv_cols<1>(acc, corr, probs, values, token_stride, n, c0, G);
  }

  for (int64_t g = 0; g < G; ++g) {
    if (partial) {
      for (int64_t i = 0; i < nv; ++i) V::load(acc[g] + 16 * i).store(partial->acc + g * D + 16 * i);
      partial->max[g] = run_max[g];
      partial->sum[g] = run_sum[g].reduce_add();
      continue;
    }
    const V inv = V::broadcast(P.v_scale / run_sum[g].reduce_add());
    T* og = out + (first_head + g) * D;
    for (int64_t i = 0; i < nv; ++i) (V::load(acc[g] + 16 * i) * inv).store(og + 16 * i);
  }
}

// One decode item (keys k_first .. k_last), with the head size as a constant where it is a common one.
template <typename T, typename KV>
void attend_decode(const Params& P, const T* q, const typename KV::elem* kv_cache, const int32_t* block_row,
                   int64_t pos, int64_t k_first, int64_t k_last, int64_t kv_head, T* out,
                   const DecodePartial* partial) {
  switch (P.head_size) {
    case 64: attend_token<T, KV, 4>(P, q, kv_cache, block_row, pos, k_first, k_last, kv_head, out, partial); break;
    case 128: attend_token<T, KV, 8>(P, q, kv_cache, block_row, pos, k_first, k_last, kv_head, out, partial); break;
    default: attend_token<T, KV, 0>(P, q, kv_cache, block_row, pos, k_first, k_last, kv_head, out, partial); break;
  }
}
// ---------------------------------------------------------------------------
// A block of query tokens (prefill): tile GEMMs, softmax across rows.

// Per-thread buffers, sized for head_size D.
struct Scratch {
  std::vector<float> qt, acc, kf, vf, st, ks, vs, corr, sums;
  explicit Scratch(int64_t D)
      : qt(D * kMaxRows), acc(kMaxRows * D), kf(kTile * D), vf(kTile * D), st(kTile * kMaxRows),
        ks(kTile), vs(kTile), corr(kMaxRows), sums(kMaxRows) {}
};

// st[j][0:16*MV] = sum_d kf[j][d] * qt[d][0:16*MV] for keys j0 .. j0+KB-1.
template <int KB, int MV>
CB_ALWAYS_INLINE void score_keys(const float* qt, const float* kf, int64_t D, int64_t j0, float* st) {
  constexpr int MP = 16 * MV;
  VecF32x16 a[KB][MV];
  CB_UNROLL for (int k = 0; k < KB; ++k) CB_UNROLL for (int v = 0; v < MV; ++v) a[k][v] = VecF32x16::zero();
  for (int64_t d = 0; d < D; ++d) {
    const float* qd = qt + d * MP;
    CB_UNROLL for (int k = 0; k < KB; ++k) {
      const VecF32x16 kb = VecF32x16::broadcast(kf[(j0 + k) * D + d]);
      CB_UNROLL for (int v = 0; v < MV; ++v) a[k][v] = fma(kb, VecF32x16::load(qd + 16 * v), a[k][v]);
    }
  }
  CB_UNROLL for (int k = 0; k < KB; ++k) CB_UNROLL for (int v = 0; v < MV; ++v) a[k][v].store(st + (j0 + k) * MP + 16 * v);
}

// acc[m][c] = acc[m][c] * corr[m] + sum_j st[j][m] * vf[j][c], rows m0.., vectors c0..
template <int RB, int CV>
CB_ALWAYS_INLINE void pv_rows(const float* st, int64_t MP, const float* vf, int64_t D, int64_t n,
                              const float* corr, int64_t m0, int64_t c0, float* acc) {
  VecF32x16 a[RB][CV];
  CB_UNROLL for (int r = 0; r < RB; ++r) {
    const VecF32x16 c = VecF32x16::broadcast(corr[m0 + r]);
    CB_UNROLL for (int v = 0; v < CV; ++v) a[r][v] = VecF32x16::load(acc + (m0 + r) * D + 16 * (c0 + v)) * c;
  }
  for (int64_t j = 0; j < n; ++j) {
    VecF32x16 vv[CV];
    CB_UNROLL for (int v = 0; v < CV; ++v) vv[v] = VecF32x16::load(vf + j * D + 16 * (c0 + v));
    CB_UNROLL for (int r = 0; r < RB; ++r) {
      const VecF32x16 p = VecF32x16::broadcast(st[j * MP + m0 + r]);
      CB_UNROLL for (int v = 0; v < CV; ++v) a[r][v] = fma(p, vv[v], a[r][v]);
    }
  }
  CB_UNROLL for (int r = 0; r < RB; ++r) CB_UNROLL for (int v = 0; v < CV; ++v) a[r][v].store(acc + (m0 + r) * D + 16 * (c0 + v));
}

template <typename T, typename KV, int MV>
void attend_block(const Params& P, const T* q, int64_t q_stride, const typename KV::elem* kv_cache,
                  const int32_t* block_row, int64_t p0, int64_t nq, int64_t kv_head, T* out,
                  int64_t o_stride, Scratch& S) {
  using E = typename KV::elem;
  using V = VecF32x16;
  constexpr int MP = 16 * MV;
  constexpr int KB = std::max(1, std::min(4, kScoreAccs / MV));
  const int64_t D = P.head_size, G = P.num_heads / P.num_kv_heads, NV = D / 16;
  const int64_t M = nq * G, first_head = kv_head * G, p_last = p0 + nq - 1;
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, p0 - P.window + 1) : 0;
  const int64_t token_stride = KV::row_elems(D);
  const int64_t head_stride = P.block_size * token_stride;
  const int64_t block_stride = P.num_kv_heads * head_stride;
  float *qt = S.qt.data(), *acc = S.acc.data(), *kf = S.kf.data(), *vf = S.vf.data(), *st = S.st.data();

  // Q^T, scaled; padding rows are zero (their scores are 0, results unused).
  const float q_scale = P.scale * P.k_scale;
  std::fill(qt, qt + D * MP, 0.f);
  alignas(64) float row_pos[MP], row_slope[MP];
  for (int64_t m = 0; m < MP; ++m) {
    const int64_t qi = std::min(m, M - 1) / G, g = std::min(m, M - 1) % G;
    row_pos[m] = float(p0 + qi);
    row_slope[m] = P.alibi ? P.alibi[first_head + g] : 0.f;
    if (m >= M) continue;
    const T* qrow = q + qi * q_stride + (first_head + g) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * MP + m] = to_f32(qrow[d]) * q_scale;
  }
  std::fill(acc, acc + MP * D, 0.f);
  V pos_v[MV], lo_v[MV], slope_v[MV], run_max[MV], run_sum[MV];
  for (int v = 0; v < MV; ++v) {
    pos_v[v] = V::load(row_pos + 16 * v);
    lo_v[v] = pos_v[v] - V::broadcast(float(P.window - 1));  // first visible key with a window
    slope_v[v] = V::load(row_slope + 16 * v);
    run_max[v] = V::broadcast(kNegInf);
    run_sum[v] = V::zero();
  }
  const V neg_inf = V::broadcast(kNegInf), cap = V::broadcast(P.softcap),
          inv_cap = V::broadcast(P.softcap > 0.f ? 1.f / P.softcap : 0.f);
  const int64_t Mr = (M + kPvRows - 1) / kPvRows * kPvRows;  // <= MP

  for (int64_t b = start / P.block_size; b * P.block_size <= p_last; ++b) {
    const E* block = kv_cache + int64_t(block_row[b]) * block_stride + kv_head * head_stride;
    const int64_t b0 = std::max(start, b * P.block_size);
    const int64_t b1 = std::min(p_last + 1, (b + 1) * P.block_size);
    for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
      const int64_t n = std::min<int64_t>(kTile, b1 - t0);
      for (int64_t j = 0; j < n; ++j) {
        const E* row = block + (t0 + j - b * P.block_size) * token_stride;
        for (int64_t i = 0; i < NV; ++i) {
          V::load_kv(row + 16 * i).store(kf + j * D + 16 * i);
          V::load_kv(row + D + 16 * i).store(vf + j * D + 16 * i);
        }
        if constexpr (KV::kTokenScales) {
          S.ks[j] = KV::key_scale(row, D);
          S.vs[j] = KV::value_scale(row, D);
        }
      }
      int64_t j = 0;
      for (; j + KB <= n; j += KB) score_keys<KB, MV>(qt, kf, D, j, st);
      for (; j < n; ++j) score_keys<1, MV>(qt, kf, D, j, st);

      // Rules per key, then the tile's row maxima.
      const bool causal_mask = t0 + n - 1 > p0;
      const bool window_mask = P.window > 0 && t0 < p_last - P.window + 1;
      V tmax[MV];
      for (int v = 0; v < MV; ++v) tmax[v] = neg_inf;
      for (j = 0; j < n; ++j) {
        const V kp = V::broadcast(float(t0 + j));
        for (int v = 0; v < MV; ++v) {
          V s = V::load(st + j * MP + 16 * v);
          if constexpr (KV::kTokenScales) s = s * V::broadcast(S.ks[j]);
          if (P.softcap > 0.f) s = cap * tanh(s * inv_cap);
          if (P.alibi) s = fma(slope_v[v], kp - pos_v[v], s);
          if (causal_mask) s = select_lt(pos_v[v], kp, neg_inf, s);
          if (window_mask) s = select_lt(kp, lo_v[v], neg_inf, s);
          s.store(st + j * MP + 16 * v);
          tmax[v] = max(tmax[v], s);
        }
      }
      // Online softmax: new maxima, corrections, probabilities, sums.
      V shift[MV], tsum[MV];
      for (int v = 0; v < MV; ++v) {
        const V new_max = max(run_max[v], tmax[v]);
        // a row with no visible key yet keeps max -inf: shift by 0 (exp(-inf) = 0)
        shift[v] = select_lt(new_max, V::broadcast(-std::numeric_limits<float>::max()), V::zero(), new_max);
        exp(run_max[v] - shift[v]).store(S.corr.data() + 16 * v);
        run_max[v] = new_max;
        tsum[v] = V::zero();
      }
      for (j = 0; j < n; ++j) {
        for (int v = 0; v < MV; ++v) {
          V p = exp(V::load(st + j * MP + 16 * v) - shift[v]);
          tsum[v] = tsum[v] + p;
          if constexpr (KV::kTokenScales) p = p * V::broadcast(S.vs[j]);
          p.store(st + j * MP + 16 * v);
        }
      }
      for (int v = 0; v < MV; ++v) run_sum[v] = fma(run_sum[v], V::load(S.corr.data() + 16 * v), tsum[v]);

      for (int64_t m0 = 0; m0 < Mr; m0 += kPvRows) {
        int64_t c0 = 0;
        for (; c0 + kPvVecs <= NV; c0 += kPvVecs)
          pv_rows<kPvRows, kPvVecs>(st, MP, vf, D, n, S.corr.data(), m0, c0, acc);
        for (; c0 < NV; ++c0) pv_rows<kPvRows, 1>(st, MP, vf, D, n, S.corr.data(), m0, c0, acc);
      }
    }
  }

  for (int v = 0; v < MV; ++v) run_sum[v].store(S.sums.data() + 16 * v);
  for (int64_t m = 0; m < M; ++m) {
    const V inv = V::broadcast(P.v_scale / S.sums[m]);
    T* orow = out + (m / G) * o_stride + (first_head + m % G) * D;
    for (int64_t i = 0; i < NV; ++i) (V::load(acc + m * D + 16 * i) * inv).store(orow + 16 * i);
  }
}

// ---------------------------------------------------------------------------
// Scheduling.

struct WorkItem {
  int64_t first_token, num_tokens, kv_head, cost;
  // A decode item's keys (a part of the range when split), and its partial
  // results' slot (-1: not split, the item writes out itself).
  int64_t k_first = 0, k_last = 0, part = -1;
};

// Runs of consecutive positions of one request, cut into blocks of at most
// max_tokens, times kv heads; costliest first.
std::vector<WorkItem> plan(const Params& P, const int32_t* req, const int32_t* pos) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t max_tokens = std::max<int64_t>(1, kMaxRows / G);
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < P.num_tokens;) {
    int64_t n = 1;
    while (t + n < P.num_tokens && n < max_tokens && req[t + n] == req[t] && pos[t + n] == pos[t] + n) ++n;
    const int64_t last = pos[t] + n - 1;
    const int64_t keys = P.window > 0 ? std::min<int64_t>(last + 1, P.window + n - 1) : last + 1;
    for (int64_t h = 0; h < P.num_kv_heads; ++h) items.push_back({t, n, h, n * keys, last + 1 - keys, last});
    t += n;
  }
  return items;
}

// Split-KV decode (flash-decoding): with fewer items than kItemsPerThread per
// thread (batch-1 or small-batch decode: one item per kv head), a decode
// item's keys are cut into parts of at least kMinSplitKeys, computed by any
// threads, and combined afterwards (combine_parts). Without it a batch-1
// decode keeps only num_kv_heads threads busy (2 of 2 threads, or 3 items on 2
// threads: 2:1). One SplitDecode per item split; its parts take consecutive
// partial slots.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinSplitKeys = 128;

struct SplitDecode {
  int64_t token, kv_head, first_part, num_parts;
};

std::vector<SplitDecode> split_decodes(std::vector<WorkItem>& items, int64_t threads) {
  const int64_t n_items = int64_t(items.size());
  if (threads <= 1 || n_items >= kItemsPerThread * threads) return {};
  const int64_t want = ceil_div(kItemsPerThread * threads, n_items);
  std::vector<WorkItem> out;
  std::vector<SplitDecode> splits;
  int64_t parts = 0;
  for (const WorkItem& w : items) {
    const int64_t keys = w.k_last - w.k_first + 1;
    const int64_t S = w.num_tokens == 1 ? std::min(want, keys / kMinSplitKeys) : 1;
    if (S <= 1) {
      out.push_back(w);
      continue;
    }
    const int64_t per = ceil_div(ceil_div(keys, S), 16) * 16;  // whole 16-key chunks
    splits.push_back({w.first_token, w.kv_head, parts, 0});
    for (int64_t k = w.k_first; k <= w.k_last; k += per) {
      WorkItem p = w;
      p.k_first = k;
      p.k_last = std::min(w.k_last, k + per - 1);
      p.cost = p.k_last - p.k_first + 1;
      p.part = parts++;
      out.push_back(p);
      ++splits.back().num_parts;
    }
  }
  items.swap(out);
  return splits;
}

// Partial slot `part` of a buffer of [parts][G][head_size + 2] floats.
DecodePartial partial_slot(float* buf, int64_t part, int64_t G, int64_t D) {
  float* base = buf + part * G * (D + 2);
  return DecodePartial{base, base + G * D, base + G * (D + 1)};
}

// The split items' outputs from their parts (log-sum-exp merge): per head,
// out = sum_s e_s * acc_s / sum_s e_s * sum_s, e_s = exp(max_s - max over s).
template <typename T>
void combine_parts(const Params& P, const std::vector<SplitDecode>& splits, float* partial_buf, T* o,
                   int64_t o_stride) {
  using V = VecF32x16;
  const int64_t G = P.num_heads / P.num_kv_heads, D = P.head_size;
  for (const SplitDecode& sd : splits) {
    const int64_t s0 = sd.first_part, s1 = sd.first_part + sd.num_parts;
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = s0; s < s1; ++s) m = std::max(m, partial_slot(partial_buf, s, G, D).max[g]);
      float total = 0.f;
      alignas(64) float acc[kMaxHeadSize] = {};
      for (int64_t s = s0; s < s1; ++s) {
        const DecodePartial part = partial_slot(partial_buf, s, G, D);
        const float e = std::exp(part.max[g] - m);
        total += e * part.sum[g];
        const V ev = V::broadcast(e);
        for (int64_t d = 0; d < D; d += 16) fma(ev, V::load(part.acc + g * D + d), V::load(acc + d)).store(acc + d);
      }
      const V inv = V::broadcast(P.v_scale / total);
      T* og = o + sd.token * o_stride + (sd.kv_head * G + g) * D;
      for (int64_t d = 0; d < D; d += 16) (V::load(acc + d) * inv).store(og + d);
    }
  }
}

template <typename T, typename KV>
void run(const Params& params, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& token_req, const at::Tensor& token_pos) {
  // K/V rows are read in kernel units (V::load_kv); their factor joins the per-tensor scales.
  Params P = params;
  P.k_scale *= kKvUnit<typename KV::elem>;
  P.v_scale *= kKvUnit<typename KV::elem>;
  const T* q = data_as<const T>(query);
  const auto* kv = data_as<const typename KV::elem>(kv_cache);
  T* o = data_as<T>(out);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* req = token_req.data_ptr<int32_t>();
  const int32_t* pos = token_pos.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const int64_t G = P.num_heads / P.num_kv_heads, D = P.head_size;
  std::vector<WorkItem> items = plan(P, req, pos);
  const std::vector<SplitDecode> splits = split_decodes(items, at::get_num_threads());
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t parts = splits.empty() ? 0 : splits.back().first_part + splits.back().num_parts;
  std::vector<float> partial_buf(parts * G * (D + 2));
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), int64_t(items.size()));
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    std::unique_ptr<Scratch> scratch;
    for (int64_t i = next++; i < int64_t(items.size()); i = next++) {
      const WorkItem& w = items[i];
      const int64_t t = w.first_token;
      const int32_t* block_row = bt + int64_t(req[t]) * P.bt_stride;
      if (w.num_tokens == 1) {
        const DecodePartial partial = w.part >= 0 ? partial_slot(partial_buf.data(), w.part, G, D) : DecodePartial{};
        attend_decode<T, KV>(P, q + t * q_stride, kv, block_row, pos[t], w.k_first, w.k_last, w.kv_head,
                             o + t * o_stride, w.part >= 0 ? &partial : nullptr);
        continue;
      }
      if (!scratch) scratch = std::make_unique<Scratch>(P.head_size);
      const auto call = [&](auto mv) {
        attend_block<T, KV, decltype(mv)::value>(P, q + t * q_stride, q_stride, kv, block_row, pos[t],
                                                 w.num_tokens, w.kv_head, o + t * o_stride, o_stride, *scratch);
      };
      switch ((w.num_tokens * G + 15) / 16) {
        case 1: call(std::integral_constant<int, 1>{}); break;
        case 2: call(std::integral_constant<int, 2>{}); break;
        case 3: call(std::integral_constant<int, 3>{}); break;
        default: call(std::integral_constant<int, 4>{}); break;
      }
    }
  });
  if (parts) combine_parts(P, splits, partial_buf.data(), o, o_stride);
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
