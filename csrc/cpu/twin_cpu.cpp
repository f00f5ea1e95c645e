// The twin decoder: a Llama forward (SmolLM2's architecture: RMSNorm, rotary positions on
// adjacent pairs as llama.cpp lays out q/k, grouped-query attention, SiLU-gated MLP, tied or
// untied output head) over int8 weights with fp32 scales, fp32 activations, and a K/V cache
// per session in fp32 buffers that Python owns (sdcp_fast/models/twin.py).
//
// One `forward` call advances any number of sessions by any number of tokens each (a prompt's
// prefill, one drafted token for each of 8 sessions, a proposal to score): every token of the
// call goes through each weight matrix together, so each weight row is read from memory once
// per call, and a step for 4 sessions costs far less than 4 steps for one. Threads split the
// output rows of every matrix (and the (token, K/V head) pairs of attention) with
// parallel_for (parallel.h), at most `threads` at a time; 1 runs in the calling thread.
//
// Python reaches it as torch.classes.sdcp.TwinModel (twin.py documents the tensors).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "twin.h"

namespace sdcp::cpu {
namespace {

const TwinLoops& choose_twin_loops() {
  switch (chosen_isa()) {
    case Isa::kAvx512: return *twin_avx512_loops();
    case Isa::kAvx2: return *twin_avx2_loops();
    default: return twin_scalar_loops();
  }
}

// sum_i W[o, i] for every row of an int8 matrix (matmul_q8's correction for the +128 of the
// activations)
std::vector<int32_t> row_sums_of(const int8_t* w, int64_t rows, int64_t cols) {
  std::vector<int32_t> sums(static_cast<size_t>(rows));
  for (int64_t o = 0; o < rows; ++o) {
    int32_t t = 0;
    for (int64_t i = 0; i < cols; ++i) t += w[o * cols + i];
    sums[size_t(o)] = t;
  }
  return sums;
}

struct Layer {
  const float* attn_norm;
  const float* ffn_norm;
  QMatrix qkv, out, gate_up, down;
};

int64_t divide_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// parallel_for (parallel.h) over [0, n) in at most `threads` chunks (1: inline, in this thread)
template <class F>
void split(int64_t n, int64_t threads, const F& body) {
  if (n <= 0) return;
  parallel_for(0, n, divide_up(n, std::max<int64_t>(threads, 1)), body);
}

}  // namespace

void quantise_rows(const float* X, int64_t n, int64_t cols, int64_t x_stride, uint8_t* Xq,
                   int64_t xq_stride, float* x_scale) {
  for (int64_t r = 0; r < n; ++r) {
    const float* x = X + r * x_stride;
    uint8_t* q = Xq + r * xq_stride;
    float most = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < cols; ++i) {
      finite = finite && std::isfinite(x[i]);
      most = std::max(most, std::fabs(x[i]));
    }
    if (!finite || most == 0.0f) {  // NaN for a row that had one: the products carry it on
      x_scale[r] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      std::fill_n(q, cols, uint8_t(128));
      continue;
    }
    const float inv = 127.0f / most;
    x_scale[r] = most / 127.0f;
    for (int64_t i = 0; i < cols; ++i) q[i] = uint8_t(int(std::nearbyint(x[i] * inv)) + 128);
  }
}

