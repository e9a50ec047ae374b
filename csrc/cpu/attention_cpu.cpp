// CPU kernel of decode_attention: attention of a few queries per row (a decode step, or a verification pass
// over K + 1 positions) over a KV cache that may hold left padding and holes (rejected candidates).
//
// Why a kernel of its own: torch's fused CPU attention (the flash kernel behind scaled_dot_product_attention)
// takes 4-6x longer than matmul-softmax-matmul for one query per row in bfloat16 (bench/attention_cpu.py), and
// the explicit form copies a strided cache into contiguous tensors first. This kernel reads the cache where it
// lies, each key and value row once per KV head for all the queries that share it (grouped-query attention),
// and skips the columns no query may see, so padding costs neither memory traffic nor arithmetic.
//
// Per (row b, KV head): pass 1 gathers the columns some query sees and their scores q.k * scale (float32
// accumulation); then per query the maximum, exp(s - max) and the normaliser l; pass 2 accumulates
// sum_c exp(s_c - max) v_c, divided by l at the end. A query that sees no column gets zeros. A query's output is
// bitwise the same whatever the other queries of its call (fixed lanes, explicit fused multiply-adds, sums padded
// with zeros): a one-token step and a verification of K + 1 tokens agree exactly, so greedy speculative decoding
// equals target-only decoding even at near-ties.
//
// Without a mask (cache_attention, decoder_layer) the visibility is causal from each row's start: query i of row b
// sees the columns 0 .. min(starts[b] + i, C - 1), and the columns past the last one any query sees are not read.
#include "cpu/attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/cpu_math.h"

namespace specdec {
namespace cpu {
namespace {

constexpr int kDotLanes = 8;
constexpr int kSumLanes = 8;

// Row of D elements as float32 (bfloat16: the upper 16 bits of a float32, so a shift that vectorises).
template <typename T>
inline void load_row(const T* p, int64_t D, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, p, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t bits = static_cast<uint32_t>(u[d]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      out[d] = f;
    }
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d]);
  }
}

// out[c * ldo + x] = q_x . k_c for X rows q_x of q and NC rows k_c of k (both row stride D), X x NC independent
// chains sharing each load. Every (row, column) sums the same way whatever X and NC: lane l adds d = l, l + kDotLanes,
// ... in order, then the lanes in a fixed tree, then the tail: a query's scores are bitwise the same in a one-token
// step and in a verification of K + 1 tokens. Two columns at a time keep a single query row from waiting on one
// chain's multiply-add latency.
template <int X, int NC>
SPECDEC_ALWAYS_INLINE void dot_block(const float* q, const float* k, int64_t D, float* out, int64_t ldo) {
  float acc[NC][X][kDotLanes] = {};
  int64_t d = 0;
  for (; d + kDotLanes <= D; d += kDotLanes)
    for (int c = 0; c < NC; ++c)
      for (int x = 0; x < X; ++x)
        for (int l = 0; l < kDotLanes; ++l)
          acc[c][x][l] = mul_add(q[x * D + d + l], k[c * D + d + l], acc[c][x][l]);
  for (int c = 0; c < NC; ++c)
    for (int x = 0; x < X; ++x) {
      float tail = 0.0f;
      for (int64_t t = d; t < D; ++t) tail = mul_add(q[x * D + t], k[c * D + t], tail);
      for (int w = kDotLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[c][x][l] += acc[c][x][l + w];
      out[c * ldo + x] = acc[c][x][0] + tail;
    }
}

// out[c * R + r] = q_r . k_c for the R rows q_r of q and NC rows k_c of k (row stride D), four rows at a time.
template <int NC>
SPECDEC_ALWAYS_INLINE void dot_rows(const float* q, int64_t R, const float* k, int64_t D, float* out) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_block<4, NC>(q + r * D, k, D, out + r, R);
  switch (R - r) {
    case 3: dot_block<3, NC>(q + r * D, k, D, out + r, R); break;
    case 2: dot_block<2, NC>(q + r * D, k, D, out + r, R); break;
    case 1: dot_block<1, NC>(q + r * D, k, D, out + r, R); break;
    default: break;
  }
}

