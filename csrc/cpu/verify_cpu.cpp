// CPU implementations of the specdec_ext ops: parallel over rows (at::parallel_for), vectorised
// over the vocabulary (fixed-lane accumulators that GCC vectorises without -ffast-math), and never
// materialising anything of size V: one pass reduces the residual mass Z, one partial pass walks
// the inverse CDF block by block until it reaches u * Z.
#include "cpu/verify_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <vector>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/common.h"

namespace specdec {
namespace cpu {
namespace {

constexpr int64_t kBlock = 512;  // inverse-CDF block: one vectorised sum per block, a scalar scan of one block

template <typename T>
inline float ld(const T* p, int64_t j) {
  return static_cast<float>(p[j]);
}

// exp(x) for x <= 0 (arguments are always shifted by the row maximum): Cody-Waite range
// reduction and a degree-6 minimax polynomial (Cephes expf coefficients), about 1 ulp;
// written with plain arithmetic so that element-wise loops vectorise it.
inline float exp_nonpos(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
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
  float max;     // max_j x_j / T
  double sum;    // sum_j exp(x_j / T - max)
  float inv_sum; // (float)(1 / sum)
  bool ok;
};

// A softmax row whose exps were stored by softmax_stats_store: masses without recomputing exp.
struct ExpRow {
  const float* e;  // exp(x_j / T - max)
  float inv_sum;
  float mass(int64_t j) const { return e[j] * inv_sum; }
};

struct ExpResidualRow {  // max(0, p - q) from two stored rows
  ExpRow p, q;
  float mass(int64_t j) const { return std::max(p.mass(j) - q.mass(j), 0.0f); }
};

// softmax_stats that also stores e_j = exp(x_j / T - max) into `e` (a per-thread scratch row).
template <typename T>
SoftmaxStats softmax_stats_store(const T* x, int64_t V, float inv_t, float* e) {
  bool ok = true;
  const float m = max_f32(
      V, [&](int64_t j) { return ld(x, j) * inv_t; },
      [&](int64_t j) {
        const float v = ld(x, j);
        return v >= -3.4028234663852886e38f && v <= 3.4028234663852886e38f;
      },
      &ok);
  const double sum = sum_blocked_f32(V, [&](int64_t j) {
    const float v = exp_nonpos(ld(x, j) * inv_t - m);
    e[j] = v;
    return v;
  });
  return {m, sum, static_cast<float>(1.0 / sum), ok};
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

template <typename T>
bool row_valid(const T* p, int64_t V) {
  return all_of(V, [&](int64_t j) { return valid_prob(ld(p, j)); });
}

// Residual sample at a rejection, or from p when Z = 0 (p = q up to rounding). Returns an
// InvalidInput code (< 0) when an input row is invalid.
template <typename T>
int64_t residual_or_target(const T* p, const T* q, int64_t V, float u) {
  if (!row_valid(p, V)) return kInvalidTargetProbs;
  if (!row_valid(q, V)) return kInvalidDraftProbs;
  ResidualRow<T> res{p, q};
  const double z = total_mass(res, V);
  if (z > 0.0) return inverse_cdf(res, V, static_cast<double>(u) * z);
  ProbRow<T> pr{p};
  return sample_row(pr, V, u);
}

inline void check_code(int64_t code, const char* what) {
  TORCH_CHECK_VALUE(code != kInvalidDraftProbs, what, ": draft_probs has a NaN, Inf or negative value in a row it reads");
  TORCH_CHECK_VALUE(code != kInvalidTargetProbs, what, ": target_probs has a NaN, Inf or negative value in a row it reads");
  TORCH_CHECK_VALUE(code != kInvalidTokenId, what, ": draft_token_ids has an id outside [0, V)");
  TORCH_CHECK_VALUE(code != kInvalidUniform, what, ": uniforms must lie in (0, 1]");
  TORCH_CHECK_VALUE(code >= 0, what, ": every target and draft mass is zero in a row (target_probs sums to 0)");
}

inline bool uniform_ok(float u) { return u > 0.0f && u <= 1.0f; }

template <typename T>
int64_t greedy_argmax(const T* x, int64_t V, bool* ok) {
  // First index of the maximum (torch.argmax's convention); NaN/Inf flagged.
  int64_t best = 0;
  float bv = ld(x, 0);
  bool good = true;
  for (int64_t j = 0; j < V; ++j) {
    const float v = ld(x, j);
    good &= (v >= -3.4028234663852886e38f && v <= 3.4028234663852886e38f);
    if (v > bv) { bv = v; best = j; }
  }
  *ok = good;
  return best;
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
      if (r.code == 0 && r.extra < 0) r.code = r.extra;  // -1: every mass zero; < -1: an InvalidInput code
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
  const T* dp = static_cast<const T*>(a.draft);
  const T* tp = static_cast<const T*>(a.target);
  const int64_t error = verify_rows(a, [&](int64_t b, int64_t n, int64_t* out) {
    RowResult r;
    for (; r.accepted < n; ++r.accepted) {
      const int64_t tok = a.ids[b * K + r.accepted];
      if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
      const float q = ld(dp + (b * K + r.accepted) * V, tok);
      const float p = ld(tp + (b * (K + 1) + r.accepted) * V, tok);
      if (!valid_prob(q)) return RowResult{0, -1, kInvalidDraftProbs};
      if (!valid_prob(p)) return RowResult{0, -1, kInvalidTargetProbs};
      const float u = a.rng.at(b, r.accepted);
      if (!uniform_ok(u)) return RowResult{0, -1, kInvalidUniform};
      if (!accept_candidate(u, q, p)) break;
      out[r.accepted] = tok;
    }
    const float u = a.rng.at(b, n);
    if (!uniform_ok(u)) return RowResult{0, -1, kInvalidUniform};
    if (r.accepted < n) {  // rejection: residual distribution norm(max(0, p - q))
      r.extra = residual_or_target(tp + (b * (K + 1) + r.accepted) * V, dp + (b * K + r.accepted) * V, V, u);
    } else {  // every candidate accepted: bonus token from the target's next distribution
      const T* p = tp + (b * (K + 1) + n) * V;
      r.extra = row_valid(p, V) ? sample_row(ProbRow<T>{p}, V, u) : int64_t(kInvalidTargetProbs);
    }
    return r;
  });
  if (error != 0) check_code(error, "chain_verify");
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
    const float temp = a.temperature[b];
    if (temp == 0.0f) {  // greedy verification: accept iff the candidate is the target's argmax
      for (;; ++r.accepted) {
        bool ok = true;
        const int64_t best = greedy_argmax(tl + (b * (K + 1) + r.accepted) * V, V, &ok);
        if (!ok) return RowResult{0, -1, kInvalidTargetProbs};
        if (r.accepted == n) { r.extra = best; return r; }
        const int64_t tok = a.ids[b * K + r.accepted];
        if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
        if (tok != best) { r.extra = best; return r; }
        out[r.accepted] = tok;
      }
    }
    const float inv_t = 1.0f / temp;
    float* et = scratch_rows(V);
    float* ed = et + V;
    for (; r.accepted < n; ++r.accepted) {
      const int64_t tok = a.ids[b * K + r.accepted];
      if (tok < 0 || tok >= V) return RowResult{0, -1, kInvalidTokenId};
      const SoftmaxStats st = softmax_stats_store(tl + (b * (K + 1) + r.accepted) * V, V, inv_t, et);
      const SoftmaxStats sd = softmax_stats_store(dl + (b * K + r.accepted) * V, V, inv_t, ed);
      if (!st.ok) return RowResult{0, -1, kInvalidTargetProbs};
      if (!sd.ok) return RowResult{0, -1, kInvalidDraftProbs};
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
    const SoftmaxStats st = softmax_stats_store(tl + (b * (K + 1) + n) * V, V, inv_t, et);
    if (!st.ok) return RowResult{0, -1, kInvalidTargetProbs};
    r.extra = sample_row(ExpRow{et, st.inv_sum}, V, u_final);
    return r;
  });
  TORCH_CHECK_VALUE(error != kInvalidTargetProbs, "chain_verify_logits: target_logits has a NaN or Inf value in a row it reads");
  TORCH_CHECK_VALUE(error != kInvalidDraftProbs, "chain_verify_logits: draft_logits has a NaN or Inf value in a row it reads");
  if (error != 0) check_code(error, "chain_verify_logits");
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
      int64_t r = uniform_ok(u) ? residual_or_target(tp + b * a.vocab, dp + b * a.vocab, a.vocab, u) : int64_t(kInvalidUniform);
      if (r < 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, r);
        r = -1;
      }
      a.out[b] = r;
    }
  });
  if (error.load() != 0) check_code(error.load(), "residual_sample");
}

