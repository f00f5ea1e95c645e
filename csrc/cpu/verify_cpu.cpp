// The CPU implementation of the sdcp ops: input checks, the schedules, and the choice of row
// loops at run time (AVX-512 or AVX2 when the CPU has them, the portable loops otherwise).
//
// verify: one streaming pass per logits row gives its max, argmax and bad-row flag and, for
// rows of rule-2 proposals with T > 0 up to the first rejection, the target distribution's
// kept set and mass (rows.cpp); then per proposal the flags, the acceptance chain (q read only
// at q[i][x[i]]) and the extra token, which reads the one row it is drawn from (and its q row
// for a residual) again, in double.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "rows.h"

namespace sdcp::cpu {
namespace {

// the row loops of the instruction set chosen now (isa.h)
const IsaKernels& choose_isa() {
  switch (chosen_isa()) {
    case Isa::kAvx512: return *avx512_kernels();
    case Isa::kAvx2: return *avx2_kernels();
    default: return scalar_kernels();
  }
}

std::string cpu_capability() { return choose_isa().name; }

// Threads over proposals, each computing its rows as far as it needs them, when there are
// enough proposals to keep the threads busy; otherwise every row first, threads over rows.
// SDCP_NATIVE_SCHEDULE=rows or =proposals forces one (the tests run both).
bool by_proposal(int64_t proposals) {
  const char* force = std::getenv("SDCP_NATIVE_SCHEDULE");
  if (force && std::strcmp(force, "rows") == 0) return false;
  if (force && std::strcmp(force, "proposals") == 0) return true;
  const int64_t threads = at::get_num_threads();
  return threads == 1 || proposals >= 2 * threads;
}

DType dtype_of(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBf16;
    case at::kHalf: return DType::kF16;
    default: TORCH_CHECK_VALUE(false, "logits must be fp32, bf16 or fp16, got ", logits.scalar_type());
  }
}

size_t element_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

void check_logits(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, V], got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) >= 1 && logits.size(1) < (int64_t(1) << 31) - 2,
                    "logits must have 1 <= V < 2^31 - 2, got ", logits.size(1));
  dtype_of(logits);
}

at::Tensor vector_arg(const at::Tensor& t, const char* name, int64_t n, at::ScalarType type) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 &&
                        t.size(0) == n,
                    name, " must be a CPU ", type, " tensor of shape [", n, "], got ",
                    t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

struct Rows {  // the logits as RowViews
  DType dt;
  const char* base;
  int64_t V;
  RowView operator[](int64_t r) const {
    return RowView{dt, base + size_t(r) * size_t(V) * element_size(dt), V};
  }
};

// The batch as raw arrays (B proposals, N draft tokens, Q q rows), each of the length
// `dispatch.verify` documents: checked by verify_cpu, or laid out by verify_packed_cpu.
struct BatchArrays {
  const int64_t *tok, *nd, *rule, *temp, *topk, *topp, *qs, *rs, *ts;
  const double *au, *eu;
  const float* q;  // nullptr when Q = 0
  int64_t B, N, Q;
};

// q as the op reads it: a contiguous CPU fp32 [Q, V] tensor (undefined when absent)
at::Tensor checked_q(const std::optional<at::Tensor>& q_in, int64_t V) {
  if (!q_in.has_value() || !q_in->defined()) return at::Tensor();
  TORCH_CHECK_VALUE(q_in->device().is_cpu() && q_in->scalar_type() == at::kFloat &&
                        q_in->dim() == 2 && q_in->size(1) == V,
                    "q must be a CPU fp32 tensor [Q, ", V, "], got ", q_in->scalar_type(), " ",
                    q_in->sizes());
  return q_in->contiguous();
}

