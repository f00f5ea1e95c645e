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

// The product over 8-bit activations (twin.h, matmul_q8) with AVX512-VNNI's u8 x s8 dot
// products: 64 weights an instruction, no conversion of the weights, sums exact in int32.
// Its own target: the CPU may have AVX-512 without VNNI (twin_avx512_loops checks).
#define SDCP_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

namespace sdcp::cpu::avx512 {

// dots[a][b] = sum_i Xq[b * xq_stride + i] * W[o + a, i] over the matrix's columns (a multiple
// of 32: the last 32 through a masked load, whose zeros add nothing)
template <int RO, int RB>
SDCP_VNNI inline __attribute__((always_inline)) void q8_tile(const uint8_t* Xq, int64_t xq_stride,
                                                             const QMatrix& m, int64_t o,
                                                             int32_t (&dots)[RO][RB]) {
  const int64_t cols = m.cols;
  const int8_t* w = m.w + o * cols;
  __m512i acc[RO][RB];
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RB; ++b) acc[a][b] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= cols; i += 64) {
    __m512i wv[RO];
    for (int a = 0; a < RO; ++a) wv[a] = _mm512_loadu_si512(w + a * cols + i);
    for (int b = 0; b < RB; ++b) {
      const __m512i xv = _mm512_loadu_si512(Xq + b * xq_stride + i);
      for (int a = 0; a < RO; ++a) acc[a][b] = _mm512_dpbusd_epi32(acc[a][b], xv, wv[a]);
    }
  }
  if (i < cols) {
    const __mmask64 half = 0xFFFFFFFFull;
    __m512i wv[RO];
    for (int a = 0; a < RO; ++a) wv[a] = _mm512_maskz_loadu_epi8(half, w + a * cols + i);
    for (int b = 0; b < RB; ++b) {
      const __m512i xv = _mm512_maskz_loadu_epi8(half, Xq + b * xq_stride + i);
      for (int a = 0; a < RO; ++a) acc[a][b] = _mm512_dpbusd_epi32(acc[a][b], xv, wv[a]);
    }
  }
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RB; ++b) dots[a][b] = _mm512_reduce_add_epi32(acc[a][b]);
}

template <int RB>
SDCP_VNNI void q8_rows(const uint8_t* Xq, const float* x_scale, int64_t xq_stride, const QMatrix& m,
                       int64_t o_begin, int64_t o_end, float* Y, int64_t y_stride) {
  int64_t o = o_begin;
  auto store = [&](auto& dots, int rows) {
    for (int a = 0; a < rows; ++a)
      for (int b = 0; b < RB; ++b)
        Y[b * y_stride + o + a] =
            float(dots[a][b] - 128 * m.row_sums[o + a]) * x_scale[b] * m.s[o + a];
  };
  for (; o + 4 <= o_end; o += 4) {
    int32_t dots[4][RB];
    q8_tile<4, RB>(Xq, xq_stride, m, o, dots);
    store(dots, 4);
  }
  for (; o < o_end; ++o) {
    int32_t dots[1][RB];
    q8_tile<1, RB>(Xq, xq_stride, m, o, dots);
    store(dots, 1);
  }
}

// output rows in blocks that stay in L1 while every group of up to 4 activation rows passes
SDCP_VNNI void matmul_q8_impl(const uint8_t* Xq, const float* x_scale, int64_t n, int64_t xq_stride,
                              const QMatrix& m, int64_t o_begin, int64_t o_end, float* Y,
                              int64_t y_stride) {
  constexpr int64_t kBlock = 16;
  for (int64_t ob = o_begin; ob < o_end; ob += kBlock) {
    const int64_t oe = std::min(ob + kBlock, o_end);
    int64_t r = 0;
    for (; r + 4 <= n; r += 4)
      q8_rows<4>(Xq + r * xq_stride, x_scale + r, xq_stride, m, ob, oe, Y + r * y_stride, y_stride);
    const uint8_t* xr = Xq + r * xq_stride;
    float* yr = Y + r * y_stride;
    switch (n - r) {
      case 3: q8_rows<3>(xr, x_scale + r, xq_stride, m, ob, oe, yr, y_stride); break;
      case 2: q8_rows<2>(xr, x_scale + r, xq_stride, m, ob, oe, yr, y_stride); break;
      case 1: q8_rows<1>(xr, x_scale + r, xq_stride, m, ob, oe, yr, y_stride); break;
      default: break;
    }
  }
}

}  // namespace sdcp::cpu::avx512

namespace sdcp::cpu {

const TwinLoops* twin_avx512_loops() {
  static const TwinLoops k = [] {
    TwinLoops loops = avx512::twin_loops_table("avx512");
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni")) loops.matmul_q8 = avx512::matmul_q8_impl;
    return loops;
  }();
  return &k;
}

}  // namespace sdcp::cpu

#else

namespace sdcp::cpu {
const TwinLoops* twin_avx512_loops() { return nullptr; }
}  // namespace sdcp::cpu

#endif
