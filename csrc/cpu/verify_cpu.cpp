// CPU implementations of the specdec_ext ops: parallel over rows (at::parallel_for), vectorised
// over the vocabulary (fixed-lane accumulators that GCC vectorises without -ffast-math), and never
// materialising anything of size V: one pass reduces the residual mass Z, one partial pass walks
// the inverse CDF block by block until it reaches u * Z.
#include "cpu/verify_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <c10/util/Exception.h>
#include "check_msg.h"

#include <algorithm>
#include <atomic>
#include <vector>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/cpu_math.h"
#include "kernels/common.h"

namespace specdec {
namespace cpu {
namespace {

constexpr int64_t kBlock = 512;  // inverse-CDF block: one vectorised sum per block, a scalar scan of one block

template <typename T>
inline float ld(const T* p, int64_t j) {
  return static_cast<float>(p[j]);
}

// ------------------------------------------------------------------ vectorisable reductions
// The mass of a chunk of kLanes elements is computed element-wise into a small array (a plain
// map, which the compiler vectorises), then added into kLanes separate double accumulators, so
// no reassociation is needed and no -ffast-math: the summation order is fixed and deterministic.
constexpr int kLanes = 16;

template <typename F>
inline double sum_f64(int64_t b0, int64_t b1, const F& f) {
  double acc[kLanes] = {};
  int64_t j = b0;
  for (; j + kLanes <= b1; j += kLanes) {
    float v[kLanes];
    for (int k = 0; k < kLanes; ++k) v[k] = f(j + k);
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(v[k]);
  }
  double tail = 0.0;
  for (; j < b1; ++j) tail += static_cast<double>(f(j));
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0] + tail;
}

// Two sums in one pass: f(j, &a, &b) gives both terms of element j. Float lanes within blocks of kLanes * 32
// elements, double across blocks (as sum_blocked_f32 below: relative error about 2e-6 per block); used for the
// confidence features' softmax sums, where double lanes throughout made the pass over V twice as slow.
template <typename F>
inline void sum2_blocked_f32(int64_t V, const F& f, double* sa, double* sb) {
  constexpr int64_t kBlockElems = kLanes * 32;
  double ta = 0.0, tb = 0.0;
  int64_t j = 0;
  for (; j + kBlockElems <= V; j += kBlockElems) {
    float aa[kLanes] = {}, ab[kLanes] = {};
    for (int64_t i = j; i < j + kBlockElems; i += kLanes) {
      float va[kLanes], vb[kLanes];
      for (int k = 0; k < kLanes; ++k) f(i + k, &va[k], &vb[k]);
      for (int k = 0; k < kLanes; ++k) {
        aa[k] += va[k];
        ab[k] += vb[k];
      }
    }
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) {
        aa[k] += aa[k + w];
        ab[k] += ab[k + w];
      }
    ta += static_cast<double>(aa[0]);
    tb += static_cast<double>(ab[0]);
  }
  for (; j < V; ++j) {
    float va, vb;
    f(j, &va, &vb);
    ta += va;
    tb += vb;
  }
  *sa = ta;
  *sb = tb;
}

// Sum for a softmax normaliser: float lanes within blocks of kLanes * 32 elements (relative
// error about 2e-6 per block), double across blocks. Halves the conversions of sum_f64, and is
// used only where an error of that size is harmless (normalising exps of logits).
template <typename F>
inline double sum_blocked_f32(int64_t V, const F& f) {
  constexpr int64_t kBlockElems = kLanes * 32;
  double total = 0.0;
  int64_t j = 0;
  for (; j + kBlockElems <= V; j += kBlockElems) {
    float acc[kLanes] = {};
    for (int64_t i = j; i < j + kBlockElems; i += kLanes)
      for (int k = 0; k < kLanes; ++k) acc[k] += f(i + k);
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
    total += static_cast<double>(acc[0]);
  }
  return total + sum_f64(j, V, f);
}

// max_j f(j) and whether every raw value passed `ok`.
template <typename F, typename Ok>
inline float max_f32(int64_t V, const F& f, const Ok& ok, bool* all_ok) {
  float mx[kLanes];
  int bad[kLanes] = {};
  for (int k = 0; k < kLanes; ++k) mx[k] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      mx[k] = std::max(mx[k], f(j + k));
      bad[k] |= !ok(j + k);
    }
  float m = -std::numeric_limits<float>::infinity();
  int b = 0;
  for (; j < V; ++j) {
    m = std::max(m, f(j));
    b |= !ok(j);
  }
  for (int k = 0; k < kLanes; ++k) {
    m = std::max(m, mx[k]);
    b |= bad[k];
  }
  *all_ok = b == 0;
  return m;
}

