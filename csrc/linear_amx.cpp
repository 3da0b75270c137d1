// AMX tile kernels, built into the amx library only (CPU_BACKEND_HAS_AMX,
// -mamx-tile -mamx-bf16 -mamx-int8): the bf16 x bf16 linear, which linear.cpp
// calls for bf16 activations with at least kAmxMinRows rows (prefill, batched
// decode), and the W8A8 int8 block behind linear_w8a8.cpp's int8_gemm_amx.
//
// Why: on a Sapphire Rapids VM (2 cores) the VDPBF16PS microkernels reach
// ~110 GFLOP/s where PyTorch's oneDNN (AMX) bf16 matmul reaches 0.6-2 TFLOP/s,
// so prompts prefilled several times slower than on the host's in-tree backend.
// This kernel reaches 1.1-1.4 TFLOP/s on SmolLM2's layer shapes at 1024-4096
// rows (on a par with oneDNN to 1024 rows, ~0.6x at 4096) and beats it up to
// 64 rows.
//
// Layout: the weight stays in linear.cpp's pair-interleaved panels
// [P][K][32]: pair row i of a panel is 32 columns x 2 k (128 bytes), so
// columns 0-15 and 16-31 of 16 consecutive pair rows are two TDPBF16PS B
// tiles (16 rows x 64 bytes, stride 128), loaded in place. A tiles (16 rows x
// 32 k) are loaded from x in place when K is a multiple of 32; the last
// partial 32-row block (or all of x, for other K) comes from a zero-padded
// copy. A task is one panel times a run of 32-row blocks: 2 A tiles x 2 B
// tiles -> 4 fp32 accumulator tiles (a 32 x 32 block of out), stored to a
// small buffer from which the epilogue adds the bias and narrows to the output
// type. Many rows are walked in groups whose A rows fit in L2, every panel per
// group. (Measured and dropped: A copied into tile-contiguous blocks, no
// gain; K split into 256-k chunks with the accumulators parked in memory,
// 10-25% slower.)
#if defined(CPU_BACKEND_HAS_AMX)

#include "linear_amx.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "panel_tasks.h"
#include "tile_store.h"
#include "vec/vec.h"

namespace cpu_backend {
namespace {

constexpr int64_t kPanel = 32;   // columns per packed panel (linear.cpp's kNR on avx512)
constexpr int64_t kBlockK = 32;  // k per tile step: 16 bf16 pairs
constexpr int64_t kBlockM = 32;  // rows per task step: two A tiles
#ifndef CB_AMX_GROUP_BYTES
#define CB_AMX_GROUP_BYTES 1048576
#endif
constexpr int64_t kGroupBytes = CB_AMX_GROUP_BYTES;

// The panel the calling thread's previous task prefetched (see linear_amx_bf16).
thread_local const bf16_t* prefetched_panel = nullptr;

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr long kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: C (fp32 16 x 16), tmm4-5: A (16 rows x 32 bf16), tmm6-7: B (16 pair rows x 16 columns).
inline void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12 does not see that LDTILECFG reads cfg and dropped the stores above
  // (a zero config: the next tile instruction raised SIGILL).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// x rows [r0, M) -> a [rows][KP] bf16, zero padded to whole 32-row blocks
// and to KP columns.
void pad_rows(const bf16_t* x, int64_t ldx, int64_t r0, int64_t M, int64_t K, int64_t rows, int64_t KP,
              bf16_t* a) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / KP), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      bf16_t* dst = a + i * KP;
      const int64_t n = r0 + i < M ? K : 0;
      if (n) std::memcpy(dst, x + (r0 + i) * ldx, n * sizeof(bf16_t));
      std::memset(static_cast<void*>(dst + n), 0, (KP - n) * sizeof(bf16_t));
    }
  });
}

}  // namespace

void amx_begin() { configure_tiles(); }
void amx_end() { _tile_release(); }

