// The 8-lane vector API of vector_loops.inc on AVX2 + FMA + F16C. Every function carries the
// target attribute (no -mavx2 for the file), so nothing else in the library can pick up AVX2
// code and the scalar fallback stays safe on CPUs without it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

#define SDCP_TARGET __attribute__((target("avx2,fma,f16c")))
#define SDCP_INLINE inline __attribute__((always_inline, target("avx2,fma,f16c")))

namespace sdcp::cpu::avx2 {

struct VF {
  __m256 v;
};
struct VI {
  __m256i v;
};
struct VD {  // kLanes / 2 doubles
  __m256d v;
};
struct VL {
  __m256i v;
};
constexpr int kLanes = 8;

SDCP_INLINE VF vf_set1(float a) { return {_mm256_set1_ps(a)}; }
SDCP_INLINE VF vf_zero() { return {_mm256_setzero_ps()}; }
SDCP_INLINE VF load8(const float* p) { return {_mm256_loadu_ps(p)}; }
SDCP_INLINE VF load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
SDCP_INLINE VF load8(const F16* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
SDCP_INLINE VF load8(const int8_t* p) {  // int8 weights (twin_loops.inc)
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
SDCP_INLINE void store8(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
SDCP_INLINE VF vf_add(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_sub(VF a, VF b) { return {_mm256_sub_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_mul(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_div(VF a, VF b) { return {_mm256_div_ps(a.v, b.v)}; }
// keeps a loaded vector in a register (the compiler would fold its load into every use)
SDCP_INLINE void vf_in_register(VF& a) { asm("" : "+x"(a.v)); }
SDCP_INLINE VF vf_fmadd(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
SDCP_INLINE VF vf_max(VF a, VF b) { return {_mm256_max_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_gt(VF a, VF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)}; }
SDCP_INLINE VF vf_ge(VF a, VF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ)}; }
SDCP_INLINE VF vf_lt(VF a, VF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
SDCP_INLINE VF vf_eq(VF a, VF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)}; }
SDCP_INLINE VF vf_isnan(VF a) { return {_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}; }
SDCP_INLINE VF vf_and(VF a, VF b) { return {_mm256_and_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_or(VF a, VF b) { return {_mm256_or_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_abs(VF a) {
  return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)))};
}
SDCP_INLINE int vf_movemask(VF a) { return _mm256_movemask_ps(a.v); }
SDCP_INLINE VI vf_as_int(VF a) { return {_mm256_castps_si256(a.v)}; }
SDCP_INLINE VF vi_as_float(VI a) { return {_mm256_castsi256_ps(a.v)}; }
SDCP_INLINE VI vi_set1(int32_t a) { return {_mm256_set1_epi32(a)}; }
SDCP_INLINE VI vi_iota(int32_t base) {
  return {_mm256_add_epi32(_mm256_set1_epi32(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
}
SDCP_INLINE VI vi_add(VI a, VI b) { return {_mm256_add_epi32(a.v, b.v)}; }
SDCP_INLINE VI vi_sub(VI a, VI b) { return {_mm256_sub_epi32(a.v, b.v)}; }
SDCP_INLINE VI vi_shl23(VI a) { return {_mm256_slli_epi32(a.v, 23)}; }
SDCP_INLINE VF vi_gt(VI a, VI b) { return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.v, b.v))}; }
SDCP_INLINE VI vi_load(const int32_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
SDCP_INLINE int64_t vi_hsum(VI a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
SDCP_INLINE VF vf_select(VF mask, VF a, VF b) { return {_mm256_blendv_ps(b.v, a.v, mask.v)}; }
SDCP_INLINE float vf_hsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
SDCP_INLINE float vf_hmax(VF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


SDCP_INLINE VD vd_set1(double a) { return {_mm256_set1_pd(a)}; }
SDCP_INLINE VD vd_zero() { return {_mm256_setzero_pd()}; }
SDCP_INLINE VD vd_lo(VF a) { return {_mm256_cvtps_pd(_mm256_castps256_ps128(a.v))}; }
SDCP_INLINE VD vd_hi(VF a) { return {_mm256_cvtps_pd(_mm256_extractf128_ps(a.v, 1))}; }
SDCP_INLINE VD vd_load(const double* p) { return {_mm256_loadu_pd(p)}; }
SDCP_INLINE void vd_store(double* p, VD a) { _mm256_storeu_pd(p, a.v); }
SDCP_INLINE VD vd_add(VD a, VD b) { return {_mm256_add_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_sub(VD a, VD b) { return {_mm256_sub_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_mul(VD a, VD b) { return {_mm256_mul_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_fmadd(VD a, VD b, VD c) { return {_mm256_fmadd_pd(a.v, b.v, c.v)}; }
SDCP_INLINE VD vd_max(VD a, VD b) { return {_mm256_max_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_residual(VD p, VD q) {
  const __m256d d = _mm256_sub_pd(p.v, q.v);
  const __m256d finite = _mm256_cmp_pd(_mm256_sub_pd(q.v, q.v), _mm256_setzero_pd(), _CMP_EQ_OQ);
  return {_mm256_and_pd(_mm256_and_pd(d, _mm256_cmp_pd(d, _mm256_setzero_pd(), _CMP_GT_OQ)), finite)};
}
SDCP_INLINE VL vd_as_long(VD a) { return {_mm256_castpd_si256(a.v)}; }
SDCP_INLINE VD vl_as_double(VL a) { return {_mm256_castsi256_pd(a.v)}; }
SDCP_INLINE VL vl_add(VL a, VL b) { return {_mm256_add_epi64(a.v, b.v)}; }
SDCP_INLINE VL vl_sub(VL a, VL b) { return {_mm256_sub_epi64(a.v, b.v)}; }
SDCP_INLINE VL vl_set1(int64_t a) { return {_mm256_set1_epi64x(a)}; }
SDCP_INLINE VL vl_shl52(VL a) { return {_mm256_slli_epi64(a.v, 52)}; }
SDCP_INLINE double vd_hsum(VD a) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a.v), _mm256_extractf128_pd(a.v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

}  // namespace sdcp::cpu::avx2
