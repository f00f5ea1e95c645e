// The loops of the twin decoder (twin_cpu.cpp: a Llama forward with int8 weights), one table
// per instruction set like the verify op's IsaKernels (kernels.h): written once against the
// vector API in twin_loops.inc, compiled by twin_loops_{scalar,avx2,avx512}.cpp, chosen at run
// time (isa.h). No torch headers here.
#pragma once

#include <cstdint>
#include <type_traits>

namespace sdcp::cpu {

// Widths the loops rely on (twin_cpu.cpp checks every model against them): matrix columns and
// quantisation groups are whole multiples of kTwinCols, attention heads of kTwinHead.
constexpr int64_t kTwinCols = 32;
constexpr int64_t kTwinHead = 16;

// An int8 matrix with fp32 scales: row o, column i holds W[o * cols + i] * S[o * groups + i /
// (cols / groups)]; groups = 1 is one scale per row.
struct QMatrix {
  const int8_t* w = nullptr;
  const float* s = nullptr;
  int64_t rows = 0, cols = 0, groups = 1;
  const int32_t* row_sums = nullptr;  // sum_i W[o * cols + i] per row: matmul_q8 needs them
};

// An fp32 matrix, row o, column i at w[o * cols + i] (a linear layer's weight as torch keeps it).
struct FMatrix {
  const float* w = nullptr;
  int64_t rows = 0, cols = 0;
};

struct TwinLoops {
  const char* name;
  // Y[r * y_stride + o] = sum_i X[r * x_stride + i] * weight(o, i), for r < n and o in
  // [o_begin, o_end): each weight row is read from memory once per call whatever n is.
  void (*matmul)(const float* X, int64_t n, int64_t x_stride, const QMatrix& m, int64_t o_begin,
                 int64_t o_end, float* Y, int64_t y_stride);
  // the same product over an fp32 matrix (the `rows_linear` op, twin_cpu.cpp)
  void (*matmul_f32)(const float* X, int64_t n, int64_t x_stride, const FMatrix& m, int64_t o_begin,
                     int64_t o_end, float* Y, int64_t y_stride);
  // Attention of the G query heads q[g * dh ..] (one token) that share one K/V head, over its
  // positions 0..n_pos-1: out[g * dh ..] = softmax(q K^T * scale) V. Position j's key is the
  // dh floats at K + r * row_stride, r = pages[j / page] * page + j % page (pages null: r = j),
  // its value likewise from V. scores: room for G * n_pos floats.
  void (*attend)(const float* q, int64_t G, const float* K, const float* V, int64_t n_pos,
                 int64_t dh, const int64_t* pages, int64_t page, int64_t row_stride, float scale,
                 float* scores, float* out);
  // out[i] = silu(g[i]) * u[i] (n a multiple of kTwinCols)
  void (*silu_mul)(const float* g, const float* u, float* out, int64_t n);
  // The product over 8-bit activations (quantise_rows below): Y[r * y_stride + o] =
  // float(sum_i Xq[r * xq_stride + i] * W[o, i] - 128 * row_sums[o]) * x_scale[r] * s[o], the
  // sums exact in int32, for o in [o_begin, o_end) of a matrix with one scale a row. Null
  // where the CPU has no 8-bit dot products (AVX512-VNNI): only then is it filled in.
  void (*matmul_q8)(const uint8_t* Xq, const float* x_scale, int64_t n, int64_t xq_stride,
                    const QMatrix& m, int64_t o_begin, int64_t o_end, float* Y,
                    int64_t y_stride) = nullptr;
};

// Row r of X [n, cols] as 8-bit activations for matmul_q8: x_scale[r] = max_i |x_i| / 127
// and Xq[i] = nearbyint(x_i * (127 / max_i |x_i|)) + 128 (round half to even; a row of zeros
// gives scale 0 and 128s). kernels/native.py's q8_linear_reference does the same in torch.
void quantise_rows(const float* X, int64_t n, int64_t cols, int64_t x_stride, uint8_t* Xq,
                   int64_t xq_stride, float* x_scale);

const TwinLoops& twin_scalar_loops();
const TwinLoops* twin_avx2_loops();    // null where not compiled (not x86-64)
const TwinLoops* twin_avx512_loops();  // likewise

}  // namespace sdcp::cpu
