// CUDA kernels of the specdec_ext ops. Torch-free (compiled by nvcc alone in CI).
//
// One thread block per batch row; 16-byte vectorised loads over the vocabulary; CUB block
// reductions (residual mass Z, softmax max/sum, argmax) and block scans (inverse CDF, tile by
// tile, stopping at the tile that reaches u * Z). Sums and prefix sums are double, like the CPU
// kernels and the reference. Acceptance decisions use kernels/common.h, shared with the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cfloat>
#include <cstdlib>
#include <cstring>

#include "cuda/launchers.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 4;  // consecutive elements per thread in an inverse-CDF tile
// The narrowest head (H) that takes the split head kernels (acceptance_head_workspace). On an H100 (bench/head_step.py,
// L = 3) the fused kernel took 110-120 us a call at H = 64 and 128, the split ones 125-135; at H = 256 163 against 130,
// and at H = 4096 about 20 ms against 0.6 ms.
constexpr int64_t kHeadSplitWidth = 256;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// Visit every element of a row: f(j, value). 16-byte loads when the row is aligned.
template <typename T, typename F>
__device__ __forceinline__ void row_foreach(const T* row, int64_t V, F&& f) {
  constexpr int VEC = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(row) % 16) == 0;
  const int64_t nvec = aligned ? V / VEC : 0;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    uint4 raw = reinterpret_cast<const uint4*>(row)[i];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f(i * VEC + k, to_f(e[k]));
  }
  for (int64_t j = nvec * VEC + threadIdx.x; j < V; j += blockDim.x) f(j, to_f(row[j]));
}

struct MaxOp {
  template <typename X>
  __device__ X operator()(const X& a, const X& b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename X>
  __device__ X operator()(const X& a, const X& b) const { return a < b ? a : b; }
};

using ReduceD = cub::BlockReduce<double, kThreads>;
using ReduceF = cub::BlockReduce<float, kThreads>;
using ScanD = cub::BlockScan<double, kThreads>;
struct ArgMax {
  float v;
  int64_t j;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return (b.v > a.v || (b.v == a.v && b.j < a.j)) ? b : a;  // first index of the maximum
  }
};
using ReduceArg = cub::BlockReduce<ArgMax, kThreads>;

union SharedTemp {
  typename ReduceD::TempStorage d;
  typename ReduceF::TempStorage f;
  typename ScanD::TempStorage scan;
  typename ReduceArg::TempStorage arg;
  typename cub::BlockReduce<int64_t, kThreads>::TempStorage i;
};

// ---------------------------------------------------------------- distributions over one row
template <typename T>
struct ProbRow {
  const T* p;
  __device__ float mass(int64_t j) const { return to_f(p[j]); }
};

template <typename T>
struct ResidualRow {
  const T* p;
  const T* q;
  __device__ float mass(int64_t j) const {
    const float d = to_f(p[j]) - to_f(q[j]);
    return d > 0.0f ? d : 0.0f;
  }
};

struct Softmax {
  float max;      // max_j x_j (raw logits)
  float inv_sum;
  int64_t code;   // 0, or bad_code (NaN / +Inf logit), or masked_code (every logit -inf)
};

// Logits may be -inf (masked tokens); NaN and +Inf are invalid.
__device__ __forceinline__ bool logit_ok(float v) { return v <= FLT_MAX; }

// exp((x - max) / T), written as (x - max) * (1 / T) so no multiply-add can be contracted (as on the CPU).
__device__ __forceinline__ float softmax_exp(float x, float mx, float inv_t) { return __expf(fminf((x - mx) * inv_t, 0.0f)); }

template <typename T>
struct SoftmaxRow {
  const T* x;
  float inv_t;
  Softmax st;
  __device__ float mass(int64_t j) const { return softmax_exp(to_f(x[j]), st.max, inv_t) * st.inv_sum; }
};

template <typename T>
struct SoftmaxResidualRow {
  SoftmaxRow<T> p, q;
  __device__ float mass(int64_t j) const {
    const float d = p.mass(j) - q.mass(j);
    return d > 0.0f ? d : 0.0f;
  }
};