// The op itself over checked logits (contiguous) and the batch's arrays: each proposal's
// accepted count, extra token and flags written to the outputs (Flag: bool for verify's
// tensors, int64_t for verify_packed's rows).
template <typename Flag>
void verify_arrays(const at::Tensor& logits, const BatchArrays& in, int64_t* acc_out,
                   int64_t* extra_out, Flag* bad_q_out, Flag* nan_out) {
  const int64_t R = logits.size(0), V = logits.size(1);
  const int64_t B = in.B, N = in.N, Q = in.Q;
  const int64_t *tok = in.tok, *nd = in.nd, *rule = in.rule, *temp = in.temp, *topk = in.topk,
                *topp = in.topp, *qs = in.qs, *rs = in.rs, *ts = in.ts;
  const double *au = in.au, *eu = in.eu;
  const float* q = in.q;

  // every index is checked before any row is read: a bad batch is an error, never a bad read
  std::vector<int64_t> owner(static_cast<size_t>(R), -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t M = nd[b];
    TORCH_CHECK_VALUE(M >= 1, "proposal ", b, ": num_draft must be >= 1, got ", M);
    TORCH_CHECK_VALUE(rs[b] >= 0 && rs[b] <= R - M - 1, "proposal ", b, ": logits rows ", rs[b],
                      "..", rs[b] + M, " not in 0..", R - 1);
    TORCH_CHECK_VALUE(ts[b] >= 0 && ts[b] <= N - M, "proposal ", b, ": draft tokens ", ts[b],
                      "..", ts[b] + M - 1, " not in 0..", N - 1);
    TORCH_CHECK_VALUE(rule[b] == 1 || rule[b] == 2, "proposal ", b, ": rule must be 1 or 2");
    TORCH_CHECK_VALUE(temp[b] >= 0 && topk[b] >= 0 && topp[b] >= 0 && topp[b] <= 1000,
                      "proposal ", b, ": bad sampling profile");
    for (int64_t i = 0; i < M; ++i) {
      TORCH_CHECK_VALUE(tok[ts[b] + i] >= 0 && tok[ts[b] + i] < V, "proposal ", b,
                        ": draft token ", tok[ts[b] + i], " out of range 0..", V - 1);
    }
    if (rule[b] == 2) {
      TORCH_CHECK_VALUE(q != nullptr && qs[b] >= 0 && qs[b] <= Q - M, "proposal ", b,
                        ": q rows ", qs[b], "..", qs[b] + M - 1, " not in q (", Q, " rows)");
    }
    for (int64_t r = rs[b]; r <= rs[b] + M; ++r) {
      TORCH_CHECK_VALUE(owner[size_t(r)] < 0, "proposals ", owner[size_t(r)], " and ", b,
                        " share logits row ", r);
      owner[size_t(r)] = b;
    }
  }

  const IsaKernels& isa = choose_isa();
  const Rows rows{dtype_of(logits), static_cast<const char*>(logits.data_ptr()), V};
  const auto profile = [&](int64_t b) { return Profile{temp[b], topk[b], topp[b]}; };
  const auto filtered = [&](int64_t b) {
    return (topk[b] > 0 && topk[b] < V) || topp[b] < 1000;
  };
  // a row's stat, computed once: level 1 = max, argmax, bad flag; level 2 = the target
  // distribution too (rows.h)
  std::vector<RowStat> stats(static_cast<size_t>(R));
  std::vector<uint8_t> level(static_cast<size_t>(R), 0);
  const auto stat = [&](int64_t r, bool full) -> RowStat& {
    const uint8_t want = full ? 2 : 1;
    if (level[size_t(r)] < want) {
      stats[size_t(r)] = RowStat{};
      compute_row_stat(rows[r], profile(owner[size_t(r)]), full, isa, stats[size_t(r)]);
      level[size_t(r)] = want;
    }
    return stats[size_t(r)];
  };

  if (!by_proposal(B)) {
    // few proposals for the threads: every row up front, threads over rows
    const int64_t row_grain = std::max<int64_t>(1, (int64_t(1) << 16) / V);
    parallel_for(0, R, row_grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = owner[size_t(r)];
        if (b >= 0) stat(r, rule[b] == 2 && temp[b] > 0);
      }
    });
  }

  // Threads over proposals. Rows not computed yet are computed here, as far as needed: the
  // target distribution only up to the first rejection, the bad-row flag for the rest.
  parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t M = nd[b], r0 = rs[b], t0 = ts[b];
      const bool r2 = rule[b] == 2, soft = r2 && temp[b] > 0;
      const auto qx = [&](int64_t i) { return double(q[(qs[b] + i) * V + tok[t0 + i]]); };
      bool bq = false;
      if (r2) {
        for (int64_t i = 0; i < M; ++i) bq = bq || !(qx(i) > 0.0 && qx(i) < INFINITY);
      }
      int64_t a = 0;
      bool nan = false;
      if (soft && !bq) {  // the acceptance chain reads p(x) at rows 0..a
        for (; a < M; ++a) {
          RowStat& st = stat(r0 + a, true);
          if (st.bad) {
            nan = true;
            break;
          }
          if (!accept_token(rows[r0 + a], st, tok[t0 + a], qx(a), au[t0 + a], isa)) break;
        }
      }
      // the draw row (a = M when all are accepted): its kept set when filtered; without
      // filters the draw sums its mass itself
      if (soft && !bq && !nan && a == M) nan = stat(r0 + M, filtered(b)).bad;
      for (int64_t i = 0; i <= M && !nan; ++i) nan = stat(r0 + i, false).bad;
      nan_out[b] = nan;
      bad_q_out[b] = bq;
      if (nan || bq) {  // refuse: nothing is drawn
        acc_out[b] = 0;
        extra_out[b] = -1;
        continue;
      }
      if (!soft) {  // p is one-hot on the argmax
        for (; a < M; ++a) {
          const bool on_arg = tok[t0 + a] == stats[size_t(r0 + a)].arg;
          if (!(r2 ? au[t0 + a] < std::min(1.0, double(on_arg) / qx(a)) : on_arg)) break;
        }
        acc_out[b] = a;
        extra_out[b] = stats[size_t(r0 + a)].arg;  // every draw from a one-hot p or residual
        continue;
      }
      RowStat& st = stats[size_t(r0 + a)];
      const float* q_row = a < M ? q + (qs[b] + a) * V : nullptr;
      acc_out[b] = a;
      extra_out[b] = draw_token(rows[r0 + a], st, q_row, eu[r0 + a], isa);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_cpu(
    const at::Tensor& logits_in, const at::Tensor& draft_tokens_in,
    const at::Tensor& num_draft_in, const at::Tensor& rule_in,
    const at::Tensor& temperature_in, const at::Tensor& top_k_in, const at::Tensor& top_p_in,
    const std::optional<at::Tensor>& q_in, const at::Tensor& q_start_in,
    const at::Tensor& accept_u_in, const at::Tensor& extra_u_in, const at::Tensor& row_start_in,
    const at::Tensor& token_start_in) {
  check_logits(logits_in);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  const int64_t B = num_draft_in.dim() == 1 ? num_draft_in.size(0) : -1;
  TORCH_CHECK_VALUE(B >= 0, "num_draft must be [B]");
  const int64_t N = draft_tokens_in.dim() == 1 ? draft_tokens_in.size(0) : -1;
  TORCH_CHECK_VALUE(N >= 0, "draft_tokens must be [N]");
  const at::Tensor tokens_t = vector_arg(draft_tokens_in, "draft_tokens", N, at::kLong);
  const at::Tensor nd_t = vector_arg(num_draft_in, "num_draft", B, at::kLong);
  const at::Tensor rule_t = vector_arg(rule_in, "rule", B, at::kLong);
  const at::Tensor temp_t = vector_arg(temperature_in, "temperature_milli", B, at::kLong);
  const at::Tensor topk_t = vector_arg(top_k_in, "top_k", B, at::kLong);
  const at::Tensor topp_t = vector_arg(top_p_in, "top_p_milli", B, at::kLong);
  const at::Tensor qs_t = vector_arg(q_start_in, "q_start", B, at::kLong);
  const at::Tensor rs_t = vector_arg(row_start_in, "row_start", B, at::kLong);
  const at::Tensor ts_t = vector_arg(token_start_in, "token_start", B, at::kLong);
  const at::Tensor au_t = vector_arg(accept_u_in, "accept_uniforms", N, at::kDouble);
  const at::Tensor eu_t = vector_arg(extra_u_in, "extra_uniforms", R, at::kDouble);
  const at::Tensor q_t = checked_q(q_in, V);
  const int64_t Q = q_t.defined() ? q_t.size(0) : 0;
  const int64_t* tok = tokens_t.data_ptr<int64_t>();
  const int64_t* nd = nd_t.data_ptr<int64_t>();
  const int64_t* rule = rule_t.data_ptr<int64_t>();
  const int64_t* temp = temp_t.data_ptr<int64_t>();
  const int64_t* topk = topk_t.data_ptr<int64_t>();
  const int64_t* topp = topp_t.data_ptr<int64_t>();
  const int64_t* qs = qs_t.data_ptr<int64_t>();
  const int64_t* rs = rs_t.data_ptr<int64_t>();
  const int64_t* ts = ts_t.data_ptr<int64_t>();
  const double* au = au_t.data_ptr<double>();
  const double* eu = eu_t.data_ptr<double>();
  const float* q = Q > 0 ? q_t.data_ptr<float>() : nullptr;

  at::Tensor accepted = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor extra = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor bad_q = at::empty({B}, logits.options().dtype(at::kBool));
  at::Tensor nan_logits = at::empty({B}, logits.options().dtype(at::kBool));
  int64_t* acc_out = accepted.data_ptr<int64_t>();
  int64_t* extra_out = extra.data_ptr<int64_t>();
  bool* bad_q_out = bad_q.data_ptr<bool>();
  bool* nan_out = nan_logits.data_ptr<bool>();
  verify_arrays(logits, BatchArrays{tok, nd, rule, temp, topk, topp, qs, rs, ts, au, eu, q, B, N, Q},
                acc_out, extra_out, bad_q_out, nan_out);
  return {accepted, extra, bad_q, nan_logits};
}

