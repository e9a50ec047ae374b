// CPU implementations of the specdec_ext ops: parallel over rows (at::parallel_for), vectorised
// over the vocabulary (omp simd reductions, which GCC vectorises without -ffast-math), and never
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
// written with plain arithmetic so that omp simd loops vectorise it.
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
  float mass(int64_t j) const {
    float d = ld(p, j) - ld(q, j);
    return d > 0.0f ? d : 0.0f;
  }
};

struct SoftmaxStats {
  float max;     // max_j x_j / T
  double sum;    // sum_j exp(x_j / T - max)
  float inv_sum; // (float)(1 / sum)
  bool ok;
};

template <typename T>
SoftmaxStats softmax_stats(const T* x, int64_t V, float inv_t) {
  float m = -std::numeric_limits<float>::infinity();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t j = 0; j < V; ++j) {
    float v = ld(x, j);
    bad |= !(v >= -3.4028234663852886e38f && v <= 3.4028234663852886e38f);
    float s = v * inv_t;
    m = s > m ? s : m;
  }
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < V; ++j) sum += exp_nonpos(ld(x, j) * inv_t - m);
  return {m, sum, static_cast<float>(1.0 / sum), bad == 0};
}

template <typename T>
struct SoftmaxRow {  // softmax(x / T), Eq. (1) with temperature
  const T* x;
  float inv_t;
  SoftmaxStats st;
  float mass(int64_t j) const { return exp_nonpos(ld(x, j) * inv_t - st.max) * st.inv_sum; }
};

template <typename T>
struct SoftmaxResidualRow {  // max(0, softmax(t/T) - softmax(d/T)) without writing either
  SoftmaxRow<T> p;
  SoftmaxRow<T> q;
  float mass(int64_t j) const {
    float d = p.mass(j) - q.mass(j);
    return d > 0.0f ? d : 0.0f;
  }
};

template <typename Row>
double total_mass(const Row& row, int64_t V) {
  double z = 0.0;
#pragma omp simd reduction(+ : z)
  for (int64_t j = 0; j < V; ++j) z += row.mass(j);
  return z;
}

// Inverse CDF: the first j with cumsum(mass)[j] >= u * total, accumulating in double. Because
// u > 0, the chosen j always has mass > 0. If rounding leaves the threshold unreached, the last
// j with positive mass is returned. Returns -1 only when every mass is zero.
template <typename Row>
int64_t inverse_cdf(const Row& row, int64_t V, double threshold) {
  double cum = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = b0; j < b1; ++j) s += row.mass(j);
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
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t j = 0; j < V; ++j) bad |= !valid_prob(ld(p, j));
  return bad == 0;
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
template <typename T>
static void chain_verify_impl(const VerifyArgs& args) {
  VerifyArgs a = args;
  a.rng = args.rng.resolve();
  const int64_t B = a.batch, K = a.k, V = a.vocab;
  const T* dp = static_cast<const T*>(a.draft);
  const T* tp = static_cast<const T*>(a.target);
  std::atomic<int64_t> error{0};
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = a.num_draft ? a.num_draft[b] : K;
      int64_t* out = a.out_ids + b * (K + 1);
      std::fill(out, out + K + 1, int64_t(-1));
      int64_t accepted = 0, extra = 0, code = 0;
      for (; accepted < n; ++accepted) {
        const int64_t tok = a.ids[b * K + accepted];
        if (tok < 0 || tok >= V) { code = kInvalidTokenId; break; }
        const float q = ld(dp + (b * K + accepted) * V, tok);
        const float p = ld(tp + (b * (K + 1) + accepted) * V, tok);
        if (!valid_prob(q)) { code = kInvalidDraftProbs; break; }
        if (!valid_prob(p)) { code = kInvalidTargetProbs; break; }
        const float u = a.rng.at(b, accepted);
        if (!uniform_ok(u)) { code = kInvalidUniform; break; }
        if (!accept_candidate(u, q, p)) break;
        out[accepted] = tok;
      }
      if (code == 0) {
        const float u = a.rng.at(b, n);
        if (!uniform_ok(u)) {
          code = kInvalidUniform;
        } else if (accepted < n) {  // rejection: residual distribution norm(max(0, p - q))
          extra = residual_or_target(tp + (b * (K + 1) + accepted) * V, dp + (b * K + accepted) * V, V, u);
        } else {  // every candidate accepted: bonus token from the target's next distribution
          const T* p = tp + (b * (K + 1) + n) * V;
          extra = row_valid(p, V) ? sample_row(ProbRow<T>{p}, V, u) : kInvalidTargetProbs;
        }
        if (extra < 0) code = extra;
      }
      if (code != 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, code);
        continue;
      }
      out[accepted] = extra;
      a.num_accepted[b] = accepted;
    }
  });
  if (error.load() != 0) check_code(error.load(), "chain_verify");
}

