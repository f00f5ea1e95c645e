// Threads over a range for the native ops, on the calling thread's torch thread count.
//
// Why not at::parallel_for: ATen defines its lazy per-thread initialisation inline in its
// header, with a thread_local flag that every library compiled against the header holds a
// copy of. The first at::parallel_for of this library on a thread therefore sets that
// thread's count again from torch's process-wide one, undoing a count the thread had set
// itself: a role's event loop pinned to one thread (sdcp_fast/cores.py) got the compute
// thread's count back, and its next parallel-sized torch op started a second OpenMP team,
// which made libgomp throttle the spin of both teams for the rest of the process
// (bench/RESULTS.md, issue 38). at::get_num_threads() is libtorch's own and initialises
// with libtorch's flag, so the count it reads is the one the thread set.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace sdcp::cpu {

// f(b, e) over [begin, end) in chunks of at least `grain` elements, one chunk a thread, at
// most at::get_num_threads() threads; inline in this thread when one chunk (or one thread)
// is all there is, or when called inside a parallel region. The first exception a chunk
// throws is rethrown here once every chunk has finished.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
#ifdef _OPENMP
  const int64_t chunks = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads > 1 && !omp_in_parallel()) {
    const int64_t size = (n + threads - 1) / threads;
    std::exception_ptr failure;
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t b = begin + int64_t(omp_get_thread_num()) * size;
      if (b < end) {
        try {
          f(b, std::min(end, b + size));
        } catch (...) {
#pragma omp critical(sdcp_parallel_for_failure)
          if (!failure) failure = std::current_exception();
        }
      }
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#endif
  f(begin, end);
}

}  // namespace sdcp::cpu