template <typename Ok>
inline bool all_of(int64_t V, const Ok& ok) {
  int bad[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    for (int k = 0; k < kLanes; ++k) bad[k] |= !ok(j + k);
  int b = 0;
  for (; j < V; ++j) b |= !ok(j);
  for (int k = 0; k < kLanes; ++k) b |= bad[k];
  return b == 0;
}

// ------------------------------------------------------------------ distributions over one row
// Each distribution knows its mass at j (unnormalised, float32), its total mass (double) and
// whether its inputs were valid.

template <typename T>
struct ProbRow {  // a probability row as given
  const T* p;
  float mass(int64_t j) const { return ld(p, j); }
};

template <typename T>
struct ResidualRow {  // max(0, p - q), Sec. 2 of the SpecDec++ paper / Leviathan et al. Thm 1
  const T* p;
  const T* q;
  float mass(int64_t j) const { return std::max(ld(p, j) - ld(q, j), 0.0f); }  // branchless: vectorises
};

struct SoftmaxStats {
  float max;     // max_j x_j (raw logits)
  double sum;    // sum_j exp((x_j - max) / T)
  float inv_sum; // (float)(1 / sum)
  int64_t code;  // 0, or bad_code (a NaN or +Inf logit) / masked_code (every logit -inf)
};

// A softmax row whose exps were stored by softmax_stats_store: masses without recomputing exp.
struct ExpRow {
  const float* e;  // exp((x_j - max) / T)
  float inv_sum;
  float mass(int64_t j) const { return e[j] * inv_sum; }
};

struct ExpResidualRow {  // max(0, p - q) from two stored rows
  ExpRow p, q;
  float mass(int64_t j) const { return std::max(p.mass(j) - q.mass(j), 0.0f); }
};

// Logits may be -inf (masked tokens: top-k, top-p, grammars); NaN and +Inf are invalid.
inline bool logit_ok(float v) { return v <= 3.4028234663852886e38f; }

// softmax_stats that also stores e_j = exp((x_j - max) / T) into `e` (a per-thread scratch row).
// Written as (x - max) * (1 / T), never x / T - max / T: no multiply-add for the compiler to contract
// into an FMA, whose unrounded product would make the maximum's argument a positive rounding error
// (at T = 1e-12 about 6e4) instead of 0. Every argument is <= 0.
template <typename T>
SoftmaxStats softmax_stats_store(const T* x, int64_t V, float inv_t, float* e, int64_t bad_code, int64_t masked_code) {
  bool ok = true;
  const float m = max_f32(
      V, [&](int64_t j) { return ld(x, j); }, [&](int64_t j) { return logit_ok(ld(x, j)); }, &ok);
  if (!ok) return {m, 0.0, 0.0f, bad_code};
  if (!(m > -3.4028234663852886e38f)) return {m, 0.0, 0.0f, masked_code};
  const double sum = sum_blocked_f32(V, [&](int64_t j) {
    const float v = exp_nonpos(std::min((ld(x, j) - m) * inv_t, 0.0f));
    e[j] = v;
    return v;
  });
  return {m, sum, static_cast<float>(1.0 / sum), 0};
}

// Two scratch rows of V floats per thread, kept between calls (grown on demand).
inline float* scratch_rows(int64_t V) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 2 * V) buf.resize(2 * V);
  return buf.data();
}

template <typename Row>
double total_mass(const Row& row, int64_t V) {
  return sum_f64(0, V, [&](int64_t j) { return row.mass(j); });
}

