// The twin decoder's loops in portable C++: the fallback chosen at run time on CPUs without AVX2.
#include <algorithm>
#include <cmath>

#include "simd_scalar.h"
#include "twin.h"

namespace sdcp::cpu::scalar {
#include "twin_loops.inc"
}  // namespace sdcp::cpu::scalar

namespace sdcp::cpu {

const TwinLoops& twin_scalar_loops() {
  static const TwinLoops k = scalar::twin_loops_table("scalar");
  return k;
}

}  // namespace sdcp::cpu