template <typename T>
__device__ Softmax softmax_stats(const T* x, int64_t V, float inv_t, SharedTemp& tmp, int64_t bad_code,
                                 int64_t masked_code) {
  __shared__ float s_max;
  __shared__ double s_sum;
  float m = -INFINITY;
  int bad = 0;
  row_foreach(x, V, [&](int64_t, float v) {
    bad |= !logit_ok(v);
    m = fmaxf(m, v);
  });
  bad = __syncthreads_or(bad);
  float bm = ReduceF(tmp.f).Reduce(m, MaxOp());
  if (threadIdx.x == 0) s_max = bm;
  __syncthreads();
  const float mx = s_max;
  if (bad) return {mx, 0.0f, bad_code};
  if (!(mx > -FLT_MAX)) return {mx, 0.0f, masked_code};
  double s = 0.0;
  row_foreach(x, V, [&](int64_t, float v) { s += softmax_exp(v, mx, inv_t); });
  double bs = ReduceD(tmp.d).Sum(s);
  if (threadIdx.x == 0) s_sum = bs;
  __syncthreads();
  return {mx, static_cast<float>(1.0 / s_sum), 0};
}

template <typename Row>
__device__ double total_mass(const Row& row, int64_t V, SharedTemp& tmp) {
  __shared__ double s_total;
  double z = 0.0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) z += row.mass(j);
  const double bz = ReduceD(tmp.d).Sum(z);
  if (threadIdx.x == 0) s_total = bz;
  __syncthreads();
  return s_total;
}

// First j with prefix(mass)[j] >= threshold and mass[j] > 0, tile by tile (kThreads * kItems
// elements), stopping at the first tile that reaches the threshold. Falls back to the last j
// with positive mass. Result valid in every thread.
template <typename Row>
__device__ int64_t inverse_cdf(const Row& row, int64_t V, double threshold, SharedTemp& tmp) {
  __shared__ int64_t s_found;
  __shared__ double s_cum;
  if (threadIdx.x == 0) { s_found = INT64_MAX; s_cum = 0.0; }
  __syncthreads();
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kItems;
  for (int64_t t0 = 0; t0 < V; t0 += kTile) {
    const int64_t j0 = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
    float m[kItems];
    double local = 0.0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      m[k] = (j0 + k < V) ? row.mass(j0 + k) : 0.0f;
      local += m[k];
    }
    double excl, tile_total;
    ScanD(tmp.scan).ExclusiveSum(local, excl, tile_total);
    double cum = s_cum + excl;
    int64_t mine = INT64_MAX;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      cum += m[k];
      if (mine == INT64_MAX && m[k] > 0.0f && cum >= threshold) mine = j0 + k;
    }
    __syncthreads();
    const int64_t first = cub::BlockReduce<int64_t, kThreads>(tmp.i).Reduce(mine, MinOp());
    if (threadIdx.x == 0) { s_found = first; s_cum += tile_total; }
    __syncthreads();
    if (s_found != INT64_MAX) return s_found;
  }
  int64_t last = -1;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    if (row.mass(j) > 0.0f) last = j > last ? j : last;
  const int64_t bl = cub::BlockReduce<int64_t, kThreads>(tmp.i).Reduce(last, MaxOp());
  if (threadIdx.x == 0) s_found = bl;
  __syncthreads();
  return s_found;
}

// A probability row read in full: 0 if finite, >= 0 and summing to 1 within tol; else bad_code, kZeroMass
// or sum_code (as the CPU kernels). Result valid in every thread.
template <typename T>
__device__ int64_t check_prob_row(const T* p, int64_t V, float tol, int64_t bad_code, int64_t sum_code, SharedTemp& tmp) {
  __shared__ double s_sum;
  double s = 0.0;
  int bad = 0;
  row_foreach(p, V, [&](int64_t, float v) {
    bad |= !valid_prob(v);
    s += v;
  });
  bad = __syncthreads_or(bad);
  const double bs = ReduceD(tmp.d).Sum(s);
  if (threadIdx.x == 0) s_sum = bs;
  __syncthreads();
  if (bad) return bad_code;
  if (s_sum == 0.0) return kZeroMass;
  return fabs(s_sum - 1.0) <= tol ? 0 : sum_code;
}

template <typename Row>
__device__ int64_t sample_row(const Row& row, int64_t V, float u, SharedTemp& tmp) {
  const double z = total_mass(row, V, tmp);
  return inverse_cdf(row, V, static_cast<double>(u) * z, tmp);
}