// Inverse CDF: the first j with cumsum(mass)[j] >= u * total, accumulating in double. Because
// u > 0, the chosen j always has mass > 0. If rounding leaves the threshold unreached, the last
// j with positive mass is returned. Returns -1 only when every mass is zero.
template <typename Row>
int64_t inverse_cdf(const Row& row, int64_t V, double threshold) {
  double cum = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    const double s = sum_f64(b0, b1, [&](int64_t j) { return row.mass(j); });
    if (cum + s >= threshold) {
      for (int64_t j = b0; j < b1; ++j) {
        const float m = row.mass(j);
        cum += m;
        if (m > 0.0f && cum >= threshold) return j;
      }
      continue;  // rounding between the two sums: cum already holds this block
    }
    cum += s;
  }
  for (int64_t j = V - 1; j >= 0; --j)
    if (row.mass(j) > 0.0f) return j;
  return -1;
}

template <typename Row>
int64_t sample_row(const Row& row, int64_t V, float u) {
  return inverse_cdf(row, V, static_cast<double>(u) * total_mass(row, V));
}

// One pass over a probability row read in full: 0 if every entry is finite and >= 0 and the row sums
// to 1 within `tol`; else bad_code (NaN/Inf/negative: mapped to NaN, which poisons the sum), kZeroMass
// (sums to 0) or sum_code.
template <typename T>
int64_t check_prob_row(const T* p, int64_t V, float tol, int64_t bad_code, int64_t sum_code) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const double s = sum_f64(0, V, [&](int64_t j) {
    const float v = ld(p, j);
    return valid_prob(v) ? v : nan;
  });
  if (!(s - s == 0.0)) return bad_code;
  if (s == 0.0) return kZeroMass;
  return std::fabs(s - 1.0) <= tol ? 0 : sum_code;
}

// Residual sample at a rejection, or from p when Z = 0 (p = q up to rounding). Returns an
// InvalidInput code (< 0) when an input row is invalid.
template <typename T>
int64_t residual_or_target(const T* p, const T* q, int64_t V, float u, float tol) {
  if (const int64_t c = check_prob_row(p, V, tol, kInvalidTarget, kTargetSum)) return c;
  if (const int64_t c = check_prob_row(q, V, tol, kInvalidDraft, kDraftSum)) return c;
  ResidualRow<T> res{p, q};
  const double z = total_mass(res, V);
  if (z > 0.0) return inverse_cdf(res, V, static_cast<double>(u) * z);
  ProbRow<T> pr{p};
  return sample_row(pr, V, u);
}

inline void check_code(int64_t code, const char* what, bool logits) {
  SPECDEC_CHK_VALUE(code >= 0, what, ": ", error_message(code, logits));
}

inline bool uniform_ok(float u) { return u > 0.0f && u <= 1.0f; }

// The maximum of a row of V >= 1 entries and the first index that holds it (torch.argmax's convention: NaN
// counts as the maximum, so a row with NaN gives its first NaN's index), in two vectorised passes: the maximum
// (a max reduction, whose result does not depend on the order; NaN and +Inf are noted on the way), then a scan
// for the first entry equal to it, kArgmaxChunk entries compared at once and only the chunk that holds it
// searched one entry at a time. The scalar running maximum it replaced does not vectorise.
constexpr int64_t kArgmaxChunk = 64;

struct RowMax {
  float value;    // the largest entry that is not NaN (-Inf for a row of NaN and -Inf alone)
  int64_t index;  // the first index of the maximum (of the first NaN, where the row holds one)
  bool nan;       // the row holds a NaN
  bool pos_inf;   // the row holds +Inf
};

template <typename T>
RowMax row_max(const T* x, int64_t V) {
  float top = -std::numeric_limits<float>::infinity();
  int nan = 0, inf = 0;
#pragma omp simd reduction(max : top) reduction(| : nan, inf)
  for (int64_t j = 0; j < V; ++j) {
    const float v = ld(x, j);
    top = v > top ? v : top;
    nan |= v != v;
    inf |= v > 3.4028234663852886e38f;
  }
  RowMax r{top, 0, nan != 0, inf != 0};
  if (r.nan) {
    while (ld(x, r.index) == ld(x, r.index)) ++r.index;  // equal to itself: not NaN
    return r;
  }
  int64_t j = 0;
  for (; j + kArgmaxChunk <= V; j += kArgmaxChunk) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t k = 0; k < kArgmaxChunk; ++k) hit |= ld(x, j + k) == top;
    if (hit) break;
  }
  while (ld(x, j) != top) ++j;  // the maximum lies in this chunk, or in the tail
  r.index = j;
  return r;
}