// The tasks [begin, end) of decode_attention_impl: (row b, KV head, part of its query rows), `parts` parts a pair.
template <typename T>
SPECDEC_CPU_CLONES void attention_tasks(const DecodeAttentionArgs& a, int64_t parts, int64_t begin, int64_t end) {
  const int64_t Hq = a.q_heads, Hkv = a.kv_heads, G = Hq / Hkv, n = a.queries, C = a.columns, D = a.head_dim;
  const int64_t R = G * n;  // query rows per KV head: (g, i) -> head kh * G + g, query i
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t out_rows = a.out_row_stride > 0 ? a.out_row_stride : Hq * D;
  const int64_t stride = (C + kSumLanes - 1) / kSumLanes * kSumLanes;  // a query's scores, padded
  std::vector<float> qf(R * D), row(2 * D), dots(2 * R), scores(R * stride), acc(R * D), norm(R);
  std::vector<int64_t> cols(C);
  std::vector<const bool*> mrow(R);
  std::vector<int64_t> last(R);  // without a mask: the last column each query row sees
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / (Hkv * parts), kh = task / parts % Hkv, part = task % parts;
    const int64_t r0 = R * part / parts, Rt = R * (part + 1) / parts - r0;  // this part's rows r0 .. r0 + Rt - 1
    for (int64_t r = 0; r < Rt; ++r) {
      const int64_t h = kh * G + (r0 + r) / n, i = (r0 + r) % n;
      load_row(q + b * a.q_stride[0] + h * a.q_stride[1] + i * a.q_stride[2], D, &qf[r * D]);
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= a.scale;
      if (a.mask != nullptr) {
        mrow[r] = a.mask + b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2];
      } else {
        last[r] = std::min(a.starts[b] + i, C - 1);  // below 0: sees none
      }
    }
    const int64_t kv_row = a.rows != nullptr ? a.rows[b] : b;
    const T* kb = k + kv_row * a.k_stride[0] + kh * a.k_stride[1];
    const T* vb = v + kv_row * a.v_stride[0] + kh * a.v_stride[1];
    const int64_t mc = a.mask_stride[3];
    const bool masked = a.mask != nullptr;
    const int64_t stop = masked ? C : *std::max_element(last.begin(), last.begin() + Rt) + 1;
    // pass 1: the columns some query sees, and their scores (-inf where that query may not look), two at a time
    int64_t m = 0;
    for (int64_t c = 0; c < stop; ++c) {
      bool any = !masked;  // causal: every column up to the last one some query sees
      if (masked)
        for (int64_t r = 0; r < Rt; ++r) any |= mrow[r][c * mc];
      if (any) cols[m++] = c;
    }
    for (int64_t j = 0; j < m; j += 2) {
      const int64_t nc = std::min<int64_t>(2, m - j);
      for (int64_t c = 0; c < nc; ++c) load_row(kb + cols[j + c] * a.k_stride[2], D, &row[c * D]);
      if (nc == 2) {
        dot_rows<2>(qf.data(), Rt, row.data(), D, dots.data());
      } else {
        dot_rows<1>(qf.data(), Rt, row.data(), D, dots.data());
      }
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t r = 0; r < Rt; ++r) {
          const int64_t col = cols[j + c];
          scores[r * stride + j + c] = (masked ? mrow[r][col * mc] : col <= last[r]) ? dots[c * Rt + r] : kNegInf;
        }
    }
    // softmax weights per query row, unnormalised: exp(s - max); norm = their sum, column j in lane j % kSumLanes
    // (the columns past m, up to a multiple of kSumLanes, add zeros: a query's sum does not depend on how many
    // columns the other queries of its call see)
    const int64_t padded = (m + kSumLanes - 1) / kSumLanes * kSumLanes;
    for (int64_t r = 0; r < Rt; ++r) {
      float* s = &scores[r * stride];
      float mx = kNegInf;
      for (int64_t j = 0; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
      float lanes[kSumLanes] = {};
      if (mx == kNegInf) {  // sees no column: weights 0
        std::fill(s, s + padded, 0.0f);
      } else {
        for (int64_t j = 0; j < m; ++j) s[j] = exp_nonpos(s[j] - mx);
        std::fill(s + m, s + padded, 0.0f);
        for (int64_t j = 0; j < padded; j += kSumLanes)
          for (int l = 0; l < kSumLanes; ++l) lanes[l] += s[j + l];
      }
      for (int w = kSumLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      norm[r] = lanes[0];
    }
    // pass 2: sum of weight * value over the seen columns
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < m; ++j) {
      load_row(vb + cols[j] * a.v_stride[2], D, row.data());
      for (int64_t r = 0; r < Rt; ++r) {
        const float w = scores[r * stride + j];
        if (w == 0.0f) continue;
        float* o = &acc[r * D];
        for (int64_t d = 0; d < D; ++d) o[d] = mul_add(w, row[d], o[d]);
      }
    }
    for (int64_t r = 0; r < Rt; ++r) {
      const int64_t h = kh * G + (r0 + r) / n, i = (r0 + r) % n;
      const float inv = norm[r] > 0.0f ? 1.0f / norm[r] : 0.0f;
      T* o = out + (b * n + i) * out_rows + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv);
    }
  }
}

template <typename T>
void decode_attention_impl(const DecodeAttentionArgs& a) {
  const int64_t Hkv = a.kv_heads, R = a.q_heads / Hkv * a.queries;
  // Tasks: (row b, KV head, part of its R query rows). With fewer (row, KV head) pairs than twice the threads (one
  // request: a few KV heads on a few cores), each pair's query rows are split in parts, so the threads share the
  // work evenly; a part reads the pair's keys and values again (from cache: a layer's are a few hundred KB).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t parts = 1;
  while (a.batch * Hkv * parts < 2 * threads && parts * 2 <= R) parts *= 2;
  at::parallel_for(0, a.batch * Hkv * parts, 1,
                   [&](int64_t begin, int64_t end) { attention_tasks<T>(a, parts, begin, end); });
}

}  // namespace

void decode_attention(const DecodeAttentionArgs& a) { SPECDEC_DISPATCH(a.dtype, decode_attention_impl, a); }

}  // namespace cpu
}  // namespace specdec
