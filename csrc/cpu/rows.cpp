// Per-row decisions of the native verify op, exact against the float64 reference.
//
// How the decisions stay exact while the streaming pass works in float:
// - Max, argmax (ties to the smallest id), the bad-row flag and every kept-set decision of
//   top-k are comparisons of the logits themselves: exact.
// - Top-k / top-p work on a candidate list, never a sort over V. The max pass of a filtered
//   row records the max of every group of kGroup tokens. Top-k: at least k tokens lie at or
//   above the k-th largest group max, so only tokens above it (just below, for ties) can be
//   among the k best; they are gathered from the groups whose max exceeds it, and the k best
//   are picked by counting (kth_largest_key; ties keep smaller ids). Top-p without top-k:
//   whatever ranks below the top-p prefix holds at most (1 - p) S, so a logit below which the
//   row holds less than that (top_p_floor: the highest of a ladder of thresholds, masses from
//   one float pass with margin) bounds the candidates, gathered the same way. Candidate
//   weights and the prefix's cumulative mass are computed in double, the prefix is found by a
//   radix selection on mass (select_prefix); only the top-p target p * S of a row without
//   top-k uses the float-pass S, and a decision within kSumRel of it is redone with S summed
//   in double (on flat rows, where the boundary token weighs little, that is most rows).
// - Acceptance: p(x) = exp((x - max) / T) / S with the numerator in double. For kept sets with
//   S from the float pass, |S_float / S - 1| <= 6.2e-6 (exp: 1.9e-7 + 1.8e-7 u per term, with
//   E_p[u] <= ln V; block sums: 40 * 2^-24); a uniform within kSumRel = 2.5e-5 (4x that) of
//   the ratio is re-decided with S summed in double.
// - The extra-token draw weighs its one row in double (a vectorised exp accurate to a few ulp)
//   with S in double: a float draw could not be exact on flat rows, where CDF boundaries lie
//   closer together than float rounding. Small kept sets keep their (id, weight) list from
//   the top-k / top-p selection and draw from it without reading the row again.
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>