template <typename T>
int64_t greedy_argmax(const T* x, int64_t V, int64_t* code) {
  // First index of the maximum (torch.argmax's convention); NaN/+Inf and fully masked rows flagged.
  const RowMax r = row_max(x, V);
  const bool masked = !(r.value > -3.4028234663852886e38f);  // -Inf everywhere
  *code = r.nan || r.pos_inf ? int64_t(kInvalidTarget) : (masked ? int64_t(kMaskedTarget) : 0);
  return r.index;
}

}  // namespace

// ------------------------------------------------------------------------------------ ops
struct RowResult {
  int64_t accepted = 0;  // accepted candidates
  int64_t extra = -1;    // the residual or bonus token
  int64_t code = 0;      // an InvalidInput code, 0 if the row is valid
};

// The per-row frame shared by both verify ops: rows in parallel, outputs -1-padded, the accepted
// prefix (written by `row`), then the extra token; the first invalid row's code is returned.
template <typename F>
int64_t verify_rows(const VerifyArgs& a, F&& row) {
  std::atomic<int64_t> error{0};
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = a.num_draft ? a.num_draft[b] : a.k;
      int64_t* out = a.out_ids + b * (a.k + 1);
      std::fill(out, out + a.k + 1, int64_t(-1));
      RowResult r = row(b, n, out);
      if (r.code == 0 && r.extra < 0) r.code = r.extra == -1 ? int64_t(kZeroMass) : r.extra;  // -1: every mass zero
      if (r.code != 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, r.code);
        continue;
      }
      out[r.accepted] = r.extra;
      a.num_accepted[b] = r.accepted;
    }
  });
  return error.load();
}

template <typename T>
static void chain_verify_impl(const VerifyArgs& args) {
  VerifyArgs a = args;
  a.rng = args.rng.resolve();
  const int64_t K = a.k, V = a.vocab;
  const float tol = sum_tolerance(a.dtype);
  const T* dp = static_cast<const T*>(a.draft);
  const T* tp = static_cast<const T*>(a.target);
  const int64_t error = verify_rows(a, [&](int64_t b, int64_t n, int64_t* out) {
    RowResult r;
    if (n < 0 || n > K) return RowResult{0, -1, kInvalidNumDraft};
    if (a.validate) {  // every row the op may read, in full
      for (int64_t i = 0; i <= n; ++i) {
        if (const int64_t c = check_prob_row(tp + (b * (K + 1) + i) * V, V, tol, kInvalidTarget, kTargetSum))
          return RowResult{0, -1, c};
        if (i < n)
          if (const int64_t c = check_prob_row(dp + (b * K + i) * V, V, tol, kInvalidDraft, kDraftSum))
            return RowResult{0, -1, c};
      }
    }
    for (; r.accepted < n; ++r.accepted) {  // an accepted candidate's rows are read at its token only
      const int64_t tok = a.ids[b * K + r.accepted];
      if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
      const float q = ld(dp + (b * K + r.accepted) * V, tok);
      const float p = ld(tp + (b * (K + 1) + r.accepted) * V, tok);
      if (!valid_prob(q)) return RowResult{0, -1, kInvalidDraft};
      if (!valid_prob(p)) return RowResult{0, -1, kInvalidTarget};
      const float u = a.rng.at(b, r.accepted);
      if (!uniform_ok(u)) return RowResult{0, -1, kInvalidUniform};
      if (!accept_candidate(u, q, p)) break;
      out[r.accepted] = tok;
    }
    const float u = a.rng.at(b, n);
    if (!uniform_ok(u)) return RowResult{0, -1, kInvalidUniform};
    if (r.accepted < n) {  // rejection: residual distribution norm(max(0, p - q)); both rows read in full
      r.extra = residual_or_target(tp + (b * (K + 1) + r.accepted) * V, dp + (b * K + r.accepted) * V, V, u, tol);
    } else {  // every candidate accepted: bonus token from the target's next distribution
      const T* p = tp + (b * (K + 1) + n) * V;
      const int64_t c = check_prob_row(p, V, tol, kInvalidTarget, kTargetSum);
      r.extra = c == 0 ? sample_row(ProbRow<T>{p}, V, u) : c;
    }
    return r;
  });
  if (error != 0) check_code(error, "chain_verify", false);
}

