// The twin decoder's loops on AVX-512 (F, DQ, BW, VL) (x86-64 only; isa.cpp checks the CPU first).
#include <algorithm>
#include <cmath>

#include "twin.h"

#if defined(__x86_64__) || defined(_M_X64)

// GCC 12 warns about its own AVX-512 intrinsics headers (an undefined first operand)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "simd_avx512.h"

namespace sdcp::cpu::avx512 {
#include "twin_loops.inc"
}  // namespace sdcp::cpu::avx512

namespace sdcp::cpu {

const TwinLoops* twin_avx512_loops() {
  static const TwinLoops k = avx512::twin_loops_table("avx512");
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const TwinLoops* twin_avx512_loops() { return nullptr; }
}  // namespace sdcp::cpu

#endif