namespace sdcp::cpu {

namespace {

constexpr size_t kListMax = 4096;     // kept sets up to this size keep their (id, weight) list
constexpr double kSumRel = 2.5e-5;    // 4x the bound on the float-pass mass's relative error
constexpr double kInf = std::numeric_limits<double>::infinity();

// Per-thread buffers that only grow: rows of 100k+ tokens would otherwise allocate (and fault
// in) fresh megabytes for every row and every draw.
struct Scratch {
  std::vector<float> gmax, values;
  std::vector<int32_t> keys;
  std::vector<Cand> cands, sub, next, rest;
  std::vector<double> w, sums, bucket_mass;
  std::vector<uint32_t> bucket_count;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}
template <class T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

bool is_kept(const RowStat& st, float x, int64_t id) {
  return !st.masked || x > st.tau || (x == st.tau && id <= st.tie_last);
}

double weight(const RowStat& st, float x) { return std::exp((double(x) - double(st.m)) / st.T); }

KeptSet kept_set(const RowStat& st) {
  return KeptSet{st.m, 1.0 / st.T, st.k2, st.masked, st.tau, st.tie_last};
}

void make_mass_exact(const RowView& row, RowStat& st, const IsaKernels& k) {
  if (!st.S_exact) {
    st.S = k.row_weights(row.dt, row.x, row.V, kept_set(st), nullptr);
    st.S_exact = true;
  }
}

// The shortest prefix of the candidates in reference order whose mass reaches `target`.
struct Selection {
  size_t n;       // how many candidates are kept
  Cand last;      // the n-th candidate in order: the kept set's boundary
  double before;  // mass of the first n - 1
  double mass;    // mass of the first n
};

// Keep every candidate (top-k without top-p).
Selection keep_all(const std::vector<Cand>& c) {
  Selection s{c.size(), c[0], 0.0, 0.0};
  for (const Cand& e : c) {
    s.mass += e.w;
    if (ranks_before(s.last, e)) s.last = e;
  }
  s.before = s.mass - s.last.w;
  return s;
}

// Radix selection on mass: the mass of every logit-key bucket (4096 buckets over the keys'
// range), the bucket where the cumulative mass from the top crosses the target, then the same
// within that bucket until it is small enough to sort. No sort over the candidates, no
// data-dependent partitioning.
Selection select_prefix(const std::vector<Cand>& all, double target) {
  constexpr size_t kSortable = 256, kBuckets = 4096;
  Scratch& s = scratch();
  std::vector<Cand>& c = s.sub;  // the range once narrowed (`all` is s.cands)
  std::vector<Cand>& next = s.next;
  const std::vector<Cand>* range = &all;
  double acc = 0.0;  // mass of the candidates known to rank before the range
  size_t above = 0;  // how many
  double* mass = sized(s.bucket_mass, kBuckets);
  uint32_t* count = sized(s.bucket_count, kBuckets);
  while (range->size() > kSortable) {
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    for (const Cand& e : *range) {
      kmin = std::min(kmin, order_key(e.v));
      kmax = std::max(kmax, order_key(e.v));
    }
    if (kmin == kmax) break;  // one logit: ties, ordered by id below
    int shift = 0;
    while ((uint64_t(int64_t(kmax) - kmin) >> shift) >= kBuckets) ++shift;
    std::fill(mass, mass + kBuckets, 0.0);
    std::fill(count, count + kBuckets, 0u);
    for (const Cand& e : *range) {
      const size_t b = size_t(uint64_t(int64_t(order_key(e.v)) - kmin) >> shift);
      mass[b] += e.w;
      ++count[b];
    }
    size_t b = (uint64_t(int64_t(kmax) - kmin) >> shift) + 1;
    while (b > 0 && acc + mass[b - 1] < target) {
      acc += mass[b - 1];
      above += count[b - 1];
      --b;
    }
    if (b == 0) return Selection{above, all[0], 0.0, acc};  // not reached: caller keeps all
    next.clear();
    for (const Cand& e : *range) {
      if ((uint64_t(int64_t(order_key(e.v)) - kmin) >> shift) == b - 1) next.push_back(e);
    }
    c.swap(next);
    range = &c;
  }
  std::vector<Cand>& rest = s.rest;
  rest.assign(range->begin(), range->end());
  std::sort(rest.begin(), rest.end(), ranks_before);
  for (size_t i = 0; i < rest.size(); ++i) {
    if (acc + rest[i].w >= target) return Selection{above + i + 1, rest[i], acc, acc + rest[i].w};
    acc += rest[i].w;
  }
  return Selection{above + rest.size(), rest.empty() ? all[0] : rest.back(), 0.0, acc};
}

// The k best of the candidates (ids ascending), ties at the boundary to the smaller ids.
void keep_k_best(std::vector<Cand>& c, int64_t top_k, float above, const IsaKernels& k) {
  if (int64_t(c.size()) <= top_k) return;
  int32_t* keys = sized(scratch().keys, c.size() + 16);
  for (size_t i = 0; i < c.size(); ++i) keys[i] = order_key(c[i].v);
  const int64_t lo = above == -std::numeric_limits<float>::infinity()
                         ? INT32_MIN : int64_t(order_key(above)) + 1;
  const int32_t kth = k.kth_largest_key(keys, c.size(), top_k, lo);
  int64_t ties = top_k;
  for (size_t i = 0; i < c.size(); ++i) ties -= keys[i] > kth;
  size_t j = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (keys[i] > kth || (keys[i] == kth && ties-- > 0)) c[j++] = c[i];
  }
  c.resize(j);
}

void fill_weights(std::vector<Cand>& c, const RowStat& st, const IsaKernels& k) {
  float* v = sized(scratch().values, c.size());
  double* w = sized(scratch().w, c.size());
  for (size_t i = 0; i < c.size(); ++i) v[i] = c[i].v;
  k.weights_of(v, c.size(), st.m, 1.0 / st.T, w);
  for (size_t i = 0; i < c.size(); ++i) c[i].w = w[i];
}

// A logit below which the tokens of a row without top-k hold less than (1 - p) S: none of
// them can be in the top-p prefix (whatever ranks below the prefix holds at most (1 - p) S).
// The highest of a ladder of candidates whose mass below (float pass, with margin) is small
// enough; (1 - p) / 2 * S / V per token as the last resort.
float top_p_floor(const RowView& row, const RowStat& st, double p, double S,
                  const IsaKernels& k) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  static constexpr float kNats[kLadder] = {0.25f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f,
                                           4.0f,  5.0f, 6.0f, 7.0f, 9.0f, 12.0f};
  float floors[kLadder];
  for (int j = 0; j < kLadder; ++j) floors[j] = float(double(st.m) - st.T * kNats[j]);
  double below[kLadder];
  k.mass_below(row.dt, row.x, row.V, st.m, st.k2, floors, below);
  for (int j = 0; j < kLadder; ++j) {
    if (below[j] < (1.0 - p) * S * (1.0 - 4 * kSumRel)) return floors[j];
  }
  const double w_floor = 0.5 * (1.0 - p) * S / double(row.V);
  const float floor = float(double(st.m) + st.T * std::log(w_floor));
  return std::nextafter(std::nextafter(floor, kNegInf), kNegInf);
}