// verify on PackedBatch's buffers (kernels/batch.py): ints = num_draft, rule,
// temperature_milli, top_k, top_p_milli, q_start, row_start, token_start ([B] each), then
// draft_tokens [N]; floats = accept_uniforms [N], then extra_uniforms [R]. The arrays are read
// where they lie and the four results are written as the rows of one tensor: at a batch of
// one, thirteen views made in Python and four results read back one by one cost more host
// time than the verify itself. Every check of verify_cpu applies.
at::Tensor verify_packed_cpu(const at::Tensor& logits_in, const at::Tensor& ints_in,
                             const at::Tensor& floats_in, const std::optional<at::Tensor>& q_in,
                             int64_t B) {
  check_logits(logits_in);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK_VALUE(ints_in.device().is_cpu() && ints_in.scalar_type() == at::kLong &&
                        ints_in.dim() == 1,
                    "ints must be a CPU int64 tensor [8B + N], got ", ints_in.scalar_type(), " ",
                    ints_in.sizes());
  TORCH_CHECK_VALUE(B >= 0 && ints_in.size(0) >= 8 * B, "ints must hold 8 fields of ", B,
                    " proposals, then the draft tokens; got ", ints_in.size(0), " values");
  const int64_t N = ints_in.size(0) - 8 * B;
  TORCH_CHECK_VALUE(floats_in.device().is_cpu() && floats_in.scalar_type() == at::kDouble &&
                        floats_in.dim() == 1 && floats_in.size(0) == N + R,
                    "floats must be a CPU float64 tensor [N + R] = [", N + R, "], got ",
                    floats_in.scalar_type(), " ", floats_in.sizes());
  const at::Tensor ints = ints_in.contiguous(), floats = floats_in.contiguous();
  const at::Tensor q_t = checked_q(q_in, V);
  const int64_t Q = q_t.defined() ? q_t.size(0) : 0;
  const int64_t* f = ints.data_ptr<int64_t>();
  const double* u = floats.data_ptr<double>();
  at::Tensor out = at::empty({4, B}, ints.options());
  int64_t* o = out.data_ptr<int64_t>();
  verify_arrays(logits,
                BatchArrays{f + 8 * B, f, f + B, f + 2 * B, f + 3 * B, f + 4 * B, f + 5 * B,
                            f + 6 * B, f + 7 * B, u, u + N,
                            Q > 0 ? q_t.data_ptr<float>() : nullptr, B, N, Q},
                o, o + B, o + 2 * B, o + 3 * B);
  return out;
}


