// The row loops on AVX-512 (F, DQ, BW, VL) (x86-64 only; verify_cpu.cpp checks the CPU first).
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

// GCC 12 warns about its own AVX-512 intrinsics headers (an undefined first operand)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "simd_avx512.h"

namespace sdcp::cpu::avx512 {
#include "vector_loops.inc"
}  // namespace sdcp::cpu::avx512

namespace sdcp::cpu {

const IsaKernels* avx512_kernels() {
  static const IsaKernels k = avx512::kernels_table("avx512");
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const IsaKernels* avx512_kernels() { return nullptr; }
}  // namespace sdcp::cpu

#endif
