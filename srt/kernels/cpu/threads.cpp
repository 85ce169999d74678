// torch.ops.srt_cpu.bind_omp_threads: pin each OpenMP worker thread of the calling thread's pool
// to one CPU.
//
//   cpus   int[]   n CPU ids (n >= 1): team thread i is pinned to cpus[i]
//   -> out [n, 3]  int64, row i = (tid, cpu, err) of team thread i:
//                  tid  the thread's Linux thread id (-1: the team had fewer than n threads)
//                  cpu  cpus[i]
//                  err  0, or the errno of sched_setaffinity (-1: the thread did not run)
//
// One `#pragma omp parallel num_threads(n)` region runs on the OpenMP runtime torch uses (the
// extension links libgomp.so.1, the soname torch's own libgomp carries, so the loader maps one
// runtime into the process): with a static team of n, libgomp hands team slot i to the same pool
// thread in every later region of size n started from this thread, i.e. at::parallel_for's,
// MKL's and oneDNN's. Thread 0 is the calling thread itself. sched_setaffinity(0, ...) acts on the
// calling thread only; threads created later inherit the affinity of the thread that creates them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace srt_cpu {
namespace {

// Pin the calling thread to `cpu`; returns 0 or errno.
int64_t pin_current_thread(int64_t cpu) {
  const size_t size = CPU_ALLOC_SIZE(cpu + 1);
  cpu_set_t* set = CPU_ALLOC(cpu + 1);
  if (set == nullptr) return ENOMEM;
  CPU_ZERO_S(size, set);
  CPU_SET_S(static_cast<size_t>(cpu), size, set);
  const int rc = sched_setaffinity(0, size, set);
  const int64_t err = rc == 0 ? 0 : errno;
  CPU_FREE(set);
  return err;
}

void pin_slot(int64_t slot, const int64_t* cpus, int64_t* rows) {
  int64_t* row = rows + slot * 3;
  row[0] = static_cast<int64_t>(syscall(SYS_gettid));
  row[2] = pin_current_thread(cpus[slot]);
}

at::Tensor bind_omp_threads(at::IntArrayRef cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= 1, "bind_omp_threads: give at least one CPU");
  for (const int64_t c : cpus) {
    TORCH_CHECK(c >= 0 && c < (1 << 16), "bind_omp_threads: CPU id ", c, " is out of range");
  }
  at::Tensor out = at::empty({n, 3}, at::kLong);
  int64_t* rows = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    rows[i * 3] = -1;
    rows[i * 3 + 1] = cpus[i];
    rows[i * 3 + 2] = -1;
  }
  const int64_t* cpu_ids = cpus.data();
#ifdef _OPENMP
#pragma omp parallel num_threads(static_cast<int>(n))
  {
    const int64_t slot = omp_get_thread_num();
    if (slot < n) pin_slot(slot, cpu_ids, rows);
  }
#else
  pin_slot(0, cpu_ids, rows);
#endif
  return out;
}

}  // namespace
}  // namespace srt_cpu

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("bind_omp_threads(int[] cpus) -> Tensor", &srt_cpu::bind_omp_threads);
}