// Greedy verification of one row: candidate i is accepted iff it is the argmax of target row i (first
// index on ties); the target's argmax is emitted at the first mismatch, or as the bonus token.
template <typename T>
RowResult greedy_row(const VerifyArgs& a, const T* tl, int64_t b, int64_t n, int64_t* out) {
  const int64_t K = a.k, V = a.vocab;
  RowResult r;
  for (;; ++r.accepted) {
    int64_t code = 0;
    const int64_t best = greedy_argmax(tl + (b * (K + 1) + r.accepted) * V, V, &code);
    if (code != 0) return RowResult{0, -1, code};
    if (r.accepted == n) { r.extra = best; return r; }
    const int64_t tok = a.ids[b * K + r.accepted];
    if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
    if (tok != best) { r.extra = best; return r; }
    out[r.accepted] = tok;
  }
}

template <typename T>
static void chain_verify_greedy_impl(const VerifyArgs& a) {
  const T* tl = static_cast<const T*>(a.target);
  const int64_t error = verify_rows(a, [&](int64_t b, int64_t n, int64_t* out) {
    if (n < 0 || n > a.k) return RowResult{0, -1, kInvalidNumDraft};
    return greedy_row(a, tl, b, n, out);
  });
  if (error != 0) check_code(error, "chain_verify_greedy", true);
}

template <typename T>
static void chain_verify_logits_impl(const VerifyArgs& args) {
  VerifyArgs a = args;
  a.rng = args.rng.resolve();
  const int64_t K = a.k, V = a.vocab;
  const T* dl = static_cast<const T*>(a.draft);
  const T* tl = static_cast<const T*>(a.target);
  const int64_t error = verify_rows(a, [&](int64_t b, int64_t n, int64_t* out) {
    RowResult r;
    if (n < 0 || n > K) return RowResult{0, -1, kInvalidNumDraft};
    const float temp = a.temperature[b];
    if (temp != 0.0f && !(temp >= kMinTemperature && logit_ok(temp))) return RowResult{0, -1, kInvalidTemperature};
    if (a.validate) {  // every row the op may read, in full
      float* scratch = scratch_rows(V);
      for (int64_t i = 0; i <= n; ++i) {
        const float inv = temp == 0.0f ? 1.0f : 1.0f / temp;
        if (const int64_t c = softmax_stats_store(tl + (b * (K + 1) + i) * V, V, inv, scratch, kInvalidTarget,
                                                  kMaskedTarget).code)
          return RowResult{0, -1, c};
        if (i < n && temp != 0.0f)
          if (const int64_t c = softmax_stats_store(dl + (b * K + i) * V, V, inv, scratch, kInvalidDraft,
                                                    kMaskedDraft).code)
            return RowResult{0, -1, c};
      }
    }
    if (temp == 0.0f) return greedy_row(a, tl, b, n, out);
    const float inv_t = 1.0f / temp;
    float* et = scratch_rows(V);
    float* ed = et + V;
    for (; r.accepted < n; ++r.accepted) {
      const int64_t tok = a.ids[b * K + r.accepted];
      if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
      const SoftmaxStats st = softmax_stats_store(tl + (b * (K + 1) + r.accepted) * V, V, inv_t, et, kInvalidTarget,
                                                  kMaskedTarget);
      if (st.code != 0) return RowResult{0, -1, st.code};
      const SoftmaxStats sd = softmax_stats_store(dl + (b * K + r.accepted) * V, V, inv_t, ed, kInvalidDraft,
                                                  kMaskedDraft);
      if (sd.code != 0) return RowResult{0, -1, sd.code};
      const ExpRow p{et, st.inv_sum}, q{ed, sd.inv_sum};
      const float u = a.rng.at(b, r.accepted);
      if (!uniform_ok(u)) return RowResult{0, -1, kInvalidUniform};
      if (!accept_candidate(u, q.mass(tok), p.mass(tok))) {
        const float u_final = a.rng.at(b, n);
        if (!uniform_ok(u_final)) return RowResult{0, -1, kInvalidUniform};
        const ExpResidualRow res{p, q};
        const double z = total_mass(res, V);
        r.extra = z > 0.0 ? inverse_cdf(res, V, static_cast<double>(u_final) * z) : sample_row(p, V, u_final);
        return r;
      }
      out[r.accepted] = tok;
    }
    const float u_final = a.rng.at(b, n);
    if (!uniform_ok(u_final)) return RowResult{0, -1, kInvalidUniform};
    const SoftmaxStats st = softmax_stats_store(tl + (b * (K + 1) + n) * V, V, inv_t, et, kInvalidTarget,
                                                kMaskedTarget);
    if (st.code != 0) return RowResult{0, -1, st.code};
    r.extra = sample_row(ExpRow{et, st.inv_sum}, V, u_final);
    return r;
  });
  if (error != 0) check_code(error, "chain_verify_logits", true);
}