at::Tensor target_probs_cpu(const at::Tensor& logits_in, const at::Tensor& temperature_in,
                            const at::Tensor& top_k_in, const at::Tensor& top_p_in) {
  check_logits(logits_in);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  const at::Tensor temp_t = vector_arg(temperature_in, "temperature_milli", R, at::kLong);
  const at::Tensor topk_t = vector_arg(top_k_in, "top_k", R, at::kLong);
  const at::Tensor topp_t = vector_arg(top_p_in, "top_p_milli", R, at::kLong);
  const int64_t* temp = temp_t.data_ptr<int64_t>();
  const int64_t* topk = topk_t.data_ptr<int64_t>();
  const int64_t* topp = topp_t.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_VALUE(temp[r] >= 0 && topk[r] >= 0 && topp[r] >= 0 && topp[r] <= 1000,
                      "row ", r, ": bad sampling profile");
  }
  const IsaKernels& isa = choose_isa();
  const Rows rows{dtype_of(logits), static_cast<const char*>(logits.data_ptr()), V};
  at::Tensor out = at::empty({R, V}, logits.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const int64_t row_grain = std::max<int64_t>(1, (int64_t(1) << 16) / V);
  parallel_for(0, R, row_grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      RowStat st;
      compute_row_stat(rows[r], Profile{temp[r], topk[r], topp[r]}, true, isa, st);
      write_probs(rows[r], st, isa, dst + r * V);
    }
  });
  return out;
}

}  // namespace
}  // namespace sdcp::cpu

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("verify", &sdcp::cpu::verify_cpu);
  m.impl("verify_packed", &sdcp::cpu::verify_packed_cpu);
  m.impl("target_probs", &sdcp::cpu::target_probs_cpu);
}

TORCH_LIBRARY_FRAGMENT(sdcp, m) {
  m.def("cpu_capability() -> str", &sdcp::cpu::cpu_capability);
}
