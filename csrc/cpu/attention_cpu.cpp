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

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specdec {
namespace cpu {
namespace {

constexpr int kDotLanes = 8;
constexpr int kSumLanes = 8;
constexpr int kScoreColumns = 8;  // columns scored together (dot_columns; scores are padded to kSumLanes)

// Row of D elements as float32 (bfloat16: upper_half, a shift that vectorises).
template <typename T>
inline void load_row(const T* p, int64_t D, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, p, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
    for (int64_t d = 0; d < D; ++d) out[d] = upper_half(u[d]);
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d]);
  }
}

// out[c] = q . k_c for the kScoreColumns rows k_c of k (row stride ldk): lane l of each column adds d = l, l + 8, ...
// in order (fused multiply-adds), then the eight lanes of the eight columns reduce together, each column as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then the tail past the last multiple of 8. Every score is
// computed this way, whatever the number of query rows, so a query's scores are bitwise the same in a one-token step
// and in a verification of K + 1 tokens; the reduction of eight columns at once costs a few shuffles instead of a
// tree per (query, column).
SPECDEC_ALWAYS_INLINE void dot_columns(const float* q, const float* k, int64_t ldk, int64_t D, float* out) {
  static_assert(kDotLanes == 8 && kScoreColumns == 8, "the reduction below is written for 8 lanes and 8 columns");
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kScoreColumns];
  for (int c = 0; c < kScoreColumns; ++c) acc[c] = _mm256_setzero_ps();
  for (; d + kDotLanes <= D; d += kDotLanes) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int c = 0; c < kScoreColumns; ++c) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c * ldk + d), acc[c]);
  }
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);  // per 128-bit half: columns
  const __m256 low = _mm256_permute2f128_ps(h0123, h4567, 0x20);   // lanes 0-3 of columns 0-7
  const __m256 high = _mm256_permute2f128_ps(h0123, h4567, 0x31);  // lanes 4-7 of columns 0-7
  _mm256_storeu_ps(out, _mm256_add_ps(low, high));
