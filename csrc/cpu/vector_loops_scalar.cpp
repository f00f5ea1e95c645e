// The row loops in portable C++: the fallback chosen at run time on CPUs without AVX2.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "simd_scalar.h"

namespace sdcp::cpu::scalar {
#include "vector_loops.inc"
}  // namespace sdcp::cpu::scalar

namespace sdcp::cpu {

const IsaKernels& scalar_kernels() {
  static const IsaKernels k{"scalar",
                            scalar::scan_impl,
                            scalar::collect_above_impl,
                            scalar::kth_largest_key,
                            scalar::row_weights_impl,
                            scalar::block_sums_impl,
                            scalar::write_probs_impl,
                            scalar::any_finite_negative_impl,
                            scalar::mass_below_impl,
                            scalar::weights_of_impl};
  return k;
}

}  // namespace sdcp::cpu
