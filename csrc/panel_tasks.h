// How the GEMM/GEMV drivers (linear.cpp, linear_wna16.cpp, linear_w8a8.cpp)
// share out their work: the weight is packed in P panels of kNR columns, the
// rows of x in C chunks of kMR; a task is one panel times a run of chunks.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace cpu_backend {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Microkernels over few rows (decode) keep this many independent accumulator
// sets over consecutive k, so the FMAs of one row do not wait on each other
// (one chain per row is FMA-latency bound: half the GEMV rate on AVX2).
template <int MR>
constexpr int kSplitK = MR == 1 ? 4 : (MR == 2 ? 2 : 1);

// Software prefetch along a panel stream, CB_PANEL_PF_BYTES ahead of p, of
// the BYTES a microkernel step consumes. A thread's panels are contiguous,
// so at M = 1 this runs on into its next panel: the hardware prefetcher
// restarts at every panel (a few KB each) and lags a GEMV's demand, and
// without this the DRAM reads and the compute barely overlap.
// The hint is T1 (into L2), not T0: a T0 prefetch holds one of the core's
// few L1 fill buffers until its line arrives from DRAM, which caps the misses
// in flight. On a Sapphire Rapids VM T1 made cold bf16 GEMVs 20-30% faster
// (2 threads: SmolLM2 qkv 65 -> 49 us, a 56 MB LM head 2.98 -> 2.40 ms, on a
// par with torch.sum). Not yet measured on AMD Zen.
#ifndef CB_PANEL_PF_BYTES
#define CB_PANEL_PF_BYTES 4096
#endif
#ifndef CB_PANEL_PF_LOCALITY
#define CB_PANEL_PF_LOCALITY 2  // __builtin_prefetch locality 2 = PREFETCHT1
#endif
template <int BYTES>
inline void prefetch_panel(const void* p) {
  if constexpr (CB_PANEL_PF_BYTES > 0) {
    const char* c = static_cast<const char*>(p) + CB_PANEL_PF_BYTES;
    for (int off = 0; off < BYTES; off += 64) __builtin_prefetch(c + off, 0, CB_PANEL_PF_LOCALITY);
  }
}

struct NoTaskScope {};

// Calls f(panel, first_chunk, end_chunk) for every task, on the pool's
// threads. `work` (about M * N * K) decides whether a parallel region pays.
// A Scope object lives around each thread's run of tasks (the AMX kernels'
// tile configuration: set once per thread and call, not per task).
template <typename Scope = NoTaskScope, typename F>
void parallel_panels(int64_t P, int64_t C, int64_t work, F&& f) {
  const int64_t T = std::max(1, at::get_num_threads());
  // Few panels: also split rows so every thread gets work.
  int64_t row_blocks = 1;
  if (C > 1 && P < 4 * T) row_blocks = std::min(C, ceil_div(4 * T, P));
  const int64_t per_block = ceil_div(C, row_blocks);
  row_blocks = ceil_div(C, per_block);
  const int64_t tasks = P * row_blocks;
  // Tiny problems: one thread (a parallel region costs a few microseconds).
  const int64_t grain = work < (int64_t(1) << 17) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    [[maybe_unused]] Scope scope;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb = t % row_blocks;
      f(t / row_blocks, rb * per_block, std::min(C, (rb + 1) * per_block));
    }
  });
}

}  // namespace cpu_backend