__device__ __forceinline__ bool uniform_ok(float u) { return u > 0.0f && u <= 1.0f; }

// ------------------------------------------------------------------------------- kernels
// Row b's outputs: the accepted prefix, the extra token, -1 padding (written at kernel start), or
// the InvalidInput code in num_accepted[b].
__device__ __forceinline__ void finish_row(const VerifyArgs& a, int64_t b, int64_t acc, int64_t extra, int64_t code) {
  if (threadIdx.x != 0) return;
  if (code == 0 && extra < 0) code = kZeroMass;
  if (code != 0) {
    a.num_accepted[b] = code;
    return;
  }
  int64_t* out = a.out_ids + b * (a.k + 1);
  for (int64_t i = 0; i < acc; ++i) out[i] = a.ids[b * a.k + i];
  out[acc] = extra;
  a.num_accepted[b] = acc;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) chain_verify_kernel(VerifyArgs a) {
  __shared__ SharedTemp tmp;
  __shared__ int64_t s_accepted, s_code;
  const int64_t b = blockIdx.x, K = a.k, V = a.vocab;
  const float tol = sum_tolerance(a.dtype);
  const UniformSource rng = a.rng.resolve();
  const T* dp = static_cast<const T*>(a.draft);
  const T* tp = static_cast<const T*>(a.target);
  const int64_t n = a.num_draft ? a.num_draft[b] : K;
  int64_t* out = a.out_ids + b * (K + 1);
  for (int64_t j = threadIdx.x; j <= K; j += blockDim.x) out[j] = -1;
  int64_t code = (n < 0 || n > K) ? int64_t(kInvalidNumDraft) : 0;
  if (code == 0 && a.validate) {  // every row the op may read, in full
    for (int64_t i = 0; code == 0 && i <= n; ++i) {
      code = check_prob_row(tp + (b * (K + 1) + i) * V, V, tol, kInvalidTarget, kTargetSum, tmp);
      if (code == 0 && i < n) code = check_prob_row(dp + (b * K + i) * V, V, tol, kInvalidDraft, kDraftSum, tmp);
    }
  }
  if (threadIdx.x == 0) {  // the acceptance tests read two numbers each: one thread walks the chain
    int64_t acc = 0, c = code;
    for (; c == 0 && acc < n; ++acc) {
      const int64_t tok = a.ids[b * K + acc];
      if (tok < 0 || tok >= V) { c = kInvalidTokenId; break; }
      const float q = to_f(dp[(b * K + acc) * V + tok]);
      const float p = to_f(tp[(b * (K + 1) + acc) * V + tok]);
      const float u = rng.at(b, acc);
      if (!valid_prob(q)) c = kInvalidDraft;
      else if (!valid_prob(p)) c = kInvalidTarget;
      else if (!uniform_ok(u)) c = kInvalidUniform;
      else if (!accept_candidate(u, q, p)) break;
    }
    s_accepted = acc;
    s_code = c;
  }
  __syncthreads();
  const int64_t acc = s_accepted;
  code = s_code;
  int64_t extra = -1;
  const float u = code == 0 ? rng.at(b, n) : 1.0f;
  if (code == 0 && !uniform_ok(u)) code = kInvalidUniform;
  if (code == 0) {
    const T* p = tp + (b * (K + 1) + acc) * V;
    code = check_prob_row(p, V, tol, kInvalidTarget, kTargetSum, tmp);
    if (code == 0 && acc < n) {  // rejection: residual distribution; both rows read in full
      const T* q = dp + (b * K + acc) * V;
      code = check_prob_row(q, V, tol, kInvalidDraft, kDraftSum, tmp);
      if (code == 0) {
        ResidualRow<T> res{p, q};
        const double z = total_mass(res, V, tmp);
        extra = z > 0.0 ? inverse_cdf(res, V, static_cast<double>(u) * z, tmp) : sample_row(ProbRow<T>{p}, V, u, tmp);
      }
    } else if (code == 0) {
      extra = sample_row(ProbRow<T>{p}, V, u, tmp);
    }
  }
  finish_row(a, b, acc, extra, code);
}