class TwinModel : public torch::CustomClassHolder {
 public:
  // dims: [n_layer, d_model, n_head, n_kv_head, head_dim, d_ff, vocab, tied (0/1)]
  // params: [rope_theta, norm_eps]
  // tensors: token embedding int8 [V, D] and its scales fp32 [V, groups], output norm [D],
  //   (untied: output int8 [V, D] and scales), then per layer: attn_norm [D], qkv int8
  //   [(H + 2 Hkv) Dh, D] + scales, out int8 [D, H Dh] + scales, ffn_norm [D], gate_up int8
  //   [2 F, D] + scales (gate rows first), down int8 [D, F] + scales.
  TwinModel(std::vector<int64_t> dims, std::vector<double> params, std::vector<at::Tensor> tensors)
      : tensors_(std::move(tensors)) {
    TORCH_CHECK_VALUE(dims.size() == 8 && params.size() == 2, "TwinModel: dims[8], params[2]");
    n_layer_ = dims[0], d_ = dims[1], n_head_ = dims[2], n_kv_ = dims[3], dh_ = dims[4];
    d_ff_ = dims[5], vocab_ = dims[6];
    const bool tied = tied_ = dims[7] != 0;
    theta_ = params[0], eps_ = float(params[1]);
    TORCH_CHECK_VALUE(n_layer_ >= 1 && n_head_ >= 1 && n_kv_ >= 1 && n_head_ % n_kv_ == 0 &&
                          n_head_ / n_kv_ <= 64 && vocab_ >= 1,
                      "TwinModel: bad head counts or sizes");
    TORCH_CHECK_VALUE(d_ % kTwinCols == 0 && d_ff_ % kTwinCols == 0 &&
                          (n_head_ * dh_) % kTwinCols == 0 && dh_ % kTwinHead == 0,
                      "TwinModel: d_model, d_ff and heads x head_dim must be multiples of ",
                      kTwinCols, ", head_dim of ", kTwinHead);
    const size_t want = 3 + (tied ? 0 : 2) + 10 * size_t(n_layer_);
    TORCH_CHECK_VALUE(tensors_.size() == want, "TwinModel: ", want, " tensors expected, got ",
                      tensors_.size());
    size_t next = 0;
    embed_ = matrix(next, vocab_, d_, "token embedding");
    out_norm_ = vec(next, d_, "output norm");
    head_ = tied ? embed_ : matrix(next, vocab_, d_, "output");
    const int64_t qkv_rows = (n_head_ + 2 * n_kv_) * dh_;
    for (int64_t l = 0; l < n_layer_; ++l) {
      Layer L;
      L.attn_norm = vec(next, d_, "attn_norm");
      L.qkv = matrix(next, qkv_rows, d_, "qkv");
      L.out = matrix(next, d_, n_head_ * dh_, "attn_output");
      L.ffn_norm = vec(next, d_, "ffn_norm");
      L.gate_up = matrix(next, 2 * d_ff_, d_, "gate_up");
      L.down = matrix(next, d_, d_ff_, "down");
      layers_.push_back(L);
    }
    // the rotary frequencies as transformers computes them (float): theta^-(2i / Dh)
    for (int64_t i = 0; i < dh_ / 2; ++i) {
      inv_freq_.push_back(1.0f / float(std::pow(theta_, double(float(2 * i) / float(dh_)))));
    }
  }

  std::string isa() const { return choose_twin_loops().name; }

  // Every product over 8-bit activations (twin.h, matmul_q8) from now on, where the loops in
  // use have them and every matrix has one scale a row: true if so. false: fp32 activations
  // (the default, and what a call under loops without them runs). Not to be called while a
  // forward runs.
  bool use_int8_activations(bool on) {
    q8_ = false;
    if (!on || choose_twin_loops().matmul_q8 == nullptr) return false;
    std::vector<QMatrix*> all = {&embed_, &head_};
    for (Layer& L : layers_) all.insert(all.end(), {&L.qkv, &L.out, &L.gate_up, &L.down});
    for (const QMatrix* m : all) {
      if (m->groups != 1) return false;
    }
    if (row_sums_.empty()) {
      for (QMatrix* m : all) {
        if (m == &head_ && tied_) continue;
        row_sums_.push_back(row_sums_of(m->w, m->rows, m->cols));
        m->row_sums = row_sums_.back().data();
      }
      if (tied_) head_.row_sums = embed_.row_sums;
    }
    q8_ = true;
    return true;
  }

