// Per-row decisions of the native verify op: the target distribution of one logits row
// (max, argmax, flags, kept set, mass), p(x) for the acceptance test, the extra-token draw and
// the p row of target_probs. The heavy streaming is done by the IsaKernels loops; the
// decisions are exact against the float64 reference (see rows.cpp for how).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace sdcp::cpu {

struct RowView {
  DType dt;
  const void* x;  // V elements of dt
  int64_t V;
  float at(int64_t i) const {
    switch (dt) {
      case DType::kF32: return static_cast<const float*>(x)[i];
      case DType::kBf16: return to_float(static_cast<const Bf16*>(x)[i]);
      default: return to_float(static_cast<const F16*>(x)[i]);
    }
  }
};

struct Profile {
  int64_t temperature_milli;  // 0 = greedy
  int64_t top_k;              // 0 = off
  int64_t top_p_milli;        // 1000 = off
};

struct Kept {  // a kept token and its weight exp((x - max) / T)
  int32_t id;
  double w;
};

struct RowStat {
  float m = 0.0f;        // row max
  int64_t arg = 0;       // smallest id holding the max
  bool bad = false;      // NaN, +inf, or no finite value
  bool full = false;     // the target distribution below was computed (T > 0)
  double T = 1.0;        // temperature
  float k2 = 1.4426950f; // log2(e) / T in float
  // kept set: every token (masked false), else x > tau or (x == tau and id <= tie_last)
  bool masked = false;
  float tau = 0.0f;
  int32_t tie_last = 0;
  double S = 0.0;        // mass of the kept set: sum of exp((x - m) / T)
  bool S_exact = false;  // S summed in double (else from the float pass: within kSumRel)
  std::vector<Kept> list;  // the kept tokens by id, when there are at most kListMax of them
  bool has_list = false;
};

// Max, argmax and flags always; with `full` (and T > 0) the kept set and its mass.
void compute_row_stat(const RowView& row, const Profile& pf, bool full, const IsaKernels& k,
                      RowStat& st);

// Rule 2 acceptance of token x at this row: u < min(1, p(x) / qx). May make st.S exact.
bool accept_token(const RowView& row, RowStat& st, int64_t x, double qx, double u,
                  const IsaKernels& k);

// The extra token: drawn with u from the residual max(0, p - q) when q_row is given (from p
// if the residual has no mass), from p otherwise.
int64_t draw_token(const RowView& row, RowStat& st, const float* q_row, double u,
                   const IsaKernels& k);

// p for the whole row in float (NaN row for a bad row, one-hot for greedy).
void write_probs(const RowView& row, const RowStat& st, const IsaKernels& k, float* out);

}  // namespace sdcp::cpu
