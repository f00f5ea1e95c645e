// Which instruction set the native ops run (every op of the library makes the same choice):
// AVX-512 or AVX2 when the CPU has them and the loops were compiled (x86-64), the portable
// loops otherwise. SDCP_NATIVE_ISA=scalar or =avx2 caps the choice (tests, and CPUs that slow
// down on AVX-512); it is read at every call, so a test can switch it.
#pragma once

namespace sdcp::cpu {

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa chosen_isa();

}  // namespace sdcp::cpu