template <typename T>
static void chain_verify_logits_impl(const VerifyArgs& args) {
  VerifyArgs a = args;
  a.rng = args.rng.resolve();
  const int64_t B = a.batch, K = a.k, V = a.vocab;
  const T* dl = static_cast<const T*>(a.draft);
  const T* tl = static_cast<const T*>(a.target);
  std::atomic<int64_t> error{0};
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = a.num_draft ? a.num_draft[b] : K;
      const float temp = a.temperature[b];
      int64_t* out = a.out_ids + b * (K + 1);
      std::fill(out, out + K + 1, int64_t(-1));
      int64_t accepted = 0, extra = -1, code = 0;
      if (temp == 0.0f) {  // greedy verification: accept iff the candidate is the target's argmax
        for (;; ++accepted) {
          bool ok = true;
          const int64_t best = greedy_argmax(tl + (b * (K + 1) + accepted) * V, V, &ok);
          if (!ok) { code = kInvalidTargetProbs; break; }
          if (accepted == n) { extra = best; break; }
          const int64_t tok = a.ids[b * K + accepted];
          if (tok < 0 || tok >= V) { code = kInvalidTokenId; break; }
          if (tok != best) { extra = best; break; }
          out[accepted] = tok;
        }
      } else {
        const float inv_t = 1.0f / temp;
        for (; accepted < n; ++accepted) {
          const int64_t tok = a.ids[b * K + accepted];
          if (tok < 0 || tok >= V) { code = kInvalidTokenId; break; }
          const T* t_row = tl + (b * (K + 1) + accepted) * V;
          const T* d_row = dl + (b * K + accepted) * V;
          SoftmaxRow<T> p{t_row, inv_t, softmax_stats(t_row, V, inv_t)};
          SoftmaxRow<T> q{d_row, inv_t, softmax_stats(d_row, V, inv_t)};
          if (!p.st.ok) { code = kInvalidTargetProbs; break; }
          if (!q.st.ok) { code = kInvalidDraftProbs; break; }
          const float u = a.rng.at(b, accepted);
          if (!uniform_ok(u)) { code = kInvalidUniform; break; }
          if (!accept_candidate(u, q.mass(tok), p.mass(tok))) {
            const float u_final = a.rng.at(b, n);
            if (!uniform_ok(u_final)) { code = kInvalidUniform; break; }
            SoftmaxResidualRow<T> res{p, q};
            const double z = total_mass(res, V);
            extra = z > 0.0 ? inverse_cdf(res, V, static_cast<double>(u_final) * z) : sample_row(p, V, u_final);
            break;
          }
          out[accepted] = tok;
        }
        if (code == 0 && accepted == n) {
          const float u_final = a.rng.at(b, n);
          const T* t_row = tl + (b * (K + 1) + n) * V;
          SoftmaxRow<T> p{t_row, inv_t, softmax_stats(t_row, V, inv_t)};
          if (!uniform_ok(u_final)) code = kInvalidUniform;
          else if (!p.st.ok) code = kInvalidTargetProbs;
          else extra = sample_row(p, V, u_final);
        }
      }
      if (code == 0 && extra < 0) code = kInvalidTargetProbs;
      if (code != 0) {
        int64_t zero = 0;
        error.compare_exchange_strong(zero, code);
        continue;
      }
      out[accepted] = extra;
      a.num_accepted[b] = accepted;
    }
  });
  const int64_t e = error.load();
  if (e == kInvalidTargetProbs) TORCH_CHECK_VALUE(false, "chain_verify_logits: target_logits has a NaN or Inf value in a row it reads");
  if (e == kInvalidDraftProbs) TORCH_CHECK_VALUE(false, "chain_verify_logits: draft_logits has a NaN or Inf value in a row it reads");
  if (e != 0) check_code(e, "chain_verify_logits");
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