  // tokens [N] int64: each session's new tokens, sessions one after another; counts [B],
  // pasts [B] int64: how many tokens session b adds and how many its cache holds already
  // (its new tokens sit at positions pasts[b]..); caches: B fp32 [n_layer, 2, n_kv_head,
  // capacity, head_dim] buffers (K then V), written at the new positions; rows [R] int64:
  // the tokens (indices into `tokens`) whose next-token logits come back -> fp32 [R, vocab].
  at::Tensor forward(const at::Tensor& tokens_in, const at::Tensor& counts_in,
                     const at::Tensor& pasts_in, std::vector<at::Tensor> caches,
                     const at::Tensor& rows_in, int64_t threads) const {
    const at::Tensor tokens = index_vector(tokens_in, "tokens");
    const at::Tensor counts = index_vector(counts_in, "counts");
    const at::Tensor pasts = index_vector(pasts_in, "pasts");
    const at::Tensor rows = index_vector(rows_in, "rows");
    const int64_t N = tokens.size(0), B = counts.size(0), R = rows.size(0);
    TORCH_CHECK_VALUE(pasts.size(0) == B && int64_t(caches.size()) == B,
                      "counts, pasts and caches must all have one entry per session");
    TORCH_CHECK_VALUE(threads >= 1, "threads must be >= 1");
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* cnt = counts.data_ptr<int64_t>();
    const int64_t* past = pasts.data_ptr<int64_t>();
    const int64_t* row = rows.data_ptr<int64_t>();
    // every index is checked before anything is read or written
    std::vector<int64_t> session(static_cast<size_t>(N)), pos(static_cast<size_t>(N));
    std::vector<float*> cache(static_cast<size_t>(B));
    std::vector<int64_t> capacity(static_cast<size_t>(B));
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(cnt[b] >= 1 && past[b] >= 0 && n + cnt[b] <= N, "session ", b,
                        ": bad count ", cnt[b], " or past ", past[b]);
      const at::Tensor& c = caches[size_t(b)];
      TORCH_CHECK_VALUE(c.device().is_cpu() && c.scalar_type() == at::kFloat &&
                            c.is_contiguous() && c.dim() == 5 && c.size(0) == n_layer_ &&
                            c.size(1) == 2 && c.size(2) == n_kv_ && c.size(4) == dh_,
                        "session ", b, ": the cache must be a contiguous fp32 tensor [", n_layer_,
                        ", 2, ", n_kv_, ", capacity, ", dh_, "], got ", c.scalar_type(), " ",
                        c.sizes());
      TORCH_CHECK_VALUE(past[b] + cnt[b] <= c.size(3), "session ", b, ": ", past[b] + cnt[b],
                        " positions do not fit its cache of ", c.size(3));
      cache[size_t(b)] = c.data_ptr<float>();
      capacity[size_t(b)] = c.size(3);
      for (int64_t j = 0; j < cnt[b]; ++j, ++n) {
        TORCH_CHECK_VALUE(tok[n] >= 0 && tok[n] < vocab_, "token ", tok[n], " outside [0, ",
                          vocab_, ")");
        session[size_t(n)] = b;
        pos[size_t(n)] = past[b] + j;
      }
    }
    TORCH_CHECK_VALUE(n == N, "counts add up to ", n, ", not to the ", N, " tokens");
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK_VALUE(row[r] >= 0 && row[r] < N, "row ", row[r], " outside [0, ", N, ")");
    }
    at::Tensor logits = at::empty({R, vocab_}, tokens.options().dtype(at::kFloat));
    if (N == 0) return logits;

    const TwinLoops& k = choose_twin_loops();
    const int64_t D = d_, F = d_ff_, H = n_head_, Hkv = n_kv_, Dh = dh_, G = H / Hkv;
    const int64_t QKV = (H + 2 * Hkv) * Dh;
    std::vector<float> x(static_cast<size_t>(N * D)), h(static_cast<size_t>(N * D)), tmp(static_cast<size_t>(N * D));
    std::vector<float> qkv(static_cast<size_t>(N * QKV)), att(static_cast<size_t>(N * H * Dh));
    std::vector<float> gu(static_cast<size_t>(N * 2 * F)), act(static_cast<size_t>(N * F));

    for (int64_t t = 0; t < N; ++t) embed_row(tok[t], x.data() + t * D);
    // cos and sin of every token's rotary angles, shared by all layers and heads
    const int64_t half = Dh / 2;
    std::vector<float> cos_t(static_cast<size_t>(N * half)), sin_t(static_cast<size_t>(N * half));
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = float(pos[size_t(t)]) * inv_freq_[size_t(i)];
        cos_t[size_t(t * half + i)] = float(std::cos(double(angle)));
        sin_t[size_t(t * half + i)] = float(std::sin(double(angle)));
      }
    }
    const int64_t max_pos = *std::max_element(pos.begin(), pos.end()) + 1;
    const float scale = 1.0f / std::sqrt(float(Dh));

    for (int64_t l = 0; l < n_layer_; ++l) {
      const Layer& L = layers_[size_t(l)];
      rms_norm(x.data(), N, L.attn_norm, h.data());
      matmul(k, h.data(), N, L.qkv, qkv.data(), threads);
      for (int64_t t = 0; t < N; ++t) {
        float* q = qkv.data() + t * QKV;
        for (int64_t hd = 0; hd < H + Hkv; ++hd) {  // q heads, then k heads
          rotate(q + hd * Dh, cos_t.data() + t * half, sin_t.data() + t * half);
        }
        // this token's K and V into its session's cache, before any token attends to them
        const size_t b = size_t(session[size_t(t)]);
        for (int64_t j = 0; j < Hkv; ++j) {
          for (int64_t kv = 0; kv < 2; ++kv) {
            float* dst = cache[b] + (((l * 2 + kv) * Hkv + j) * capacity[b] + pos[size_t(t)]) * Dh;
            std::copy_n(q + (H + kv * Hkv + j) * Dh, Dh, dst);
          }
        }
      }
      split(N * Hkv, threads, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<size_t>(G * max_pos));
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = task / Hkv, j = task % Hkv;
          const size_t b = size_t(session[size_t(t)]);
          const float* K = cache[b] + ((l * 2 + 0) * Hkv + j) * capacity[b] * Dh;
          const float* V = cache[b] + ((l * 2 + 1) * Hkv + j) * capacity[b] * Dh;
          k.attend(qkv.data() + t * QKV + j * G * Dh, G, K, V, pos[size_t(t)] + 1, Dh, nullptr, 1,
                   Dh, scale, scores.data(), att.data() + t * H * Dh + j * G * Dh);
        }
      });
      matmul(k, att.data(), N, L.out, tmp.data(), threads);
      for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
      rms_norm(x.data(), N, L.ffn_norm, h.data());
      matmul(k, h.data(), N, L.gate_up, gu.data(), threads);
      for (int64_t t = 0; t < N; ++t) {
        k.silu_mul(gu.data() + t * 2 * F, gu.data() + t * 2 * F + F, act.data() + t * F, F);
      }
      matmul(k, act.data(), N, L.down, tmp.data(), threads);
      for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
    }
    // the output head only for the rows asked for (a prompt's prefill asks for one)
    std::vector<float> last(static_cast<size_t>(std::max<int64_t>(R, 1) * D));
    for (int64_t r = 0; r < R; ++r) rms_norm(x.data() + row[r] * D, 1, out_norm_, last.data() + r * D);
    if (R > 0) matmul(k, last.data(), R, head_, logits.data_ptr<float>(), threads);
    return logits;
  }

 private:
  std::vector<at::Tensor> tensors_;  // keeps every weight alive (they may map a file)
  int64_t n_layer_, d_, n_head_, n_kv_, dh_, d_ff_, vocab_;
  bool tied_ = false;
  bool q8_ = false;  // use_int8_activations
  std::vector<std::vector<int32_t>> row_sums_;  // the matrices' QMatrix::row_sums
  double theta_;
  float eps_;
  QMatrix embed_, head_;
  const float* out_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;

  static at::Tensor index_vector(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1, name,
                      " must be a 1-D CPU int64 tensor, got ", t.scalar_type(), " ", t.sizes());
    return t.contiguous();
  }

  const at::Tensor& take(size_t& next, at::ScalarType type, std::vector<int64_t> shape,
                         const char* what) {
    const at::Tensor& t = tensors_[next++];
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
                          t.sizes().vec() == shape,
                      "TwinModel: ", what, " must be a contiguous CPU ", type, " tensor ", shape,
                      ", got ", t.scalar_type(), " ", t.sizes());
    return t;
  }

  const float* vec(size_t& next, int64_t n, const char* what) {
    return take(next, at::kFloat, {n}, what).data_ptr<float>();
  }

  QMatrix matrix(size_t& next, int64_t rows, int64_t cols, const char* what) {
    QMatrix m;
    m.w = take(next, at::kChar, {rows, cols}, what).data_ptr<int8_t>();
    const at::Tensor& s = tensors_[next];
    const int64_t groups = s.dim() == 2 ? s.size(1) : 0;
    TORCH_CHECK_VALUE(groups >= 1 && cols % groups == 0 &&
                          (groups == 1 || (cols / groups) % kTwinCols == 0),
                      "TwinModel: ", what, " scales must be [rows, groups] with groups 1 or "
                      "groups of a multiple of ", kTwinCols, " columns, got ", s.sizes());
    m.s = take(next, at::kFloat, {rows, groups}, what).data_ptr<float>();
    m.rows = rows, m.cols = cols, m.groups = groups;
    return m;
  }

  void embed_row(int64_t token, float* out) const {
    const int8_t* w = embed_.w + token * d_;
    const float* s = embed_.s + token * embed_.groups;
    const int64_t group = d_ / embed_.groups;
    for (int64_t i = 0; i < d_; ++i) out[i] = float(w[i]) * s[i / group];
  }

  // out = x / sqrt(mean(x^2) + eps) * weight, row by row (as transformers' LlamaRMSNorm in fp32)
  void rms_norm(const float* x, int64_t n, const float* weight, float* out) const {
    for (int64_t t = 0; t < n; ++t) {
      const float* xr = x + t * d_;
      float ss = 0.0f;
      for (int64_t i = 0; i < d_; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / float(d_) + eps_);
      for (int64_t i = 0; i < d_; ++i) out[t * d_ + i] = weight[i] * (xr[i] * inv);
    }
  }

  // one head's rotary embedding: pairs (2i, 2i + 1) turned by angle i (llama.cpp's layout)
  void rotate(float* v, const float* c, const float* s) const {
    for (int64_t i = 0; i < dh_ / 2; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = a * c[i] - b * s[i];
      v[2 * i + 1] = a * s[i] + b * c[i];
    }
  }

  // Y [n, m.rows] = X [n, m.cols] W^T, threads over blocks of output rows; over 8-bit
  // activations where use_int8_activations turned them on and the loops have them
  void matmul(const TwinLoops& k, const float* X, int64_t n, const QMatrix& m, float* Y,
              int64_t threads) const {
    constexpr int64_t kRowsPerTask = 64;
    if (q8_ && k.matmul_q8 != nullptr && m.row_sums != nullptr) {
      std::vector<uint8_t> xq(static_cast<size_t>(n * m.cols));
      std::vector<float> scale(static_cast<size_t>(n));
      quantise_rows(X, n, m.cols, m.cols, xq.data(), m.cols, scale.data());
      split(divide_up(m.rows, kRowsPerTask), threads, [&](int64_t begin, int64_t end) {
        k.matmul_q8(xq.data(), scale.data(), n, m.cols, m, begin * kRowsPerTask,
                    std::min(end * kRowsPerTask, m.rows), Y, m.rows);
      });
      return;
    }
    split(divide_up(m.rows, kRowsPerTask), threads, [&](int64_t begin, int64_t end) {
      k.matmul(X, n, m.cols, m, begin * kRowsPerTask, std::min(end * kRowsPerTask, m.rows), Y,
               m.rows);
    });
  }
};