template <typename T>
static void residual_sample_impl(const ResidualArgs& args) {
  ResidualArgs a = args;
  a.rng = args.rng.resolve();
  const T* tp = static_cast<const T*>(a.target);
  const T* dp = static_cast<const T*>(a.draft);
  std::atomic<int64_t> error{0};
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float u = a.rng.at(b, 0);
      int64_t r = uniform_ok(u) ? residual_or_target(tp + b * a.vocab, dp + b * a.vocab, a.vocab, u, sum_tolerance(a.dtype))
                                : int64_t(kInvalidUniform);
      if (r == -1) r = kZeroMass;
      if (r < 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, r);
        r = -1;
      }
      a.out[b] = r;
    }
  });
  if (error.load() != 0) check_code(error.load(), "residual_sample", false);
}

void chain_verify(const VerifyArgs& a) { SPECDEC_DISPATCH(a.dtype, chain_verify_impl, a); }
void chain_verify_logits(const VerifyArgs& a) { SPECDEC_DISPATCH(a.dtype, chain_verify_logits_impl, a); }
void chain_verify_greedy(const VerifyArgs& a) { SPECDEC_DISPATCH(a.dtype, chain_verify_greedy_impl, a); }

// Rows in parallel, each task at least kArgmaxGrain entries: a few rows of a small vocabulary cost less than
// waking a second thread.
constexpr int64_t kArgmaxGrain = int64_t(1) << 16;

template <typename T>
static void argmax_tokens_impl(const ArgmaxArgs& a) {
  const T* x = static_cast<const T*>(a.logits);
  const int64_t V = a.vocab;
  at::parallel_for(0, a.rows, std::max<int64_t>(1, kArgmaxGrain / V), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) a.out[b] = row_max(x + b * V, V).index;
  });
}

void argmax_tokens(const ArgmaxArgs& a) { SPECDEC_DISPATCH(a.dtype, argmax_tokens_impl, a); }

void advance_rows(const AdvanceArgs& a) {
  for (int64_t b = 0; b < a.rows; ++b) advance_row(a, b);
}

void philox_uniforms(const PhiloxArgs& a) {
  for (int64_t b = 0; b < a.batch; ++b) {
    const uint64_t seed = static_cast<uint64_t>(a.seed_offsets[2 * b]);
    const uint64_t offset = static_cast<uint64_t>(a.seed_offsets[2 * b + 1]);
    for (int64_t j = 0; j < a.slots; ++j)
      a.out[b * a.slots + j] = philox_uniform(seed, offset, 0u, static_cast<uint32_t>(a.first_slot + j));
  }
}
void residual_sample(const ResidualArgs& a) { SPECDEC_DISPATCH(a.dtype, residual_sample_impl, a); }

// The acceptance head runs layer by layer over the whole batch, the threads splitting each weight matrix's
// output rows: a thread's slice of W ([L, H, H] float32 is 768 KiB at H = 256, L = 3) is read from memory
// once per layer and call, then reused from cache by every tile of kHeadRows batch rows (read a batch row at
// a time, the weights cost more than the arithmetic). The batch is padded with zero rows to whole tiles, and
// every output element is computed by the same code wherever its row and thread are, so a row's p_hat does
// not depend on its place in the batch.
constexpr int64_t kHeadRows = 4;