template <typename T>
__device__ int64_t block_argmax(const T* x, int64_t V, int64_t* code, SharedTemp& tmp) {
  __shared__ ArgMax s_best;
  ArgMax best{-INFINITY, INT64_MAX};
  int bad = 0;
  row_foreach(x, V, [&](int64_t j, float v) {
    bad |= !logit_ok(v);
    if (v > best.v || (v == best.v && j < best.j)) best = {v, j};
  });
  bad = __syncthreads_or(bad);
  const ArgMax r = ReduceArg(tmp.arg).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) s_best = r;
  __syncthreads();
  *code = bad ? int64_t(kInvalidTarget) : (s_best.v > -FLT_MAX ? 0 : int64_t(kMaskedTarget));
  return s_best.j == INT64_MAX ? 0 : s_best.j;
}

// Greedy verification of row b (as the CPU's greedy_row): candidate i accepted iff it is the argmax of
// target row i; the argmax at the first mismatch, or the bonus argmax, is emitted.
template <typename T>
__device__ void greedy_row(const VerifyArgs& a, const T* tl, int64_t b, int64_t n, SharedTemp& tmp, int64_t* acc,
                           int64_t* extra, int64_t* code) {
  const int64_t K = a.k, V = a.vocab;
  for (;; ++*acc) {
    int64_t c = 0;
    const int64_t best = block_argmax(tl + (b * (K + 1) + *acc) * V, V, &c, tmp);
    if (c != 0) { *code = c; return; }
    if (*acc == n) { *extra = best; return; }
    const int64_t tok = a.ids[b * K + *acc];
    if (tok < 0 || tok >= V) { *code = kInvalidTokenId; return; }
    if (tok != best) { *extra = best; return; }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) chain_verify_greedy_kernel(VerifyArgs a) {
  __shared__ SharedTemp tmp;
  const int64_t b = blockIdx.x, K = a.k;
  const T* tl = static_cast<const T*>(a.target);
  const int64_t n = a.num_draft ? a.num_draft[b] : K;
  int64_t* out = a.out_ids + b * (K + 1);
  for (int64_t j = threadIdx.x; j <= K; j += blockDim.x) out[j] = -1;
  __syncthreads();
  int64_t acc = 0, extra = -1, code = (n < 0 || n > K) ? int64_t(kInvalidNumDraft) : 0;
  if (code == 0) greedy_row(a, tl, b, n, tmp, &acc, &extra, &code);
  finish_row(a, b, acc, extra, code);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) chain_verify_logits_kernel(VerifyArgs a) {
  __shared__ SharedTemp tmp;
  const int64_t b = blockIdx.x, K = a.k, V = a.vocab;
  const UniformSource rng = a.rng.resolve();
  const T* dl = static_cast<const T*>(a.draft);
  const T* tl = static_cast<const T*>(a.target);
  const int64_t n = a.num_draft ? a.num_draft[b] : K;
  const float temp = a.temperature[b];
  int64_t* out = a.out_ids + b * (K + 1);
  for (int64_t j = threadIdx.x; j <= K; j += blockDim.x) out[j] = -1;
  __syncthreads();
  int64_t acc = 0, extra = -1, code = (n < 0 || n > K) ? int64_t(kInvalidNumDraft) : 0;
  if (code == 0 && temp != 0.0f && !(temp >= kMinTemperature && logit_ok(temp))) code = kInvalidTemperature;
  const float inv_t = temp == 0.0f ? 1.0f : 1.0f / temp;
  if (code == 0 && a.validate) {  // every row the op may read, in full
    for (int64_t i = 0; code == 0 && i <= n; ++i) {
      code = softmax_stats(tl + (b * (K + 1) + i) * V, V, inv_t, tmp, kInvalidTarget, kMaskedTarget).code;
      if (code == 0 && i < n && temp != 0.0f)
        code = softmax_stats(dl + (b * K + i) * V, V, inv_t, tmp, kInvalidDraft, kMaskedDraft).code;
    }
  }
  if (code == 0 && temp == 0.0f) {  // greedy row
    greedy_row(a, tl, b, n, tmp, &acc, &extra, &code);
  } else if (code == 0) {
    for (; acc < n; ++acc) {
      const int64_t tok = a.ids[b * K + acc];
      if (tok < 0 || tok >= V) { code = kInvalidTokenId; break; }
      SoftmaxRow<T> p{tl + (b * (K + 1) + acc) * V, inv_t,
                      softmax_stats(tl + (b * (K + 1) + acc) * V, V, inv_t, tmp, kInvalidTarget, kMaskedTarget)};
      if (p.st.code != 0) { code = p.st.code; break; }
      SoftmaxRow<T> q{dl + (b * K + acc) * V, inv_t,
                      softmax_stats(dl + (b * K + acc) * V, V, inv_t, tmp, kInvalidDraft, kMaskedDraft)};
      if (q.st.code != 0) { code = q.st.code; break; }
      const float u = rng.at(b, acc);
      if (!uniform_ok(u)) { code = kInvalidUniform; break; }
      if (!accept_candidate(u, q.mass(tok), p.mass(tok))) {
        const float uf = rng.at(b, n);
        if (!uniform_ok(uf)) { code = kInvalidUniform; break; }
        SoftmaxResidualRow<T> res{p, q};
        const double z = total_mass(res, V, tmp);
        extra = z > 0.0 ? inverse_cdf(res, V, static_cast<double>(uf) * z, tmp) : sample_row(p, V, uf, tmp);
        break;
      }
    }
    if (code == 0 && acc == n) {
      const float uf = rng.at(b, n);
      const T* row = tl + (b * (K + 1) + n) * V;
      SoftmaxRow<T> p{row, inv_t, softmax_stats(row, V, inv_t, tmp, kInvalidTarget, kMaskedTarget)};
      if (!uniform_ok(uf)) code = kInvalidUniform;
      else if (p.st.code != 0) code = p.st.code;
      else extra = sample_row(p, V, uf, tmp);
    }
  }
  finish_row(a, b, acc, extra, code);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) residual_sample_kernel(ResidualArgs a) {
  __shared__ SharedTemp tmp;
  const int64_t b = blockIdx.x, V = a.vocab;
  const UniformSource rng = a.rng.resolve();
  const T* p = static_cast<const T*>(a.target) + b * V;
  const T* q = static_cast<const T*>(a.draft) + b * V;
  const float u = rng.at(b, 0);
  const float tol = sum_tolerance(a.dtype);
  int64_t r = uniform_ok(u) ? 0 : int64_t(kInvalidUniform);
  if (r == 0) r = check_prob_row(p, V, tol, kInvalidTarget, kTargetSum, tmp);
  if (r == 0) r = check_prob_row(q, V, tol, kInvalidDraft, kDraftSum, tmp);
  if (r == 0) {
    ResidualRow<T> res{p, q};
    const double z = total_mass(res, V, tmp);
    r = z > 0.0 ? inverse_cdf(res, V, static_cast<double>(u) * z, tmp) : sample_row(ProbRow<T>{p}, V, u, tmp);
    if (r < 0) r = kZeroMass;
  }
  if (threadIdx.x == 0) a.out[b] = r;
}

// Acceptance head. x_0 = hidden + W_f features + b_f, element i of row b (both parts optional).
template <typename T>
__device__ __forceinline__ float head_input(const HeadArgs& a, int64_t b, int64_t i) {
  const int64_t H = a.hidden_size, F = a.num_features;
  float v = a.hidden != nullptr ? to_f(static_cast<const T*>(a.hidden)[b * H + i]) : 0.0f;
  if (F > 0) {
    v += a.feature_bias[i];
    for (int64_t j = 0; j < F; ++j) v += a.feature_weight[i * F + j] * a.features[b * F + j];
  }
  return v;
}

// The head's last step for row b, by one thread: p_hat = sigmoid(logit), the running product, the stop rule.
// A kernel cannot raise: a row whose p_hat or running product is not finite gets p_accept = NaN and
// stop = true (drafting stops), and the Python wrapper raises on it.
__device__ __forceinline__ void head_finish(const HeadArgs& a, int64_t b, float logit) {
  const float p = sigmoidf_(logit);
  const float c = a.cum_accept[b] * p;
  const bool ok = finite_f(logit) && finite_f(c);
  a.p_accept[b] = ok ? p : __int_as_float(0x7fc00000);
  a.cum_accept[b] = c;
  a.stop[b] = ok ? head_row_stop(a, b, c) : true;
}

// Fused: one block per row, x in shared memory, one warp per output feature. One launch, but each block reads
// every layer's H x H weights alone, one dependent load after another per warp, so its time grows as H^2 on one
// SM; wide heads take the split kernels below (acceptance_head_workspace).
template <typename T>
__global__ void __launch_bounds__(kThreads) head_step_kernel(HeadArgs a) {
  extern __shared__ float smem[];
  __shared__ typename ReduceF::TempStorage red;
  const int64_t b = blockIdx.x, H = a.hidden_size;
  float* x = smem;
  float* y = smem + H;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) x[i] = head_input<T>(a, b, i);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const float* W = a.block_weight + l * H * H;
    for (int64_t i = warp; i < H; i += warps) {
      float acc = 0.0f;
      for (int64_t j = lane; j < H; j += 32) acc += W[i * H + j] * x[j];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
      if (lane == 0) {
        acc += a.block_bias[l * H + i];
        y[i] = x[i] + acc / (1.0f + __expf(-acc));
      }
    }
    __syncthreads();
    float* t = x; x = y; y = t;
  }
  float part = 0.0f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) part += a.out_weight[j] * x[j];
  const float logit = ReduceF(red).Sum(part) + a.out_bias[0];
  if (threadIdx.x == 0) head_finish(a, b, logit);
}

