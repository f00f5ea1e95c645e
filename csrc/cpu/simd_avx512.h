// The vector API of vector_loops.inc on AVX-512 (F, DQ, BW, VL): 16 floats or 8 doubles per
// vector. Comparisons give all-ones / zero lanes like AVX2's (through the mask registers), so
// the loops read the same on every instruction set. Every function carries the target
// attribute (no -mavx512f for the file): nothing else in the library picks up this code.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

#define SDCP_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
#define SDCP_INLINE \
  inline __attribute__((always_inline, target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))

namespace sdcp::cpu::avx512 {

struct VF {
  __m512 v;
};
struct VI {
  __m512i v;
};
struct VD {  // kLanes / 2 doubles
  __m512d v;
};
struct VL {
  __m512i v;
};
constexpr int kLanes = 16;

SDCP_INLINE VF lanes_of(__mmask16 m) { return {_mm512_castsi512_ps(_mm512_movm_epi32(m))}; }
SDCP_INLINE __mmask16 mask_of(VF a) { return _mm512_movepi32_mask(_mm512_castps_si512(a.v)); }

SDCP_INLINE VF vf_set1(float a) { return {_mm512_set1_ps(a)}; }
SDCP_INLINE VF vf_zero() { return {_mm512_setzero_ps()}; }
SDCP_INLINE VF load8(const float* p) { return {_mm512_loadu_ps(p)}; }
SDCP_INLINE VF load8(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
SDCP_INLINE VF load8(const F16* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
SDCP_INLINE VF load8(const int8_t* p) {  // int8 weights (twin_loops.inc)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
SDCP_INLINE void store8(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
SDCP_INLINE VF vf_add(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_sub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_div(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
// keeps a loaded vector in a register (the compiler would fold its load into every use)
SDCP_INLINE void vf_in_register(VF& a) { asm("" : "+v"(a.v)); }
SDCP_INLINE VF vf_fmadd(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
SDCP_INLINE VF vf_max(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }  // b when either is NaN
SDCP_INLINE VF vf_gt(VF a, VF b) { return lanes_of(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)); }
SDCP_INLINE VF vf_ge(VF a, VF b) { return lanes_of(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ)); }
SDCP_INLINE VF vf_lt(VF a, VF b) { return lanes_of(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)); }
SDCP_INLINE VF vf_eq(VF a, VF b) { return lanes_of(_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ)); }
SDCP_INLINE VF vf_isnan(VF a) { return lanes_of(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)); }
SDCP_INLINE VF vf_and(VF a, VF b) { return {_mm512_and_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_or(VF a, VF b) { return {_mm512_or_ps(a.v, b.v)}; }
SDCP_INLINE VF vf_abs(VF a) {
  return {_mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7FFFFFFF)))};
}
SDCP_INLINE int vf_movemask(VF a) { return int(mask_of(a)); }
SDCP_INLINE VI vf_as_int(VF a) { return {_mm512_castps_si512(a.v)}; }
SDCP_INLINE VF vi_as_float(VI a) { return {_mm512_castsi512_ps(a.v)}; }
SDCP_INLINE VI vi_set1(int32_t a) { return {_mm512_set1_epi32(a)}; }
SDCP_INLINE VI vi_iota(int32_t base) {
  return {_mm512_add_epi32(_mm512_set1_epi32(base),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
}
SDCP_INLINE VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
SDCP_INLINE VI vi_sub(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
SDCP_INLINE VI vi_shl23(VI a) { return {_mm512_slli_epi32(a.v, 23)}; }
SDCP_INLINE VF vi_gt(VI a, VI b) { return lanes_of(_mm512_cmpgt_epi32_mask(a.v, b.v)); }
SDCP_INLINE VI vi_load(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
SDCP_INLINE int64_t vi_hsum(VI a) { return _mm512_reduce_add_epi32(a.v); }
SDCP_INLINE VF vf_select(VF mask, VF a, VF b) {
  return {_mm512_mask_blend_ps(mask_of(mask), b.v, a.v)};
}
SDCP_INLINE float vf_hsum(VF a) { return _mm512_reduce_add_ps(a.v); }
SDCP_INLINE float vf_hmax(VF a) { return _mm512_reduce_max_ps(a.v); }

SDCP_INLINE VD vd_set1(double a) { return {_mm512_set1_pd(a)}; }
SDCP_INLINE VD vd_zero() { return {_mm512_setzero_pd()}; }
SDCP_INLINE VD vd_lo(VF a) { return {_mm512_cvtps_pd(_mm512_castps512_ps256(a.v))}; }
SDCP_INLINE VD vd_hi(VF a) {
  return {_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)))};
}
SDCP_INLINE VD vd_load(const double* p) { return {_mm512_loadu_pd(p)}; }
SDCP_INLINE void vd_store(double* p, VD a) { _mm512_storeu_pd(p, a.v); }
SDCP_INLINE VD vd_add(VD a, VD b) { return {_mm512_add_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_sub(VD a, VD b) { return {_mm512_sub_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_mul(VD a, VD b) { return {_mm512_mul_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_fmadd(VD a, VD b, VD c) { return {_mm512_fmadd_pd(a.v, b.v, c.v)}; }
SDCP_INLINE VD vd_max(VD a, VD b) { return {_mm512_max_pd(a.v, b.v)}; }
SDCP_INLINE VD vd_residual(VD p, VD q) {
  const __m512d d = _mm512_sub_pd(p.v, q.v);
  const __mmask8 keep = _mm512_cmp_pd_mask(d, _mm512_setzero_pd(), _CMP_GT_OQ) &
                        _mm512_cmp_pd_mask(_mm512_sub_pd(q.v, q.v), _mm512_setzero_pd(), _CMP_EQ_OQ);
  return {_mm512_maskz_mov_pd(keep, d)};
}
SDCP_INLINE VL vd_as_long(VD a) { return {_mm512_castpd_si512(a.v)}; }
SDCP_INLINE VD vl_as_double(VL a) { return {_mm512_castsi512_pd(a.v)}; }
SDCP_INLINE VL vl_add(VL a, VL b) { return {_mm512_add_epi64(a.v, b.v)}; }
SDCP_INLINE VL vl_sub(VL a, VL b) { return {_mm512_sub_epi64(a.v, b.v)}; }
SDCP_INLINE VL vl_set1(int64_t a) { return {_mm512_set1_epi64(a)}; }
SDCP_INLINE VL vl_shl52(VL a) { return {_mm512_slli_epi64(a.v, 52)}; }
SDCP_INLINE double vd_hsum(VD a) { return _mm512_reduce_add_pd(a.v); }

}  // namespace sdcp::cpu::avx512