// Y[r, i] = sum_j W[i, j] X[r, j] for the kHeadRows rows of X and Y (row stride H) and i in [i0, i1), W [H, H]
// row-major: four independent FMA chains per weight row (one running sum is bound by the FMA latency).
inline void matvec_tile(const float* W, const float* X, int64_t H, int64_t i0, int64_t i1, float* Y) {
  const float* x0 = X;
  const float* x1 = X + H;
  const float* x2 = X + 2 * H;
  const float* x3 = X + 3 * H;
  for (int64_t i = i0; i < i1; ++i) {
    const float* w = W + i * H;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < H; ++j) {
      const float wv = w[j];
      s0 += wv * x0[j];
      s1 += wv * x1[j];
      s2 += wv * x2[j];
      s3 += wv * x3[j];
    }
    Y[i] = s0;
    Y[H + i] = s1;
    Y[2 * H + i] = s2;
    Y[3 * H + i] = s3;
  }
}

// SpecDec++ acceptance-head step (Sec. 3.2): the input x_0 = hidden + W_f features + b_f, L residual
// blocks x <- x + SiLU(W_l x + b_l), an output layer to the acceptance logit, the sigmoid, the running
// product, the stopping rule. A row whose p_hat or running product is not finite raises (a NaN would
// otherwise compare false in the stopping rule and silently disable it).
template <typename T>
static void head_step_impl(const HeadArgs& a) {
  const int64_t H = a.hidden_size, F = a.num_features;
  const int64_t rows = (a.batch + kHeadRows - 1) / kHeadRows * kHeadRows;
  std::vector<float> xs(rows * H, 0.0f), ys(rows * H);
  for (int64_t b = 0; b < a.batch; ++b) {
    float* x = xs.data() + b * H;
    if (a.hidden != nullptr) {
      const T* h = static_cast<const T*>(a.hidden) + b * H;
      for (int64_t j = 0; j < H; ++j) x[j] = static_cast<float>(h[j]);
    }
    if (F > 0) {
      const float* f = a.features + b * F;
      for (int64_t i = 0; i < H; ++i) {
        float acc = a.feature_bias[i];
        for (int64_t j = 0; j < F; ++j) acc += a.feature_weight[i * F + j] * f[j];
        x[i] += acc;
      }
    }
  }
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const float* W = a.block_weight + l * H * H;
    const float* bias = a.block_bias + l * H;
    at::parallel_for(0, H, 32, [&](int64_t i0, int64_t i1) {
      for (int64_t t = 0; t < rows; t += kHeadRows) {
        matvec_tile(W, xs.data() + t * H, H, i0, i1, ys.data() + t * H);
        for (int64_t r = t; r < t + kHeadRows; ++r) {
          const float* x = xs.data() + r * H;
          float* y = ys.data() + r * H;
          // x + SiLU(z), SiLU(z) = z * sigmoid(z) with sigmoid from e = exp(-|z|) <= 1 (exp_nonpos: a
          // polynomial the compiler vectorises, about 1 ulp, no overflow for any z)
#pragma omp simd
          for (int64_t i = i0; i < i1; ++i) {
            const float z = y[i] + bias[i];
            const float e = exp_nonpos(-std::fabs(z));
            const float sig = z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            y[i] = x[i] + z * sig;
          }
        }
      }
    });
    std::swap(xs, ys);
  }
  int64_t bad_row = -1;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float* x = xs.data() + b * H;
    float logit = a.out_bias[0];
#pragma omp simd reduction(+ : logit)
    for (int64_t j = 0; j < H; ++j) logit += a.out_weight[j] * x[j];
    const float p = 1.0f / (1.0f + std::exp(-logit));
    const float c = a.cum_accept[b] * p;
    a.p_accept[b] = p;
    a.cum_accept[b] = c;
    a.stop[b] = head_row_stop(a, b, c);
    if (bad_row < 0 && (!finite_f(logit) || !finite_f(c))) bad_row = b;
  }
  SPECDEC_CHK_VALUE(bad_row < 0, "acceptance_head_step: row ", bad_row, " gives a NaN or Inf acceptance probability or ",
                    "running product (hidden, features or cum_accept hold a NaN or Inf); a NaN would silently disable ",
                    "the stop rule");
}