// Split: x_l lives in the float32 workspace [2, B, H] (layer l reads half l % 2, writes the other); a launch per
// stage. head_input_kernel: grid (B, ceil(H / kThreads)), a thread per element of x_0.
template <typename T>
__global__ void __launch_bounds__(kThreads) head_input_kernel(HeadArgs a) {
  const int64_t b = blockIdx.x, i = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (i < a.hidden_size) a.workspace[b * a.hidden_size + i] = head_input<T>(a, b, i);
}

// One residual block: grid (ceil(B / kHeadRows), ceil(H / warps)), a warp per output feature i and kHeadRows rows,
// so that the blocks spread over the GPU and each weight row is read once per kHeadRows rows (coalesced).
constexpr int kHeadRows = 4;
__global__ void __launch_bounds__(kThreads) head_layer_kernel(HeadArgs a, int64_t l) {
  const int64_t H = a.hidden_size, B = a.batch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i = blockIdx.y * int64_t(blockDim.x / 32) + warp, b0 = blockIdx.x * int64_t(kHeadRows);
  if (i >= H) return;  // a whole warp: no block-wide synchronisation follows
  const float* x = a.workspace + (l % 2) * B * H;
  float* y = a.workspace + ((l + 1) % 2) * B * H;
  const float* w = a.block_weight + (l * H + i) * H;
  const int rows = static_cast<int>(B - b0 < kHeadRows ? B - b0 : kHeadRows);
  float acc[kHeadRows] = {};
  for (int64_t j = lane; j < H; j += 32) {
    const float wj = __ldg(w + j);
#pragma unroll
    for (int r = 0; r < kHeadRows; ++r)
      if (r < rows) acc[r] += wj * x[(b0 + r) * H + j];
  }
#pragma unroll
  for (int r = 0; r < kHeadRows; ++r) {
    float v = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0 && r < rows) {
      v += a.block_bias[l * H + i];
      y[(b0 + r) * H + i] = x[(b0 + r) * H + i] + v / (1.0f + __expf(-v));
    }
  }
}

