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
  static const IsaKernels k = scalar::kernels_table("scalar");
  return k;
}

}  // namespace sdcp::cpu