void amx_int8_block(const uint8_t* a, int64_t lda, const int8_t* w0, const int8_t* w1, int64_t K4,
                    int32_t* c) {
  constexpr int64_t ldw = 64;  // one k4 row of a panel: 16 columns x 4 k
  const uint8_t* a1 = a + 16 * lda;
  const auto step = [&](int64_t k4, const int8_t* b0, const int8_t* b1) CB_ALWAYS_INLINE_LAMBDA {
    _tile_loadd(4, a + 4 * k4, lda);
    _tile_loadd(5, a1 + 4 * k4, lda);
    _tile_loadd(6, b0, ldw);
    _tile_loadd(7, b1, ldw);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  };
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t KF4 = K4 / 16 * 16;
  for (int64_t k4 = 0; k4 < KF4; k4 += 16) step(k4, w0 + k4 * ldw, w1 + k4 * ldw);
  if (KF4 < K4) {  // the panels' last k4 rows, zero padded to a whole tile
    alignas(64) int8_t t0[16 * ldw], t1[16 * ldw];
    std::memset(t0, 0, sizeof(t0));
    std::memset(t1, 0, sizeof(t1));
    std::memcpy(t0, w0 + KF4 * ldw, (K4 - KF4) * ldw);
    std::memcpy(t1, w1 + KF4 * ldw, (K4 - KF4) * ldw);
    step(KF4, t0, t1);
  }
  constexpr int64_t ldc = 16 * int64_t(sizeof(int32_t));
  _tile_stored(0, c, ldc);
  _tile_stored(2, c + 16 * 16, ldc);
  _tile_stored(1, c + 32 * 16, ldc);
  _tile_stored(3, c + 48 * 16, ldc);
}

bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