#define SPECDEC_DISPATCH(dtype, FN, ARGS)                                            \
  switch (dtype) {                                                                  \
    case DType::kFloat32: FN<float>(ARGS); break;                                   \
    case DType::kBFloat16: FN<c10::BFloat16>(ARGS); break;                          \
    case DType::kFloat16: FN<c10::Half>(ARGS); break;                               \
  }

void chain_verify(const VerifyArgs& a) { SPECDEC_DISPATCH(a.dtype, chain_verify_impl, a); }
void chain_verify_logits(const VerifyArgs& a) { SPECDEC_DISPATCH(a.dtype, chain_verify_logits_impl, a); }
void residual_sample(const ResidualArgs& a) { SPECDEC_DISPATCH(a.dtype, residual_sample_impl, a); }

// SpecDec++ acceptance-head step (Sec. 3.2): L residual blocks x <- x + SiLU(W_l x + b_l), an
// output layer to the acceptance logit, the sigmoid, the running product, the stopping rule.
template <typename T>
static void head_step_impl(const HeadArgs& a) {
  const int64_t H = a.hidden_size;
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(H), y(H);
    for (int64_t b = begin; b < end; ++b) {
      const T* h = static_cast<const T*>(a.hidden) + b * H;
      for (int64_t j = 0; j < H; ++j) x[j] = static_cast<float>(h[j]);
      for (int64_t l = 0; l < a.num_layers; ++l) {
        const float* W = a.block_weight + l * H * H;
        const float* bias = a.block_bias + l * H;
        for (int64_t i = 0; i < H; ++i) {
          const float* w = W + i * H;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < H; ++j) acc += w[j] * x[j];
          acc += bias[i];
          y[i] = x[i] + acc / (1.0f + std::exp(-acc));  // x + SiLU(Wx + b)
        }
        std::swap(x, y);
      }
      float logit = a.out_bias[0];
#pragma omp simd reduction(+ : logit)
      for (int64_t j = 0; j < H; ++j) logit += a.out_weight[j] * x[j];
      const float p = 1.0f / (1.0f + std::exp(-logit));
      a.p_accept[b] = p;
      a.cum_accept[b] *= p;
      a.stop[b] = specdecpp_stop(a.cum_accept[b], a.step, a.k_min, a.k_max, a.threshold);
    }
  });
}

void acceptance_head_step(const HeadArgs& a) { SPECDEC_DISPATCH(a.dtype, head_step_impl, a); }

}  // namespace cpu
}  // namespace specdec
