// OpenMP thread placement for a worker that runs inside an already started
// process (the engine-core process with VLLM_CPU_BACKEND_WORKER_IN_ENGINE=1,
// or the caller's with VLLM_ENABLE_V1_MULTIPROCESSING=0). There no OMP_PLACES /
// KMP_AFFINITY can be set before the OpenMP runtime starts, so the threads of
// the pool pin themselves, one per CPU, from inside a parallel region.
// cpu_backend.worker.binding calls these; ISA-independent.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <sched.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace cpu_backend {
namespace {

// Runs fn(thread_index) on every thread of the pool. at::parallel_for over
// [0, threads) with grain 1 gives each pool thread one index (a pool of one
// runs it inline on the caller).
template <typename Fn>
void on_each_thread(int64_t threads, Fn&& fn) {
  std::vector<int> ran(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num();
    if (t < threads && !ran[t]) {
      ran[t] = 1;
      fn(t);
    }
  });
  for (int64_t t = 0; t < threads; ++t) {
    TORCH_CHECK(ran[t], "thread ", t, " of the pool of ", threads,
                " did not run (nested parallel region or OMP_DYNAMIC?)");
  }
}

}  // namespace

// Pins OpenMP thread i of the pool to cpus[i]; the pool must have exactly
// len(cpus) threads (torch.set_num_threads first).
void pin_threads(const std::vector<int64_t>& cpus) {
  const int64_t threads = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) == threads, "pin_threads: ", cpus.size(),
              " CPUs for a pool of ", threads, " threads");
  std::vector<int> errors(threads, 0);
  on_each_thread(threads, [&](int64_t t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    errors[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
  });
  for (int64_t t = 0; t < threads; ++t) {
    TORCH_CHECK(errors[t] == 0, "pin_threads: thread ", t, " -> CPU ", cpus[t], ": ",
                std::strerror(errors[t]));
  }
}

// [threads, cpus] uint8 mask: row i is where OpenMP thread i of the pool may run.
at::Tensor thread_affinity() {
  const int64_t threads = at::get_num_threads();
  const int64_t ncpu = std::max<int64_t>(sysconf(_SC_NPROCESSORS_CONF), 1);
  at::Tensor mask = at::zeros({threads, ncpu}, at::kByte);
  uint8_t* rows = mask.data_ptr<uint8_t>();
  on_each_thread(threads, [&](int64_t t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return;
    for (int64_t c = 0; c < ncpu && c < CPU_SETSIZE; ++c) rows[t * ncpu + c] = CPU_ISSET(c, &set);
  });
  return mask;
}

}  // namespace cpu_backend

TORCH_LIBRARY_FRAGMENT(cpu_backend, m) {
  m.def("pin_threads(int[] cpus) -> ()", &cpu_backend::pin_threads);
  m.def("thread_affinity() -> Tensor", &cpu_backend::thread_affinity);
}