template <typename OT>
void linear_amx_bf16(const bf16_t* x, int64_t ldx, int64_t M, int64_t N, int64_t K,
                     const bf16_t* packed, const float* bias, OT* out) {
  TORCH_CHECK(K % 2 == 0, "cpu_backend: the AMX linear needs an even K, got ", K);
  const int64_t KP = ceil_div(K, kBlockK) * kBlockK;
  const int64_t KF = K / kBlockK * kBlockK;  // k covered by whole B tiles read in place
  const int64_t C = ceil_div(M, kBlockM);
  // Whole 32-row blocks are read from x in place when K is a multiple of 32;
  // the rest (the last partial block, or all of x) from a zero-padded copy.
  const int64_t c_direct = KF == K ? M / kBlockM : 0;
  const int64_t copy_rows = (C - c_direct) * kBlockM;
  at::Tensor abuf;
  const bf16_t* a_copy = nullptr;
  if (copy_rows) {
    abuf = at::empty({copy_rows * KP}, at::TensorOptions().dtype(at::kBFloat16));
    bf16_t* a = reinterpret_cast<bf16_t*>(abuf.mutable_data_ptr());
    pad_rows(x, ldx, c_direct * kBlockM, M, K, copy_rows, KP, a);
    a_copy = a;
  }
  const auto a_block = [&](int64_t c) -> std::pair<const bf16_t*, int64_t> {  // (rows, stride)
    if (c < c_direct) return {x + c * kBlockM * ldx, ldx};
    return {a_copy + (c - c_direct) * kBlockM * KP, KP};
  };

  const int64_t P = ceil_div(N, kPanel);
  constexpr int64_t ldb = kPanel * 2 * int64_t(sizeof(bf16_t));  // one pair row: 128 bytes
  // Row groups whose A rows stay in L2 (~kGroupBytes) while a thread walks
  // the panels: task t = (group t / P, panel t % P).
  const int64_t a_block_bytes = kBlockM * KP * int64_t(sizeof(bf16_t));
  const int64_t G = ceil_div(C, std::max<int64_t>(1, kGroupBytes / a_block_bytes));
  const int64_t per_group = ceil_div(C, G);  // groups of equal size: equal tasks
  const int64_t panel_bytes = K * kPanel * int64_t(sizeof(bf16_t));
  const int64_t steps = KF / kBlockK;
  const auto task = [&](int64_t p, int64_t c_begin, int64_t c_end) {
    alignas(64) float cbuf[kBlockM * kPanel];
    // The panel's last k < 32 as a zero-padded pair-row block: a tile load in
    // place would read past the panel (and NaN x 0 is NaN).
    alignas(64) bf16_t btail[kBlockK / 2 * kPanel * 2];
    const bf16_t* panel = packed + p * K * kPanel;
    if (KF < K) {
      std::memset(static_cast<void*>(btail), 0, sizeof(btail));
      std::memcpy(btail, panel + KF * kPanel, (K - KF) * kPanel * sizeof(bf16_t));
    }
    const float* pbias = bias ? bias + p * kPanel : nullptr;
    const int nn = int(std::min<int64_t>(kPanel, N - p * kPanel));
    // Prefetch into L2. One pass (up to 32 rows): the panel ahead of its own
    // tile loads. Several passes (32-row blocks): the passes after the first
    // read the panel from cache and would leave memory idle, so the next panel
    // (a thread's tasks run in panel order) streams in, spread over all of
    // this panel's passes; a thread's first panel, which no earlier task
    // fetched, still prefetches itself on its first pass. (Measured on SPR,
    // SmolLM2 layers: 5-10% less time at 48-1024 rows; at 16-32 rows the
    // next-panel stream was ~5% slower than prefetching ahead.)
    const int64_t passes = c_end - c_begin;
    const bf16_t* next_panel = passes > 1 ? packed + ((p + 1) % P) * K * kPanel : nullptr;
    const char* next = reinterpret_cast<const char*>(next_panel);
    const int64_t pf_step = ceil_div(ceil_div(panel_bytes, passes * std::max<int64_t>(steps, 1)), 64) * 64;
    const bool self_pf = prefetched_panel != panel;
    prefetched_panel = next_panel;
    for (int64_t c = c_begin; c < c_end; ++c) {
      const auto [a0, lda_elems] = a_block(c);
      const bf16_t* a1 = a0 + 16 * lda_elems;
      const int64_t lda = lda_elems * int64_t(sizeof(bf16_t));
      // 2 A tiles x 2 B tiles (columns 0-15 and 16-31 of the panel)
      const auto step = [&](int64_t k, const bf16_t* b) CB_ALWAYS_INLINE_LAMBDA {
        _tile_loadd(4, a0 + k, lda);
        _tile_loadd(5, a1 + k, lda);
        _tile_loadd(6, b, ldb);
        _tile_loadd(7, b + 32, ldb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      };
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const bool first = self_pf && c == c_begin;
      for (int64_t k = 0, pf = (c - c_begin) * steps * pf_step; k < KF; k += kBlockK, pf += pf_step) {
        if (first) prefetch_panel<kBlockK * kPanel * sizeof(bf16_t)>(panel + k * kPanel);
        if (next)
          for (int64_t off = pf; off < std::min(pf + pf_step, panel_bytes); off += 64)
            _mm_prefetch(next + off, _MM_HINT_T1);
        step(k, panel + k * kPanel);
      }
      if (KF < K) step(KF, btail);
      constexpr int64_t ldc = kPanel * int64_t(sizeof(float));
      _tile_stored(0, cbuf, ldc);
      _tile_stored(1, cbuf + 16, ldc);
      _tile_stored(2, cbuf + 16 * kPanel, ldc);
      _tile_stored(3, cbuf + 16 * kPanel + 16, ldc);
      const int64_t r0 = c * kBlockM;
      const int mr = int(std::min<int64_t>(kBlockM, M - r0));
      store_tile_rows<2>(cbuf, mr, pbias, out + r0 * N + p * kPanel, N, nn);
    }
  };
  if (G == 1) {
    parallel_panels<AmxTiles>(P, C, M * N * K, task);
  } else {
    at::parallel_for(0, G * P, 1, [&](int64_t t0, int64_t t1) {
      const AmxTiles tiles;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = t / P;
        task(t % P, g * per_group, std::min(C, (g + 1) * per_group));
      }
    });
  }
}

template void linear_amx_bf16<float>(const bf16_t*, int64_t, int64_t, int64_t, int64_t, const bf16_t*,
                                     const float*, float*);
template void linear_amx_bf16<bf16_t>(const bf16_t*, int64_t, int64_t, int64_t, int64_t, const bf16_t*,
                                      const float*, bf16_t*);
template void linear_amx_bf16<fp16_t>(const bf16_t*, int64_t, int64_t, int64_t, int64_t, const bf16_t*,
                                      const float*, fp16_t*);

}  // namespace cpu_backend

#endif
