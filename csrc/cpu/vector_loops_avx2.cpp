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
  static const IsaKernels k = avx2::kernels_table("avx2");
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const IsaKernels* avx2_kernels() { return nullptr; }
}  // namespace sdcp::cpu

#endif
