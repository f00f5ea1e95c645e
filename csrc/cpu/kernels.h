// Types shared by the instruction-set-specific row loops (vector_loops_*.cpp), the row logic
// (rows.cpp) and the op (verify_cpu.cpp). No torch headers here: the loop files compile fast
// and know nothing about tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sdcp::cpu {

// Logits element types, read as raw bits (the loops convert them to float themselves).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
enum class DType : int { kF32 = 0, kBf16 = 1, kF16 = 2 };

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(F16 h) {  // IEEE binary16 -> binary32, exact (subnormals, inf, NaN)
  const uint32_t sign = uint32_t(h.bits & 0x8000) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1F;
  uint32_t man = h.bits & 0x3FF;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Elements per block: the online sum rescales once per block and the draw keeps one sum per
// block; 4 KiB of fp32 stays in L1 between the two passes over a block.
constexpr int64_t kBlock = 1024;

// A token and its logit, ordered as the reference orders them: larger logit first, ties by
// smaller id. `w` is exp((logit - max) / T) in double, filled when a mass is needed.
struct Cand {
  float v;
  int32_t id;
  double w;
};
inline bool ranks_before(const Cand& a, const Cand& b) {
  return a.v > b.v || (a.v == b.v && a.id < b.id);
}

// The logit as a signed integer with the same order (the Triton kernels' key): -0.0 and +0.0
// are the same logit. Not for NaN.
inline int32_t order_key(float v) {
  int32_t bits;
  v += 0.0f;  // -0.0 -> +0.0
  std::memcpy(&bits, &v, 4);
  return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}
inline float key_value(int32_t key) {
  const int32_t bits = key < 0 ? key ^ 0x7FFFFFFF : key;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Tokens per group: the max pass can record every group's max (NaN ignored), so that later
// passes visit only the groups that can hold what they look for.
constexpr int64_t kGroup = 32;

// What one streaming pass over a row computes besides max, argmax and the bad-row flag.
struct ScanRequest {
  bool sum = false;        // sum of exp((x - max) / T) over the row (online, rescaled per block)
  float k2 = 1.4426950f;   // log2(e) / T, as used by the float exp
  double T = 1.0;
  float* group_max = nullptr;  // ceil(V / kGroup) group maxima (-inf: none finite), or null
};

struct ScanResult {
  float max = -__builtin_inff();  // NaN ignored
  int64_t arg = 0;                // smallest id holding the max
  bool bad = false;               // NaN or +inf in the row, or no finite value
  double sum = 0.0;               // when requested: sum of exp((x - max) / T)
};

// The kept set and temperature of a row, for the loops that weight its tokens. Kept: every
// token (masked false), or x > tau, or x == tau with id <= tie_last.
struct KeptSet {
  float m;         // row max
  double inv_t;    // 1 / T
  float k2;        // log2(e) / T, for the float exp
  bool masked;
  float tau;
  int32_t tie_last;
};

// The row loops of one instruction set (selected at run time, see verify_cpu.cpp).
struct IsaKernels {
  const char* name;
  void (*scan)(DType dt, const void* x, int64_t V, const ScanRequest& rq, ScanResult& out);
  // every token with logit > above, from the groups whose max is > above, ids ascending
  void (*collect_above)(DType dt, const void* x, int64_t V, const float* group_max, float above,
                        std::vector<Cand>& out);
  // the largest t with at least k of key[0..n) >= t, for a lo <= that t (n > k; key must have
  // room for padding to a multiple of 16)
  int32_t (*kth_largest_key)(int32_t* key, size_t n, int64_t k, int64_t lo);
  // w_i = exp((x_i - m) / T) in double for kept tokens, 0 for the others, into w (when not
  // null); returns their sum
  double (*row_weights)(DType dt, const void* x, int64_t V, const KeptSet& ks, double* w);
  // per block of kBlock tokens: the sum of w_i * inv_s, or (q given) of the residual
  // max(0, w_i * inv_s - q_i) over finite q_i; in double
  void (*block_sums)(const double* w, const float* q, int64_t V, double inv_s, double* sums);
  // p_i = w_i / S in float for the whole row, w from the float exp (out: V floats)
  void (*write_probs)(DType dt, const void* x, int64_t V, const KeptSet& ks, float inv_s,
                      float* out);
  // whether some q_i is finite and negative (then tokens outside the kept set hold residual mass)
  bool (*any_finite_negative)(const float* q, int64_t V);
  // for each of kLadder thresholds, the sum of exp2((x - m) * k2) over the tokens with
  // x < floors[j] (float exp, block sums in double)
  void (*mass_below)(DType dt, const void* x, int64_t V, float m, float k2, const float* floors,
                     double* out);
  // w[i] = exp((v[i] - m) * inv_t) in double (v <= m)
  void (*weights_of)(const float* v, size_t n, float m, double inv_t, double* w);
};

constexpr int kLadder = 12;  // thresholds of mass_below

const IsaKernels& scalar_kernels();
const IsaKernels* avx2_kernels();    // null where the AVX2 loops are not compiled (not x86-64)
const IsaKernels* avx512_kernels();  // likewise

// The one residual rule of every path (reference.py: finite q and p > q give p - q, else 0).
inline double residual(double p, double q) { return (q - q == 0.0 && p - q > 0.0) ? p - q : 0.0; }

}  // namespace sdcp::cpu