void acceptance_head_step(const HeadArgs& a) { SPECDEC_DISPATCH(a.dtype, head_step_impl, a); }

// Draft-confidence features of candidate y under q (head/features.py): q(y), q_(1) - q_(2), H(q) in nats.
// From logits (q = softmax(x)): one pass for the maximum and the second largest value, one for
// Z = sum e_j and S = sum e_j (x_j - m) with e_j = exp(x_j - m); then q(y) = e_y / Z, q_(1) = 1 / Z,
// q_(2) = exp(x_(2) - m) / Z and H = log Z - S / Z (since log q_j = x_j - m - log Z). Masked (-inf)
// entries contribute nothing. From probabilities: one pass for the two largest and -sum q log q.
template <typename T>
static void confidence_impl(const ConfidenceArgs& a) {
  const int64_t V = a.vocab;
  std::atomic<int64_t> error{0};
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* x = static_cast<const T*>(a.dist) + b * V;
      const int64_t y = a.tokens[b];
      int64_t code = (y < 0 || y >= V) ? int64_t(kInvalidTokenId) : 0;
      float top1 = -std::numeric_limits<float>::infinity(), top2 = top1;
      bool ok = true;
      if (code == 0) {  // the two largest: per-lane (t1, t2) updated without branches, then merged
        float t1[kLanes], t2[kLanes];
        int bad[kLanes] = {};
        for (int k = 0; k < kLanes; ++k) t1[k] = t2[k] = -std::numeric_limits<float>::infinity();
        int64_t j = 0;
        for (; j + kLanes <= V; j += kLanes)
          for (int k = 0; k < kLanes; ++k) {
            const float v = ld(x, j + k);
            bad[k] |= a.logits ? !logit_ok(v) : !valid_prob(v);
            t2[k] = std::max(t2[k], std::min(t1[k], v));
            t1[k] = std::max(t1[k], v);
          }
        for (int k = 0; k < kLanes; ++k) {
          ok &= bad[k] == 0;
          top2 = std::max(top2, std::min(top1, t1[k]));
          top1 = std::max(top1, t1[k]);
          top2 = std::max(top2, t2[k]);
        }
        for (; j < V; ++j) {
          const float v = ld(x, j);
          ok &= a.logits ? logit_ok(v) : valid_prob(v);
          top2 = std::max(top2, std::min(top1, v));
          top1 = std::max(top1, v);
        }
      }
      if (code == 0 && !ok) code = kInvalidDraft;
      float* out = a.out + b * 3;
      if (code == 0 && a.logits) {
        if (!(top1 > -3.4028234663852886e38f)) code = kMaskedDraft;
        if (code == 0) {
          const float m = top1;
          double z = 0.0, sx = 0.0;  // one pass for Z = sum e and S = sum e (x - m)
          sum2_blocked_f32(V, [&](int64_t j, float* e, float* ed) {
            const float d = std::min(ld(x, j) - m, 0.0f);
            const float ev = exp_nonpos(d);
            *e = ev;
            *ed = ev > 0.0f ? ev * d : 0.0f;
          }, &z, &sx);
          out[0] = static_cast<float>(exp_nonpos(std::min(ld(x, y) - m, 0.0f)) / z);
          out[1] = static_cast<float>((1.0 - exp_nonpos(std::min(top2 - m, 0.0f))) / z);
          out[2] = static_cast<float>(std::log(z) - sx / z);
        }
      } else if (code == 0) {
        const double h = sum_f64(0, V, [&](int64_t j) {
          const float q = ld(x, j);
          return q > 0.0f ? -q * std::log(q) : 0.0f;
        });
        out[0] = ld(x, y);
        out[1] = top1 - std::max(top2, 0.0f);  // V = 1: no second entry, probability 0
        out[2] = static_cast<float>(h);
      }
      if (code != 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, code);
      }
    }
  });
  if (error.load() != 0) check_code(error.load(), "confidence_features", a.logits);
}

void confidence_features(const ConfidenceArgs& a) { SPECDEC_DISPATCH(a.dtype, confidence_impl, a); }

}  // namespace cpu
}  // namespace specdec