// The output layer and the stop rule: one block per row.
__global__ void __launch_bounds__(kThreads) head_output_kernel(HeadArgs a) {
  __shared__ typename ReduceF::TempStorage red;
  const int64_t b = blockIdx.x, H = a.hidden_size;
  const float* x = a.workspace + (a.num_layers % 2) * a.batch * H + b * H;
  float part = 0.0f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) part += a.out_weight[j] * x[j];
  const float logit = ReduceF(red).Sum(part) + a.out_bias[0];
  if (threadIdx.x == 0) head_finish(a, b, logit);
}

// Draft-confidence features (as the CPU kernel): one block per row; the two largest values by a block
// reduction of (top1, top2) pairs, then the sums in double.
struct Top2 {
  float a, b;  // a >= b
};
struct Top2Op {
  __device__ Top2 operator()(const Top2& x, const Top2& y) const {
    const float hi = fmaxf(x.a, y.a);
    const float lo = fmaxf(fminf(x.a, y.a), fmaxf(x.b, y.b));
    return {hi, lo};
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) confidence_kernel(ConfidenceArgs a) {
  __shared__ SharedTemp tmp;
  __shared__ typename cub::BlockReduce<Top2, kThreads>::TempStorage tmp2;
  __shared__ Top2 s_top;
  __shared__ double s_z, s_x;
  const int64_t b = blockIdx.x, V = a.vocab;
  const T* x = static_cast<const T*>(a.dist) + b * V;
  const int64_t y = a.tokens[b];
  Top2 t{-INFINITY, -INFINITY};
  int bad = 0;
  row_foreach(x, V, [&](int64_t, float v) {
    bad |= a.logits ? !logit_ok(v) : !valid_prob(v);
    if (v > t.a) { t.b = t.a; t.a = v; } else if (v > t.b) { t.b = v; }
  });
  bad = __syncthreads_or(bad);
  const Top2 r = cub::BlockReduce<Top2, kThreads>(tmp2).Reduce(t, Top2Op());
  if (threadIdx.x == 0) s_top = r;
  __syncthreads();
  int64_t code = (y < 0 || y >= V) ? int64_t(kInvalidTokenId) : (bad ? int64_t(kInvalidDraft) : 0);
  if (code == 0 && a.logits && !(s_top.a > -FLT_MAX)) code = kMaskedDraft;
  double z = 0.0, sx = 0.0;
  if (code == 0) {
    const float m = s_top.a;
    row_foreach(x, V, [&](int64_t, float v) {
      if (a.logits) {
        const float d = fminf(v - m, 0.0f);
        const float e = __expf(d);
        z += e;
        sx += e > 0.0f ? e * d : 0.0f;
      } else {
        sx += v > 0.0f ? -v * logf(v) : 0.0f;
      }
    });
    const double bz = ReduceD(tmp.d).Sum(z);
    __syncthreads();
    const double bx = ReduceD(tmp.d).Sum(sx);
    if (threadIdx.x == 0) { s_z = bz; s_x = bx; }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  a.code[b] = code;
  float* out = a.out + b * 3;
  if (code != 0) {
    out[0] = out[1] = out[2] = __int_as_float(0x7fc00000);
    return;
  }
  if (a.logits) {
    const float m = s_top.a;
    out[0] = static_cast<float>(__expf(fminf(to_f(x[y]) - m, 0.0f)) / s_z);
    out[1] = static_cast<float>((1.0 - __expf(fminf(s_top.b - m, 0.0f))) / s_z);
    out[2] = static_cast<float>(log(s_z) - s_x / s_z);
  } else {
    out[0] = to_f(x[y]);
    out[1] = s_top.a - fmaxf(s_top.b, 0.0f);  // V = 1: no second entry, probability 0
    out[2] = static_cast<float>(s_x);
  }
}

// One thread per row: the next round's inputs from this round's emitted tokens (kernels/args.h, advance_row).
__global__ void advance_rows_kernel(AdvanceArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < a.rows) advance_row(a, b);
}

// One thread per uniform: out[b, j] from row b's own (seed, offset), read from device memory (capturable).
__global__ void philox_uniforms_kernel(PhiloxArgs a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.batch * a.slots) return;
  const int64_t b = i / a.slots, j = i % a.slots;
  a.out[i] = philox_uniform(static_cast<uint64_t>(a.seed_offsets[2 * b]), static_cast<uint64_t>(a.seed_offsets[2 * b + 1]),
                            0u, static_cast<uint32_t>(a.first_slot + j));
}