#else
  float acc[kScoreColumns][kDotLanes] = {};
  for (; d + kDotLanes <= D; d += kDotLanes)
    for (int c = 0; c < kScoreColumns; ++c)
      for (int l = 0; l < kDotLanes; ++l) acc[c][l] = mul_add(q[d + l], k[c * ldk + d + l], acc[c][l]);
  for (int c = 0; c < kScoreColumns; ++c) {
    const float* a = acc[c];
    out[c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
#endif
  if (d == D) return;
  for (int c = 0; c < kScoreColumns; ++c) {
    float tail = 0.0f;
    for (int64_t t = d; t < D; ++t) tail = mul_add(q[t], k[c * ldk + t], tail);
    out[c] += tail;
  }
}

#if defined(SPECDEC_AVX512)
// 16 elements of a cache row as float32.
SPECDEC_AVX512_FN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECDEC_AVX512_FN inline __m512 load16(const c10::BFloat16* p) {
  const __m512i halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(halves, 16));
}
SPECDEC_AVX512_FN inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc[r, d0 .. d0 + 16 NB) (+)= sum_{j0 <= j < j1} w[r, j] v_j[d0 ..] for RB query rows (weights w, row stride ldw;
// value rows v_j at v + j * ldv; acc's rows D apart), starting from zero or, with `resume`, from acc: the sums in zmm
// registers across the columns (the generic loop kept them in memory, a store-to-load round trip a column: pass 2
// ~2x slower at 256 columns).
template <int RB, int NB, typename T>
SPECDEC_AVX512_FN void weighted_block(const float* w, int64_t ldw, const T* v, int64_t ldv, int64_t j0, int64_t j1,
                                      int64_t D, int64_t d0, float* acc, bool resume) {
  __m512 sums[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < NB; ++b) sums[r][b] = resume ? _mm512_loadu_ps(acc + r * D + d0 + 16 * b) : _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512 row[NB];
    for (int b = 0; b < NB; ++b) row[b] = load16(v + j * ldv + d0 + 16 * b);
    for (int r = 0; r < RB; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r * ldw + j]);
      for (int b = 0; b < NB; ++b) sums[r][b] = _mm512_fmadd_ps(wr, row[b], sums[r][b]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(acc + r * D + d0 + 16 * b, sums[r][b]);
}

template <int RB, typename T>
SPECDEC_AVX512_FN void weighted_blocks(const float* w, int64_t ldw, const T* v, int64_t ldv, int64_t j0, int64_t j1,
                                       int64_t D, int64_t d0, int64_t blocks, float* acc, bool resume) {
  switch (blocks) {
    case 4: return weighted_block<RB, 4>(w, ldw, v, ldv, j0, j1, D, d0, acc, resume);
    case 3: return weighted_block<RB, 3>(w, ldw, v, ldv, j0, j1, D, d0, acc, resume);
    case 2: return weighted_block<RB, 2>(w, ldw, v, ldv, j0, j1, D, d0, acc, resume);
    default: return weighted_block<RB, 1>(w, ldw, v, ldv, j0, j1, D, d0, acc, resume);
  }
}

// Pass 2 of a causal task with AVX-512 (D a multiple of 16): acc[r, :] = sum_{j < seen[r]} w[r, j] v_j, each element
// one chain of fused multiply-adds in j order (as the generic loop, which skips zero weights: the same sums), each row
// reading only the columns it sees. Up to four rows share each value load up to the fewest columns any of them sees, then
// each goes on alone: at most 16 accumulators (4 rows x 64 elements).
template <typename T>
SPECDEC_AVX512_FN void weighted_values_avx512(const float* w, int64_t ldw, const T* v, int64_t ldv,
                                              const int64_t* seen, int64_t D, int64_t Rt, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t blocks = std::min<int64_t>(4, (D - d0) / 16);
    for (int64_t r = 0; r < Rt; r += 4) {
      const int64_t rb = std::min<int64_t>(4, Rt - r), common = *std::min_element(seen + r, seen + r + rb);
      const float* wr = w + r * ldw;
      switch (rb) {
        case 4: weighted_blocks<4>(wr, ldw, v, ldv, 0, common, D, d0, blocks, acc + r * D, false); break;
        case 3: weighted_blocks<3>(wr, ldw, v, ldv, 0, common, D, d0, blocks, acc + r * D, false); break;
        case 2: weighted_blocks<2>(wr, ldw, v, ldv, 0, common, D, d0, blocks, acc + r * D, false); break;
        default: weighted_blocks<1>(wr, ldw, v, ldv, 0, common, D, d0, blocks, acc + r * D, false); break;
      }
      for (int64_t q = r; q < r + rb; ++q)
        if (seen[q] > common)
          weighted_blocks<1>(w + q * ldw, ldw, v, ldv, common, seen[q], D, d0, blocks, acc + q * D, true);
    }
  }
}

