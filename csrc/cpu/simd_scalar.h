// The 8-lane vector API of vector_loops.inc in portable C++ (the run-time fallback, and the
// only path on CPUs without AVX2). Lane semantics copy the AVX2 instructions exactly,
// NaN rules included, so both paths make the same decisions.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

#define SDCP_TARGET
#define SDCP_INLINE inline __attribute__((always_inline))

namespace sdcp::cpu::scalar {

struct VF {
  float v[8];
};
struct VI {
  int32_t v[8];
};
struct VD {  // kLanes / 2 doubles
  double v[4];
};
struct VL {
  int64_t v[4];
};
constexpr int kLanes = 8;

#define SDCP_LANES(expr) \
  VF r;                  \
  for (int l = 0; l < 8; ++l) r.v[l] = (expr); \
  return r

SDCP_INLINE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SDCP_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
SDCP_INLINE float mask_of(bool b) { return bits_float(b ? 0xFFFFFFFFu : 0u); }

SDCP_INLINE VF vf_set1(float a) { SDCP_LANES(a); }
SDCP_INLINE VF vf_zero() { return vf_set1(0.0f); }
SDCP_INLINE VF load8(const float* p) { SDCP_LANES(p[l]); }
SDCP_INLINE VF load8(const Bf16* p) { SDCP_LANES(to_float(p[l])); }
SDCP_INLINE VF load8(const F16* p) { SDCP_LANES(to_float(p[l])); }
SDCP_INLINE VF load8(const int8_t* p) { SDCP_LANES(float(p[l])); }  // int8 weights (twin_loops.inc)
SDCP_INLINE void store8(float* p, VF a) {
  for (int l = 0; l < 8; ++l) p[l] = a.v[l];
}
SDCP_INLINE VF vf_add(VF a, VF b) { SDCP_LANES(a.v[l] + b.v[l]); }
SDCP_INLINE VF vf_sub(VF a, VF b) { SDCP_LANES(a.v[l] - b.v[l]); }
SDCP_INLINE VF vf_mul(VF a, VF b) { SDCP_LANES(a.v[l] * b.v[l]); }
SDCP_INLINE VF vf_div(VF a, VF b) { SDCP_LANES(a.v[l] / b.v[l]); }
SDCP_INLINE void vf_in_register(VF&) {}
SDCP_INLINE VF vf_fmadd(VF a, VF b, VF c) { SDCP_LANES(a.v[l] * b.v[l] + c.v[l]); }
// maxps: the second operand when either is NaN (or both are zeros)
SDCP_INLINE VF vf_max(VF a, VF b) { SDCP_LANES(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
// ordered comparisons (false when either is NaN), as all-ones / zero masks
SDCP_INLINE VF vf_gt(VF a, VF b) { SDCP_LANES(mask_of(a.v[l] > b.v[l])); }
SDCP_INLINE VF vf_ge(VF a, VF b) { SDCP_LANES(mask_of(a.v[l] >= b.v[l])); }
SDCP_INLINE VF vf_lt(VF a, VF b) { SDCP_LANES(mask_of(a.v[l] < b.v[l])); }
SDCP_INLINE VF vf_eq(VF a, VF b) { SDCP_LANES(mask_of(a.v[l] == b.v[l])); }
SDCP_INLINE VF vf_isnan(VF a) { SDCP_LANES(mask_of(a.v[l] != a.v[l])); }
SDCP_INLINE VF vf_and(VF a, VF b) { SDCP_LANES(bits_float(float_bits(a.v[l]) & float_bits(b.v[l]))); }
SDCP_INLINE VF vf_or(VF a, VF b) { SDCP_LANES(bits_float(float_bits(a.v[l]) | float_bits(b.v[l]))); }
SDCP_INLINE VF vf_abs(VF a) { SDCP_LANES(bits_float(float_bits(a.v[l]) & 0x7FFFFFFFu)); }
SDCP_INLINE int vf_movemask(VF a) {
  int m = 0;
  for (int l = 0; l < 8; ++l) m |= int(float_bits(a.v[l]) >> 31) << l;
  return m;
}
SDCP_INLINE VI vf_as_int(VF a) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = int32_t(float_bits(a.v[l]));
  return r;
}
SDCP_INLINE VF vi_as_float(VI a) { SDCP_LANES(bits_float(uint32_t(a.v[l]))); }
SDCP_INLINE VI vi_set1(int32_t a) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = a;
  return r;
}
SDCP_INLINE VI vi_iota(int32_t base) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = base + l;
  return r;
}
SDCP_INLINE VI vi_add(VI a, VI b) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = int32_t(uint32_t(a.v[l]) + uint32_t(b.v[l]));
  return r;
}
SDCP_INLINE VI vi_sub(VI a, VI b) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = int32_t(uint32_t(a.v[l]) - uint32_t(b.v[l]));
  return r;
}
SDCP_INLINE VI vi_shl23(VI a) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = int32_t(uint32_t(a.v[l]) << 23);
  return r;
}
SDCP_INLINE VF vi_gt(VI a, VI b) { SDCP_LANES(mask_of(a.v[l] > b.v[l])); }
SDCP_INLINE VI vi_load(const int32_t* p) {
  VI r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
SDCP_INLINE int64_t vi_hsum(VI a) {
  int64_t s = 0;
  for (int l = 0; l < 8; ++l) s += a.v[l];
  return s;
}
// lanes of a where mask is set, of b elsewhere
SDCP_INLINE VF vf_select(VF mask, VF a, VF b) { SDCP_LANES(float_bits(mask.v[l]) >> 31 ? a.v[l] : b.v[l]); }
// horizontal sum in the order of the AVX2 version: (l + l+4), then (0+2, 1+3), then both
SDCP_INLINE float vf_hsum(VF a) {
  const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
  return (s0 + s2) + (s1 + s3);
}
SDCP_INLINE float vf_hmax(VF a) {  // lanes are never NaN here
  float m = a.v[0];
  for (int l = 1; l < 8; ++l) m = a.v[l] > m ? a.v[l] : m;
  return m;
}

#define SDCP_DLANES(expr) \
  VD r;                   \
  for (int l = 0; l < 4; ++l) r.v[l] = (expr); \
  return r

SDCP_INLINE double bits_double(uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
SDCP_INLINE uint64_t double_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}
SDCP_INLINE VD vd_set1(double a) { SDCP_DLANES(a); }
SDCP_INLINE VD vd_zero() { return vd_set1(0.0); }
SDCP_INLINE VD vd_lo(VF a) { SDCP_DLANES(double(a.v[l])); }
SDCP_INLINE VD vd_hi(VF a) { SDCP_DLANES(double(a.v[l + 4])); }
SDCP_INLINE VD vd_load(const double* p) { SDCP_DLANES(p[l]); }
SDCP_INLINE void vd_store(double* p, VD a) {
  for (int l = 0; l < 4; ++l) p[l] = a.v[l];
}
SDCP_INLINE VD vd_add(VD a, VD b) { SDCP_DLANES(a.v[l] + b.v[l]); }
SDCP_INLINE VD vd_sub(VD a, VD b) { SDCP_DLANES(a.v[l] - b.v[l]); }
SDCP_INLINE VD vd_mul(VD a, VD b) { SDCP_DLANES(a.v[l] * b.v[l]); }
SDCP_INLINE VD vd_fmadd(VD a, VD b, VD c) { SDCP_DLANES(a.v[l] * b.v[l] + c.v[l]); }
SDCP_INLINE VD vd_max(VD a, VD b) { SDCP_DLANES(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
// max(0, p - q) where q is finite, else 0
SDCP_INLINE VD vd_residual(VD p, VD q) {
  SDCP_DLANES((q.v[l] - q.v[l] == 0.0 && p.v[l] - q.v[l] > 0.0) ? p.v[l] - q.v[l] : 0.0);
}
SDCP_INLINE VL vd_as_long(VD a) {
  VL r;
  for (int l = 0; l < 4; ++l) r.v[l] = int64_t(double_bits(a.v[l]));
  return r;
}
SDCP_INLINE VD vl_as_double(VL a) { SDCP_DLANES(bits_double(uint64_t(a.v[l]))); }
SDCP_INLINE VL vl_add(VL a, VL b) {
  VL r;
  for (int l = 0; l < 4; ++l) r.v[l] = int64_t(uint64_t(a.v[l]) + uint64_t(b.v[l]));
  return r;
}
SDCP_INLINE VL vl_sub(VL a, VL b) {
  VL r;
  for (int l = 0; l < 4; ++l) r.v[l] = int64_t(uint64_t(a.v[l]) - uint64_t(b.v[l]));
  return r;
}
SDCP_INLINE VL vl_set1(int64_t a) {
  VL r;
  for (int l = 0; l < 4; ++l) r.v[l] = a;
  return r;
}
SDCP_INLINE VL vl_shl52(VL a) {
  VL r;
  for (int l = 0; l < 4; ++l) r.v[l] = int64_t(uint64_t(a.v[l]) << 52);
  return r;
}
SDCP_INLINE double vd_hsum(VD a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }

#undef SDCP_DLANES
#undef SDCP_LANES

}  // namespace sdcp::cpu::scalar