template <template <typename> class Kernel, typename Args>
cudaError_t launch(const Args& a, DType dtype, size_t smem, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.batch)), block(kThreads);
  switch (dtype) {
    case DType::kFloat32: Kernel<float>::launch(grid, block, smem, stream, a); break;
    case DType::kBFloat16: Kernel<__nv_bfloat16>::launch(grid, block, smem, stream, a); break;
    case DType::kFloat16: Kernel<__half>::launch(grid, block, smem, stream, a); break;
  }
  return cudaGetLastError();
}

#define SPECDEC_KERNEL_LAUNCHER(NAME, KERNEL, ARGS)                                                  \
  template <typename T>                                                                              \
  struct NAME {                                                                                      \
    static void launch(dim3 g, dim3 b, size_t smem, cudaStream_t s, const ARGS& a) {                 \
      KERNEL<T><<<g, b, smem, s>>>(a);                                                               \
    }                                                                                                \
  };
SPECDEC_KERNEL_LAUNCHER(VerifyK, chain_verify_kernel, VerifyArgs)
SPECDEC_KERNEL_LAUNCHER(VerifyLogitsK, chain_verify_logits_kernel, VerifyArgs)
SPECDEC_KERNEL_LAUNCHER(VerifyGreedyK, chain_verify_greedy_kernel, VerifyArgs)
SPECDEC_KERNEL_LAUNCHER(ResidualK, residual_sample_kernel, ResidualArgs)
SPECDEC_KERNEL_LAUNCHER(HeadK, head_step_kernel, HeadArgs)
SPECDEC_KERNEL_LAUNCHER(HeadInputK, head_input_kernel, HeadArgs)
SPECDEC_KERNEL_LAUNCHER(ConfidenceK, confidence_kernel, ConfidenceArgs)

}  // namespace