// The sum of each of 16 columns' 16 float32 lanes, lane c of the result column c's: every column by the same tree
// whatever its place among the 16, ((l0 + l2) + (l1 + l3)) within each 128-bit block, then (B0 + B1) + (B2 + B3)
// across the blocks: unpacks and shuffles that reduce the 16 columns together (45 instructions, against 16 x 8 for
// a horizontal reduction of each).
SPECDEC_AVX512_FN inline __m512 sum_lanes16(const __m512 (&acc)[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per block: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per block: columns 4i .. 4i + 3
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // blocks [B0 + B1, B2 + B3] of quads 2i, then of 2i + 1
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[j] = scale * (q . k_cols[j]) for j < m, q and the key rows (at k + cols[j] * ldk) bfloat16, D = 32 * Chunks
// (Chunks 0: any multiple of 32, a loop): lane l of a column adds the pairs d = 2l + 1, 2l, then 2l + 33, 2l + 32, ...
// (vdpbf16ps: the products of bfloat16s are exact in float32), its lanes summed by sum_lanes16. A score depends on its
// query and key rows alone: a one-token step, a verification and a masked call give it the same bits. The keys are
// read where they lie, in the cache's bfloat16: no float32 copy. Past the last column a group of 16 scores its last
// column again (the 16 accumulators stay in registers, unrolled), which the masked store drops.
template <int Chunks>
SPECDEC_BF16_FN void score_columns_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t ldk,
                                        const int64_t* cols, int64_t m, int64_t D, float scale, float* out) {
  for (int64_t j0 = 0; j0 < m; j0 += 16) {
    const int64_t nc = std::min<int64_t>(16, m - j0);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      const c10::BFloat16* kc = k + cols[j0 + std::min<int64_t>(c, nc - 1)] * ldk;
      acc[c] = _mm512_setzero_ps();
      if constexpr (Chunks > 0) {
#pragma GCC unroll 8
        for (int d = 0; d < 32 * Chunks; d += 32)
          acc[c] = _mm512_dpbf16_ps(acc[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + d)),
                                    reinterpret_cast<__m512bh>(_mm512_loadu_si512(kc + d)));
      } else {
        for (int64_t d = 0; d < D; d += 32)
          acc[c] = _mm512_dpbf16_ps(acc[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + d)),
                                    reinterpret_cast<__m512bh>(_mm512_loadu_si512(kc + d)));
      }
    }
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << nc) - 1),
                          _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
  }
}

// score_columns_bf16 unrolled for the usual head sizes (64, 128).
inline void score_columns_bf16_any(const c10::BFloat16* q, const c10::BFloat16* k, int64_t ldk, const int64_t* cols,
                                   int64_t m, int64_t D, float scale, float* out) {
  switch (D) {
    case 64: return score_columns_bf16<2>(q, k, ldk, cols, m, D, scale, out);
    case 128: return score_columns_bf16<4>(q, k, ldk, cols, m, D, scale, out);
    default: return score_columns_bf16<0>(q, k, ldk, cols, m, D, scale, out);
  }
}
#endif

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
  std::vector<float> qf(R * D), row(D), keys(kScoreColumns * D), scores(R * stride), acc(R * D), norm(R);
  std::vector<int64_t> cols(C);
  std::vector<const bool*> mrow(R);
  std::vector<int64_t> last(R);  // without a mask: the last column each query row sees
  std::vector<int64_t> seen(R);
  std::vector<const T*> qrow(R);  // each row's query
#if defined(SPECDEC_AVX512)
  // bfloat16 queries and keys: scores by score_columns_bf16 (the same for every call and path of the CPU it runs on)
  const bool bf16_scores = std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && bf16_dot_usable();
#else
  constexpr bool bf16_scores = false;
#endif
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / (Hkv * parts), kh = task / parts % Hkv, part = task % parts;
    const int64_t r0 = R * part / parts, Rt = R * (part + 1) / parts - r0;  // this part's rows r0 .. r0 + Rt - 1
    for (int64_t r = 0; r < Rt; ++r) {
      const int64_t h = kh * G + (r0 + r) / n, i = (r0 + r) % n;
      qrow[r] = q + b * a.q_stride[0] + h * a.q_stride[1] + i * a.q_stride[2];
      if (!bf16_scores) {  // the generic scores' query, scaled, as float32
        load_row(qrow[r], D, &qf[r * D]);
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= a.scale;
      }
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
    // pass 1: the columns some query sees, and their scores (-inf where that query may not look)
    int64_t m = 0;
    for (int64_t c = 0; c < stop; ++c) {
      bool any = !masked;  // causal: every column up to the last one some query sees
      if (masked)
        for (int64_t r = 0; r < Rt; ++r) any |= mrow[r][c * mc];
      if (any) cols[m++] = c;
    }
#if defined(SPECDEC_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_scores)
        for (int64_t r = 0; r < Rt; ++r)
          score_columns_bf16_any(qrow[r], kb, a.k_stride[2], cols.data(), m, D, a.scale, &scores[r * stride]);
    }