// The kept set of a row with top-k and/or top-p, its exact mass and (when small) its list.
void select_kept(const RowView& row, const Profile& pf, const ScanResult& sr,
                 const float* gmax, size_t groups, const IsaKernels& k, RowStat& st) {
  const int64_t V = row.V;
  const bool topk_on = pf.top_k > 0 && pf.top_k < V;
  const double p = double(pf.top_p_milli) / 1000.0;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<Cand>& c = scratch().cands;
  c.clear();
  double target = kInf;  // no top-p: keep all of K
  if (topk_on) {
    float above = kNegInf;  // just below the k-th largest group max
    int32_t* keys = sized(scratch().keys, groups + 16);
    size_t m = 0;
    for (size_t g = 0; g < groups; ++g) {
      if (gmax[g] > kNegInf) keys[m++] = order_key(gmax[g]);
    }
    if (int64_t(m) > pf.top_k) {
      above = std::nextafter(key_value(k.kth_largest_key(keys, m, pf.top_k, INT32_MIN)), kNegInf);
    }
    k.collect_above(row.dt, row.x, V, gmax, above, c);
    keep_k_best(c, pf.top_k, above, k);
    fill_weights(c, st, k);
    double mass = 0.0;
    for (const Cand& e : c) mass += e.w;
    if (pf.top_p_milli < 1000) target = p * mass;
  } else {
    const float floor = pf.top_p_milli == 0 ? std::nextafter(st.m, kNegInf)
                                            : top_p_floor(row, st, p, sr.sum, k);
    k.collect_above(row.dt, row.x, V, gmax, std::nextafter(floor, kNegInf), c);
    fill_weights(c, st, k);
    target = p * sr.sum;
  }
  Selection sel = target == kInf ? keep_all(c) : select_prefix(c, target);
  if (!topk_on && pf.top_p_milli > 0 &&
      !(sel.before < target * (1.0 - kSumRel) && sel.mass >= target * (1.0 + kSumRel))) {
    make_mass_exact(row, st, k);  // (unmasked yet: the whole row's mass)
    sel = select_prefix(c, p * st.S);
  }
  if (sel.n >= c.size()) sel = keep_all(c);  // the target was not reached: keep all of K
  st.masked = true;
  st.tau = sel.last.v;
  st.tie_last = sel.last.id;
  st.S = sel.mass;
  st.S_exact = true;
  if (sel.n <= kListMax) {  // the kept candidates, ids ascending (as gathered)
    st.list.reserve(sel.n);
    for (const Cand& e : c) {
      if (e.v > st.tau || (e.v == st.tau && e.id <= st.tie_last)) st.list.push_back(Kept{e.id, e.w});
    }
    st.has_list = true;
  }
}

// Smallest index with cumulative weight > u * total (sequential sums, as torch.cumsum), or
// the last index with weight when rounding leaves u * total at the very top.
template <class Weight>
int64_t inverse_cdf(int64_t n, Weight w, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += w(i);
  const double target = u * total;
  double cum = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double wi = w(i);
    cum += wi;
    if (wi > 0.0) last = i;
    if (cum > target) return i;
  }
  return last;
}

int64_t draw_from_list(const RowStat& st, const float* q_row, double u) {
  const std::vector<Kept>& list = st.list;
  const int64_t n = int64_t(list.size());
  auto p = [&](int64_t i) { return list[size_t(i)].w / st.S; };
  if (q_row) {
    auto res = [&](int64_t i) { return residual(p(i), double(q_row[list[size_t(i)].id])); };
    double mass = 0.0;
    for (int64_t i = 0; i < n; ++i) mass += res(i);
    if (mass > 0.0) return list[size_t(inverse_cdf(n, res, u))].id;
  }
  return list[size_t(inverse_cdf(n, p, u))].id;
}

