#include "isa.h"

#include <cstdlib>
#include <cstring>

namespace sdcp::cpu {
namespace {

Isa best_isa() {
  static const Isa best = [] {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
      return Isa::kAvx512;
    }
    if (avx2) return Isa::kAvx2;
#endif
    return Isa::kScalar;
  }();
  return best;
}

}  // namespace

Isa chosen_isa() {
  const Isa best = best_isa();
  const char* force = std::getenv("SDCP_NATIVE_ISA");
  if (force && std::strcmp(force, "scalar") == 0) return Isa::kScalar;
  if (force && std::strcmp(force, "avx2") == 0 && best != Isa::kScalar) return Isa::kAvx2;
  return best;
}

}  // namespace sdcp::cpu