#endif
    for (int64_t j = 0; !bf16_scores && j < m; j += kScoreColumns) {  // the keys of 8 seen columns (zeros past the last), every row
      const int64_t nc = std::min<int64_t>(kScoreColumns, m - j);
      const float* kp = keys.data();
      int64_t ldk = D;
      if (std::is_same_v<T, float> && !masked && nc == kScoreColumns) {  // 8 consecutive float32 rows: read in place
        kp = reinterpret_cast<const float*>(kb + j * a.k_stride[2]);
        ldk = a.k_stride[2];
      } else {
        for (int64_t c = 0; c < nc; ++c) load_row(kb + cols[j + c] * a.k_stride[2], D, &keys[c * D]);
        std::fill(keys.begin() + nc * D, keys.end(), 0.0f);
      }
      for (int64_t r = 0; r < Rt; ++r) dot_columns(&qf[r * D], kp, ldk, D, &scores[r * stride + j]);
    }
    for (int64_t r = 0; r < Rt; ++r)
      for (int64_t j = 0; j < m; ++j)
        if (!(masked ? mrow[r][cols[j] * mc] : cols[j] <= last[r])) scores[r * stride + j] = kNegInf;
    // softmax weights per query row, unnormalised: exp(s - max); norm = their sum, column j in lane j % kSumLanes
    // (the columns past m, up to a multiple of kSumLanes, add zeros: a query's sum does not depend on how many
    // columns the other queries of its call see)
    const int64_t padded = (m + kSumLanes - 1) / kSumLanes * kSumLanes;
    for (int64_t r = 0; r < Rt; ++r) {
      float* s = &scores[r * stride];
      float mx = kNegInf;
      {  // 16 lanes, then across them: the maximum, whatever the order
        float lanes16[16];
        std::fill(lanes16, lanes16 + 16, kNegInf);
        int64_t j = 0;
        for (; j + 16 <= m; j += 16)
#pragma omp simd
          for (int l = 0; l < 16; ++l) lanes16[l] = s[j + l] > lanes16[l] ? s[j + l] : lanes16[l];
        for (; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
        for (int l = 0; l < 16; ++l) mx = lanes16[l] > mx ? lanes16[l] : mx;
      }
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
    bool summed = false;
#if defined(SPECDEC_AVX512)
    if (!masked && D % 16 == 0 && avx512_usable()) {  // causal: row r sees the columns 0 .. last[r]
      for (int64_t r = 0; r < Rt; ++r) seen[r] = std::max<int64_t>(0, last[r] + 1);
      weighted_values_avx512(scores.data(), stride, vb, a.v_stride[2], seen.data(), D, Rt, acc.data());
      summed = true;
    }
#endif
    if (!summed) std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; !summed && j < m; ++j) {
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
void decode_attention_impl(const DecodeAttentionArgs& a, const Team* team) {
  const int64_t Hkv = a.kv_heads, R = a.q_heads / Hkv * a.queries;
  // Tasks: (row b, KV head, part of its R query rows). With fewer (row, KV head) pairs than twice the threads (one
  // request: a few KV heads on a few cores), each pair's query rows are split in parts, so the threads share the
  // work evenly; a part reads the pair's keys and values again (from cache: a layer's are a few hundred KB).
  const int64_t threads = team != nullptr ? team->size : std::max<int64_t>(1, at::get_num_threads());
  int64_t parts = 1;
  while (a.batch * Hkv * parts < 2 * threads && parts * 2 <= R) parts *= 2;
  const int64_t tasks = a.batch * Hkv * parts;
  if (team != nullptr) {
    if (team->begin(tasks) < team->end(tasks)) attention_tasks<T>(a, parts, team->begin(tasks), team->end(tasks));
    return;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { attention_tasks<T>(a, parts, begin, end); });
}

}  // namespace

void decode_attention(const DecodeAttentionArgs& a, const Team* team) {
  SPECDEC_DISPATCH(a.dtype, decode_attention_impl, a, team);
}

}  // namespace cpu
}  // namespace specdec