cudaError_t chain_verify(const VerifyArgs& a, cudaStream_t s) { return launch<VerifyK>(a, a.dtype, 0, s); }
cudaError_t chain_verify_logits(const VerifyArgs& a, cudaStream_t s) { return launch<VerifyLogitsK>(a, a.dtype, 0, s); }
cudaError_t chain_verify_greedy(const VerifyArgs& a, cudaStream_t s) { return launch<VerifyGreedyK>(a, a.dtype, 0, s); }
cudaError_t residual_sample(const ResidualArgs& a, cudaStream_t s) { return launch<ResidualK>(a, a.dtype, 0, s); }
cudaError_t confidence_features(const ConfidenceArgs& a, cudaStream_t s) { return launch<ConfidenceK>(a, a.dtype, 0, s); }
cudaError_t advance_rows(const AdvanceArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  advance_rows_kernel<<<static_cast<unsigned>((a.rows + kThreads - 1) / kThreads), kThreads, 0, s>>>(a);
  return cudaGetLastError();
}
cudaError_t philox_uniforms(const PhiloxArgs& a, cudaStream_t s) {
  const int64_t n = a.batch * a.slots;
  if (n == 0) return cudaSuccess;
  philox_uniforms_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(a);
  return cudaGetLastError();
}
int64_t acceptance_head_workspace(int64_t batch, int64_t hidden_size, int64_t num_layers) {
  const char* force = std::getenv("SPECDEC_HEAD_KERNEL");
  bool split = num_layers > 0 && hidden_size >= kHeadSplitWidth;
  if (force != nullptr && force[0] != '\0') {
    if (std::strcmp(force, "fused") == 0) {
      split = false;
    } else if (std::strcmp(force, "split") == 0) {
      split = true;
    } else {
      return -1;  // neither: the binding refuses it, naming the variable
    }
  }
  return split ? 2 * batch * hidden_size : 0;
}

cudaError_t acceptance_head_step(const HeadArgs& a, cudaStream_t s) {
  if (a.workspace != nullptr) {  // split: a launch per stage
    if (a.batch == 0) return cudaSuccess;
    const int64_t H = a.hidden_size, warps = kThreads / 32;
    const dim3 input(static_cast<unsigned>(a.batch), static_cast<unsigned>((H + kThreads - 1) / kThreads));
    const dim3 layer(static_cast<unsigned>((a.batch + kHeadRows - 1) / kHeadRows),
                     static_cast<unsigned>((H + warps - 1) / warps));
    switch (a.dtype) {
      case DType::kFloat32: HeadInputK<float>::launch(input, kThreads, 0, s, a); break;
      case DType::kBFloat16: HeadInputK<__nv_bfloat16>::launch(input, kThreads, 0, s, a); break;
      case DType::kFloat16: HeadInputK<__half>::launch(input, kThreads, 0, s, a); break;
    }
    for (int64_t l = 0; l < a.num_layers; ++l) head_layer_kernel<<<layer, kThreads, 0, s>>>(a, l);
    head_output_kernel<<<static_cast<unsigned>(a.batch), kThreads, 0, s>>>(a);
    return cudaGetLastError();
  }
  const size_t smem = 2 * static_cast<size_t>(a.hidden_size) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(head_step_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(head_step_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(head_step_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  return launch<HeadK>(a, a.dtype, smem, s);
}

}  // namespace cuda
}  // namespace specdec