// y [n, out] = x [n, in] W^T for an fp32 weight W [out, in] as torch keeps it (a linear layer
// without its bias): the twin's register tiles over fp32 weights, every weight row read from
// memory once per call for up to 8 rows of x, threads (the calling thread's torch threads) over
// blocks of output rows. For a few rows against a large weight (a verify pass of M + 1 tokens,
// a decode step of a few sessions) the BLAS's matrix-matrix path can cost far more than its
// matrix-vector path does for one row; sdcp_fast/models/linear_forms.py measures, pass by pass,
// whether this or the BLAS is faster on the machine at hand.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "rows_linear: CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                    "rows_linear: fp32 tensors only, got ", x.scalar_type(), " and ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
                    "rows_linear: x [n, in] and weight [out, in] expected, got ", x.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous() && weight.is_contiguous(), "rows_linear: contiguous tensors only");
  TORCH_CHECK_VALUE(weight.size(1) % kTwinCols == 0, "rows_linear: in must be a multiple of ", kTwinCols);
  const int64_t n = x.size(0), out = weight.size(0), in = weight.size(1);
  at::Tensor y = at::empty({n, out}, x.options());
  if (n == 0 || out == 0) return y;
  const TwinLoops& k = choose_twin_loops();
  const FMatrix m{weight.data_ptr<float>(), out, in};
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  constexpr int64_t kRowsPerTask = 64;
  split(divide_up(out, kRowsPerTask), at::get_num_threads(), [&](int64_t begin, int64_t end) {
    k.matmul_f32(X, n, in, m, begin * kRowsPerTask, std::min(end * kRowsPerTask, out), Y, out);
  });
  return y;
}

