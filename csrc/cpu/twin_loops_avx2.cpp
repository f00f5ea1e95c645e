// The twin decoder's loops on AVX2 + FMA + F16C (x86-64 only; isa.cpp checks the CPU first).
#include <algorithm>
#include <cmath>

#include "twin.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "simd_avx2.h"

namespace sdcp::cpu::avx2 {
#include "twin_loops.inc"
}  // namespace sdcp::cpu::avx2

namespace sdcp::cpu {

const TwinLoops* twin_avx2_loops() {
  static const TwinLoops k = avx2::twin_loops_table("avx2");
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const TwinLoops* twin_avx2_loops() { return nullptr; }
}  // namespace sdcp::cpu

#endif