// The whole row weighed in double: one vectorised exp pass into a buffer, block sums of p or
// of the residual, then a sequential scan of the one block where u * mass falls.
int64_t draw_from_row(const RowView& row, RowStat& st, const float* q_row, double u,
                      const IsaKernels& k) {
  const int64_t V = row.V;
  double* w = sized(scratch().w, size_t(V));
  const double total = k.row_weights(row.dt, row.x, V, kept_set(st), w);
  if (!st.S_exact) {
    st.S = total;
    st.S_exact = true;
  }
  const double inv_s = 1.0 / st.S;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double* sums = sized(scratch().sums, size_t(nb));
  const float* q = q_row;
  k.block_sums(w, q, V, inv_s, sums);
  double mass = 0.0;
  for (int64_t j = 0; j < nb; ++j) mass += sums[j];
  if (q && !(mass > 0.0)) {  // the residual has no mass: draw from p
    q = nullptr;
    k.block_sums(w, q, V, inv_s, sums);
    mass = 0.0;
    for (int64_t j = 0; j < nb; ++j) mass += sums[j];
  }
  const double target = u * mass;
  double before = 0.0;
  int64_t j = 0;
  while (j + 1 < nb && before + sums[size_t(j)] <= target) before += sums[size_t(j++)];
  const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
  double cum = before;
  int64_t last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const double wi = q ? residual(w[size_t(i)] * inv_s, double(q[i])) : w[size_t(i)] * inv_s;
    cum += wi;
    if (wi > 0.0) last = i;
    if (cum > target) return i;
  }
  if (last >= 0) return last;  // rounding between block and sequential sums: the block's top
  for (int64_t i = lo - 1; i >= 0; --i) {  // (an empty last block) the last token with mass
    if ((q ? residual(w[size_t(i)] * inv_s, double(q[i])) : w[size_t(i)] * inv_s) > 0.0) return i;
  }
  return st.arg;
}

}  // namespace

void compute_row_stat(const RowView& row, const Profile& pf, bool full, const IsaKernels& k,
                      RowStat& st) {
  const int64_t V = row.V;
  full = full && pf.temperature_milli > 0;
  const bool topk_on = pf.top_k > 0 && pf.top_k < V;
  const bool topp_on = pf.top_p_milli < 1000;
  st.T = pf.temperature_milli > 0 ? double(pf.temperature_milli) / 1000.0 : 1.0;
  st.k2 = float(1.4426950408889634 / st.T);
  ScanRequest rq;
  rq.T = st.T;
  rq.k2 = st.k2;
  const size_t groups = size_t((V + kGroup - 1) / kGroup);
  if (full) {
    rq.sum = !topk_on;  // K = V: its mass is the whole row's
    if (topk_on || topp_on) rq.group_max = sized(scratch().gmax, groups);
  }
  ScanResult sr;
  k.scan(row.dt, row.x, V, rq, sr);
  st.m = sr.max;
  st.arg = sr.arg;
  st.bad = sr.bad;
  if (st.bad || !full) return;
  st.full = true;
  if (!topk_on && !topp_on) {
    st.S = sr.sum;
    st.S_exact = false;
    return;
  }
  select_kept(row, pf, sr, rq.group_max, groups, k, st);
}

bool accept_token(const RowView& row, RowStat& st, int64_t x, double qx, double u,
                  const IsaKernels& k) {
  const float lx = row.at(x);
  const double w = is_kept(st, lx, x) ? weight(st, lx) : 0.0;
  if (!st.S_exact) {
    const double ratio = w / st.S / qx;
    if (u < std::min(1.0, ratio * (1.0 - kSumRel))) return true;
    if (u >= std::min(1.0, ratio * (1.0 + kSumRel))) return false;
    make_mass_exact(row, st, k);
  }
  return u < std::min(1.0, w / st.S / qx);
}

int64_t draw_token(const RowView& row, RowStat& st, const float* q_row, double u,
                   const IsaKernels& k) {
  // a finite negative q outside the kept set holds residual mass (reference.py): read the row
  if (st.has_list && (!q_row || !k.any_finite_negative(q_row, row.V))) {
    return draw_from_list(st, q_row, u);
  }
  return draw_from_row(row, st, q_row, u, k);
}

void write_probs(const RowView& row, const RowStat& st, const IsaKernels& k, float* out) {
  const int64_t V = row.V;
  if (st.bad) {
    std::fill(out, out + V, std::numeric_limits<float>::quiet_NaN());
  } else if (!st.full) {  // greedy: one-hot on the argmax
    std::fill(out, out + V, 0.0f);
    out[st.arg] = 1.0f;
  } else if (st.has_list) {
    std::fill(out, out + V, 0.0f);
    for (const Kept& e : st.list) out[e.id] = float(e.w / st.S);
  } else {
    k.write_probs(row.dt, row.x, V, kept_set(st), float(1.0 / st.S), out);
  }
}

}  // namespace sdcp::cpu