// y [n, out] = x [n, in] W^T for an int8 W with one fp32 scale a row, over x quantised to 8
// bits a row (twin.h: quantise_rows, matmul_q8): the twin's products under
// use_int8_activations, alone, for their tests (kernels/native.py, q8_linear_reference).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu() &&
                        x.is_contiguous() && weight.is_contiguous() && scale.is_contiguous(),
                    "q8_linear: contiguous CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                        scale.scalar_type() == at::kFloat,
                    "q8_linear: fp32 x, int8 weight and fp32 scale expected");
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && scale.dim() == 1 &&
                        x.size(1) == weight.size(1) && scale.size(0) == weight.size(0) &&
                        weight.size(1) % kTwinCols == 0,
                    "q8_linear: x [n, in], weight [out, in] and scale [out] with in a multiple of ",
                    kTwinCols, " expected, got ", x.sizes(), ", ", weight.sizes(), ", ", scale.sizes());
  const TwinLoops& k = choose_twin_loops();
  TORCH_CHECK_VALUE(k.matmul_q8 != nullptr, "q8_linear: the ", k.name,
                    " loops have no 8-bit dot products on this CPU");
  const int64_t n = x.size(0), out = weight.size(0), in = weight.size(1);
  at::Tensor y = at::empty({n, out}, x.options());
  if (n == 0 || out == 0) return y;
  const std::vector<int32_t> sums = row_sums_of(weight.data_ptr<int8_t>(), out, in);
  QMatrix m;
  m.w = weight.data_ptr<int8_t>(), m.s = scale.data_ptr<float>(), m.rows = out, m.cols = in;
  m.row_sums = sums.data();
  std::vector<uint8_t> xq(static_cast<size_t>(n * in));
  std::vector<float> xs(static_cast<size_t>(n));
  quantise_rows(x.data_ptr<float>(), n, in, in, xq.data(), in, xs.data());
  float* Y = y.data_ptr<float>();
  constexpr int64_t kRowsPerTask = 64;
  split(divide_up(out, kRowsPerTask), at::get_num_threads(), [&](int64_t begin, int64_t end) {
    k.matmul_q8(xq.data(), xs.data(), n, in, m, begin * kRowsPerTask,
                std::min(end * kRowsPerTask, out), Y, out);
  });
  return y;
}

