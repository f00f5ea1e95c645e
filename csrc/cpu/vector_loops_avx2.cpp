// The row loops on AVX2 + FMA + F16C (x86-64 only; verify_cpu.cpp checks the CPU first).
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "simd_avx2.h"

namespace sdcp::cpu::avx2 {
#include "vector_loops.inc"
}  // namespace sdcp::cpu::avx2

namespace sdcp::cpu {

const IsaKernels* avx2_kernels() {
  static const IsaKernels k{"avx2",
                            avx2::scan_impl,
                            avx2::collect_above_impl,
                            avx2::kth_largest_key,
                            avx2::row_weights_impl,
                            avx2::block_sums_impl,
                            avx2::write_probs_impl,
                            avx2::any_finite_negative_impl,
                            avx2::mass_below_impl,
                            avx2::weights_of_impl};
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const IsaKernels* avx2_kernels() { return nullptr; }
}  // namespace sdcp::cpu

#endif