bool int8_dot_products() { return choose_twin_loops().matmul_q8 != nullptr; }

// Attention of packed query rows over K/V kept in pages (sdcp_fast/models/kv_pages.py: a
// layer's keys [R, kv_heads, head_dim], position p of a session at row pages[p / page] * page
// + p % page), read where they lie: the twin's attention loop with a page table, threads over
// (query, K/V head) pairs. Query i is row query_rows[i] of `query` [T, heads, head_dim]; it
// sees its session's positions 0..query_keys[i]-1, whose pages start at pages[query_pages[i]].
// Why: the library's attention needs each session's past gathered into a padded batch first,
// a copy of every key and value of every session in every layer of every pass.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& query_rows, const at::Tensor& query_keys,
                           const at::Tensor& query_pages, const at::Tensor& pages, int64_t page,
                           double scale) {
  for (const at::Tensor* t : {&query, &keys, &values, &query_rows, &query_keys, &query_pages, &pages}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->is_contiguous(),
                      "paged_attention: contiguous CPU tensors only");
  }
  TORCH_CHECK_VALUE(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                        values.scalar_type() == at::kFloat,
                    "paged_attention: fp32 query, keys and values only");
  TORCH_CHECK_VALUE(query.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(),
                    "paged_attention: query [T, heads, head_dim], keys and values [R, kv_heads, "
                    "head_dim] expected, got ", query.sizes(), ", ", keys.sizes(), ", ", values.sizes());
  const int64_t T = query.size(0), H = query.size(1), Dh = query.size(2);
  const int64_t R = keys.size(0), Hkv = keys.size(1);
  TORCH_CHECK_VALUE(keys.size(2) == Dh && Hkv >= 1 && H % Hkv == 0 && H / Hkv <= 64 &&
                        Dh % kTwinHead == 0,
                    "paged_attention: heads a multiple of kv_heads (at most 64 a K/V head) and "
                    "head_dim a multiple of ", kTwinHead, " expected, got ", query.sizes(), " and ",
                    keys.sizes());
  TORCH_CHECK_VALUE(page >= 1 && R % page == 0, "paged_attention: keys rows must be whole pages");
  for (const at::Tensor* t : {&query_rows, &query_keys, &query_pages, &pages}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->dim() == 1,
                      "paged_attention: int64 vectors expected for the indexes");
  }
  const int64_t n = query_rows.size(0), P = pages.size(0);
  TORCH_CHECK_VALUE(query_keys.size(0) == n && query_pages.size(0) == n,
                    "paged_attention: query_rows, query_keys and query_pages differ in length");
  const int64_t* rows = query_rows.data_ptr<int64_t>();
  const int64_t* counts = query_keys.data_ptr<int64_t>();
  const int64_t* first = query_pages.data_ptr<int64_t>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK_VALUE(pg[p] >= 0 && pg[p] < R / page, "paged_attention: page ", pg[p],
                      " outside the ", R / page, " pages of keys");
  }
  int64_t most = 1;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(rows[i] >= 0 && rows[i] < T, "paged_attention: query row ", rows[i],
                      " outside [0, ", T, ")");
    TORCH_CHECK_VALUE(counts[i] >= 1 && first[i] >= 0 &&
                          first[i] + divide_up(counts[i], page) <= P,
                      "paged_attention: query ", i, " sees ", counts[i], " keys from page index ",
                      first[i], ", beyond the ", P, " pages given");
    most = std::max(most, counts[i]);
  }
  at::Tensor out = at::empty({n, H, Dh}, query.options());
  if (n == 0) return out;
  const TwinLoops& k = choose_twin_loops();
  const int64_t G = H / Hkv;
  const float* Q = query.data_ptr<float>();
  const float* K = keys.data_ptr<float>();
  const float* V = values.data_ptr<float>();
  float* O = out.data_ptr<float>();
  split(n * Hkv, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * most));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / Hkv, j = task % Hkv;
      k.attend(Q + (rows[i] * H + j * G) * Dh, G, K + j * Dh, V + j * Dh, counts[i], Dh,
               pg + first[i], page, Hkv * Dh, float(scale), scores.data(), O + (i * H + j * G) * Dh);
    }
  });
  return out;
}

}  // namespace sdcp::cpu

TORCH_LIBRARY_FRAGMENT(sdcp, m) {
  m.def("rows_linear(Tensor x, Tensor weight) -> Tensor", &sdcp::cpu::rows_linear);
  m.def("q8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor", &sdcp::cpu::q8_linear);
  m.def("int8_dot_products() -> bool", &sdcp::cpu::int8_dot_products);
  m.def("paged_attention(Tensor query, Tensor keys, Tensor values, Tensor query_rows, "
        "Tensor query_keys, Tensor query_pages, Tensor pages, int page, float scale) -> Tensor",
        &sdcp::cpu::paged_attention);
  m.class_<sdcp::cpu::TwinModel>("TwinModel")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>>())
      .def("forward", &sdcp::cpu::TwinModel::forward)
      .def("use_int8_activations", &sdcp::cpu::TwinModel::use_int8_activations)
      .def("isa", &sdcp::cpu::TwinModel::isa);
}
