// CPU kernel of the matrix-vector products of a decode step over weights in blocks of 32 inputs of an output row, as
// GGUF files store them: 4-bit (Q4_1: q in [0, 15] with a float16 scale d and minimum m, w = d q + m) or 8-bit (Q8_0:
// q in [-127, 127] with a float16 scale, w = d q); with float32 activations, or with the activations quantized to
// int8 blocks of 32 (W4A8 / W8A8, as llama.cpp multiplies a Q4_1 or Q8_0 weight by its Q8_1 / Q8_0 activations).
//
// Why: a GGUF file's weights as the file has them, 5 or 8.5 bits a weight (bfloat16: 16), so a step reads less and the
// model is the file's own. With float32 activations each weight is widened to float32 beside its multiply-add (2-3
// vector instructions a 16-weight FMA), which caps two cores below the rate memory feeds them; with int8 activations
// one vpdpbusd (AVX-512 VNNI) multiplies and sums 64 weights.
//
// Layouts (ops.pack_linear_weight(w, torch.uint8 | torch.int8, blocks=True, int8_activations=...)): panels of 16
// outputs, a block of 32 inputs after another, each block's weights then its 16 float16 d (4-bit: then its 16 m), so
// a panel's weights stream front to back with their scales: [P, K / 32, 320] (4-bit) or [P, K / 32, 544] (8-bit).
// Float activations: 4-bit block b of panel p is 16 lines of 16 bytes (byte l of line j: output l's q at inputs
// 32 b + 2 j in the low nibble and 32 b + 2 j + 1 in the high one); 8-bit: 32 lines of 16 int8 (line j: the outputs'
// q at input 32 b + j). Int8 activations, [P, K / 32, 5, 64] (4-bit) or [P, K / 32, 17, 32] (8-bit): chunks of 64
// bytes whose byte 4 l + i holds output l's q at input 4 c + i of chunk c (4-bit: low nibble; the high nibble input
// 16 + 4 c + i), the 16 int32 lanes vpdpbusd sums into.
//
// Arithmetic, float activations: y = sum_b (d_b s_b [+ m_b xs_b]) with s_b = sum_{k in b} q_k x_k (one chain of fused
// multiply-adds in k order) and xs_b = sum_{k in b} x_k (the row's block sums, computed once per call in k order).
// Int8 activations: each row's block of x is a_b = max |x_k| / 127 times r_k = round-half-even(x_k 127 / max |x_k|)
// (llama.cpp's Q8 blocks, the scale kept in float32), and y = sum_b ((d_b a_b) s_b [+ m_b xs_b]) with s_b = sum q_k
// r_k exact in int32. Either way each output's sum is the same whatever rows and panels share the call and whichever
// kernel (AVX-512 or the baseline) runs it, so a row's result is bitwise the same in a one-token step and in a
// verification of K + 1 tokens.
#include "cpu/blocks_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/cpu_math.h"
#include "cpu/panels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specdec {
namespace cpu {
namespace {

// A panel's block of Bits-bit weights: its lines (16 weights each; 4-bit lines hold two inputs), its chunks of 64
// bytes (int8 activations' layout), the byte offsets of its 16 float16 scales and (4-bit) minima, and its size.
template <int Bits>
struct Block {
  static constexpr int64_t kLines = Bits == 4 ? kQBlock / 2 : kQBlock;
  static constexpr int64_t kChunks = kLines / 4;
  static constexpr int64_t kScales = kLines * kPanel;
  static constexpr int64_t kMinima = kScales + 2 * kPanel;
  static constexpr int64_t kBytes = kScales + (Bits == 4 ? 4 : 2) * kPanel;
};
static_assert(Block<4>::kBytes == 320 && Block<8>::kBytes == 544, "the packed layouts of layer_ops.py");

// The rows of x a call multiplies and what the blocks read of them: x and its block sums, and with int8 activations
// (A8) their int8 values r, scales a and block sums of r.
struct Rows {
  const float* x;       // [M, K], row stride ldx
  int64_t ldx, K, nb;   // K / 32 blocks
  const float* xs;      // [M, nb]: sum of x per block, in k order (4-bit weights' minima)
  const int8_t* r;      // [M, K] int8 activations, or nullptr
  const float* a;       // [M, nb] their scales
  const int32_t* rsum;  // [M, nb] sum of r per block (8-bit weights read as q + 128 by vpdpbusd)

  Rows from(int64_t m) const {  // the rows from row m on
    Rows t = *this;
    t.x += m * ldx;
    t.xs += m * nb;
    if (r != nullptr) {
      t.r += m * K;
      t.a += m * nb;
      t.rsum += m * nb;
    }
    return t;
  }
};

#if defined(SPECDEC_AVX512)
// quantize_block's values for a block of 32 finite inputs with a finite max |x| > 0 (false, nothing written, for any
// other: the scalar loop's cases): the same products x_k (127 / max |x|), rounded half to even by vcvtps2dq under the
// default rounding mode as std::nearbyint rounds them, so bitwise the scalar result in a few instructions (~1 us of
// the 4 a layer's products took to quantize their rows).
SPECDEC_AVX512_FN inline bool quantize_block_avx512(const float* xb, int8_t* r, float* a, int32_t* sum) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  if (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) return false;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  if (!(amax > 0.0f) || !std::isfinite(amax)) return false;
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(r), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(r + 16), _mm512_cvtepi32_epi8(q1));
  *a = amax / 127.0f;
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return true;
}
#endif

// Block b of a row's int8 activations (Rows' r, a, rsum) from its 32 inputs xb.
inline void quantize_block(const float* xb, int8_t* r, float* a, int32_t* rsum, bool avx512) {
#if defined(SPECDEC_AVX512)
  if (avx512 && quantize_block_avx512(xb, r, a, rsum)) return;
#endif
  float amax = 0.0f;
  for (int64_t k = 0; k < kQBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
  // A block of zeros (or of non-finite values: a = inf or NaN) holds r = 0.
  const float inv = amax > 0.0f && std::isfinite(amax) ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kQBlock; ++k) {
    const int8_t v = static_cast<int8_t>(inv != 0.0f ? std::nearbyint(xb[k] * inv) : 0.0f);
    r[k] = v;
    sum += v;
  }
  *a = amax / 127.0f;
  *rsum = sum;
}

// The int8 activations of M rows: r, a and rsum of Rows for every block of every row.
struct Activations {
  std::vector<int8_t> r;
  std::vector<float> a;
  std::vector<int32_t> rsum;

  Activations(const float* x, int64_t ldx, int64_t M, int64_t K) : r(M * K), a(M * K / kQBlock), rsum(a.size()) {
#if defined(SPECDEC_AVX512)
    const bool avx512 = M > 0 && avx512_usable();
#else
    const bool avx512 = false;
#endif
    const int64_t nb = K / kQBlock;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + m * ldx + b * kQBlock, &r[m * K + b * kQBlock], &a[m * nb + b], &rsum[m * nb + b],
                       avx512);
  }
};

template <int Bits>
SPECDEC_ALWAYS_INLINE void prefetch_block(const char* at) {
  for (int64_t c = 0; c < Block<Bits>::kBytes; c += 64) prefetch_line(at + c);
}

SPECDEC_ALWAYS_INLINE float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// xs[m * nb + b] = x[m, 32 b] + ... + x[m, 32 b + 31], in k order.
void block_sums(const float* x, int64_t ldx, int64_t M, int64_t nb, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < kQBlock; ++k) s += x[m * ldx + b * kQBlock + k];
      xs[m * nb + b] = s;
    }
}

// Panel p of y for MB rows (compiled for the build's baseline and for AVX-512 by the caller's clones): 16-lane arrays
// the compiler vectorises. A8: int8 activations, integer block sums.
template <int Bits, bool A8, int MB>
SPECDEC_ALWAYS_INLINE void panel_rows(const Rows& x, const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                                      const float* bias) {
  using B = Block<Bits>;
  using Sum = std::conditional_t<A8, int32_t, float>;
  float acc[MB][kPanel] = {};
  const uint8_t* wp = w + p * x.nb * B::kBytes;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = wp + b * B::kBytes;
    prefetch_block<Bits>(fetch_ahead(wp, b * B::kBytes, x.nb * B::kBytes, 1));
    Sum s[MB][kPanel] = {};
    if constexpr (A8) {
      for (int64_t c = 0; c < B::kChunks; ++c)
        for (int i = 0; i < 4; ++i) {
          int32_t lo[kPanel], hi[kPanel];
          for (int l = 0; l < kPanel; ++l) {
            const uint8_t byte = blk[64 * c + 4 * l + i];
            lo[l] = Bits == 4 ? byte & 15 : static_cast<int8_t>(byte);
            hi[l] = byte >> 4;
          }
          for (int m = 0; m < MB; ++m) {
            const int8_t* r = x.r + m * x.K + b * kQBlock;
            const int32_t r0 = r[4 * c + i], r1 = Bits == 4 ? r[16 + 4 * c + i] : 0;
            for (int l = 0; l < kPanel; ++l) s[m][l] += lo[l] * r0 + (Bits == 4 ? hi[l] * r1 : 0);
          }
        }
    } else {
      for (int64_t j = 0; j < B::kLines; ++j) {
        const uint8_t* line = blk + j * kPanel;
        if constexpr (Bits == 4) {
          float lo[kPanel], hi[kPanel];
          for (int l = 0; l < kPanel; ++l) {
            lo[l] = static_cast<float>(line[l] & 15);
            hi[l] = static_cast<float>(line[l] >> 4);
          }
          for (int m = 0; m < MB; ++m) {
            const float x0 = x.x[m * x.ldx + b * kQBlock + 2 * j], x1 = x.x[m * x.ldx + b * kQBlock + 2 * j + 1];
#pragma omp simd
            for (int l = 0; l < kPanel; ++l) s[m][l] = mul_add(hi[l], x1, mul_add(lo[l], x0, s[m][l]));
          }
        } else {
          float q[kPanel];
          for (int l = 0; l < kPanel; ++l) q[l] = static_cast<float>(static_cast<int8_t>(line[l]));
          for (int m = 0; m < MB; ++m) {
            const float xk = x.x[m * x.ldx + b * kQBlock + j];
#pragma omp simd
            for (int l = 0; l < kPanel; ++l) s[m][l] = mul_add(q[l], xk, s[m][l]);
          }
        }
      }
    }
    float d[kPanel], mn[kPanel];
    for (int l = 0; l < kPanel; ++l) {
      d[l] = half_at(blk + B::kScales + 2 * l);
      mn[l] = Bits == 4 ? half_at(blk + B::kMinima + 2 * l) : 0.0f;
    }
    for (int m = 0; m < MB; ++m) {
      const float xsum = Bits == 4 ? x.xs[m * x.nb + b] : 0.0f, a = A8 ? x.a[m * x.nb + b] : 1.0f;
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) {
        const float t = A8 ? mul_add(d[l] * a, static_cast<float>(s[m][l]), acc[m][l])
                           : mul_add(d[l], static_cast<float>(s[m][l]), acc[m][l]);
        acc[m][l] = Bits == 4 ? mul_add(mn[l], xsum, t) : t;
      }
    }
  }
  const int64_t col = p * kPanel, width = std::min(kPanel, N - col);
  for (int m = 0; m < MB; ++m) store_panel_row(acc[m], y + m * ldy, col, width, bias);
}

template <int Bits, bool A8, int MB>
SPECDEC_ALWAYS_INLINE void rows_upto(int64_t rows, const Rows& x, const uint8_t* w, int64_t p, int64_t N, float* y,
                                     int64_t ldy, const float* bias) {
  if constexpr (MB >= 1) {
    if (rows == MB) return panel_rows<Bits, A8, MB>(x, w, p, N, y, ldy, bias);
    rows_upto<Bits, A8, MB - 1>(rows, x, w, p, N, y, ldy, bias);
  }
}

// Panels [begin, end) for M rows in blocks of at most 4 (near-equal sizes), each block reading the panel once.
template <int Bits, bool A8>
SPECDEC_CPU_CLONES void panels_generic(int64_t begin, int64_t end, const Rows& x, int64_t M, const uint8_t* w,
                                       int64_t N, float* y, int64_t ldy, const float* bias) {
  constexpr int64_t kMax = 4;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t p = begin; p < end; ++p)
    for (int64_t b = 0, m = 0; b < blocks; ++b) {
      const int64_t rows = (M - m) / (blocks - b);
      rows_upto<Bits, A8, kMax>(rows, x.from(m), w, p, N, y + m * ldy, ldy, bias);
      m += rows;
    }
}

#if defined(SPECDEC_AVX512)
template <int G, int MB>
SPECDEC_AVX512_FN void store_group(__m512 (&acc)[G][MB], int64_t p, int64_t N, float* y, int64_t ldy,
                                   const float* bias) {
  for (int g = 0; g < G; ++g) {
    const int64_t col = (p + g) * kPanel, width = std::min(kPanel, N - col);
    for (int m = 0; m < MB; ++m) {
      float sums[kPanel];
      _mm512_storeu_ps(sums, acc[g][m]);
      store_panel_row(sums, y + m * ldy, col, width, bias);
    }
  }
}

// Panels p .. p + G - 1 for MB rows with AVX-512 intrinsics, float activations: a line of 16 bytes widened once for
// every row (4-bit: vpmovzxbd, then its two inputs' nibbles; 8-bit: vpmovsxbd), G x MB block sums and as many totals
// in zmm registers (at most 16 of each).
template <int Bits, int MB, int G>
SPECDEC_AVX512_FN void group(const Rows& x, const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                             const float* bias) {
  using B = Block<Bits>;
  const int64_t stride = x.nb * B::kBytes, ldx = x.ldx;
  const uint8_t* wp = w + p * stride;
  const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[G][MB];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512 s[G][MB];
    for (int g = 0; g < G; ++g) {
      prefetch_block<Bits>(fetch_ahead(wp + g * stride, b * B::kBytes, stride, G));
      for (int m = 0; m < MB; ++m) s[g][m] = _mm512_setzero_ps();
    }
    const float* xb = x.x + b * kQBlock;
    for (int64_t j = 0; j < B::kLines; ++j)
      for (int g = 0; g < G; ++g) {
        const __m128i bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + g * stride + b * B::kBytes + j * kPanel));
        if constexpr (Bits == 4) {
          // each nibble's float from a table of 0 .. 15 (vpermps reads an index's low 4 bits: no mask for the low
          // nibble, no int-to-float conversion): 3% of SmolLM2-135M's q4 step against and + cvtdq2ps
          const __m512i v = _mm512_cvtepu8_epi32(bytes);
          const __m512 lo = _mm512_permutexvar_ps(v, nibbles);
          const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), nibbles);
          for (int m = 0; m < MB; ++m) {
            s[g][m] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[m * ldx + 2 * j]), s[g][m]);
            s[g][m] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[m * ldx + 2 * j + 1]), s[g][m]);
          }
        } else {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
          for (int m = 0; m < MB; ++m) s[g][m] = _mm512_fmadd_ps(q, _mm512_set1_ps(xb[m * ldx + j]), s[g][m]);
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = wp + g * stride + b * B::kBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + B::kScales)));
      for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_fmadd_ps(d, s[g][m], acc[g][m]);
      if constexpr (Bits == 4) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + B::kMinima)));
        for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xs[m * x.nb + b]), acc[g][m]);
      }
    }
  }
  store_group<G, MB>(acc, p, N, y, ldy, bias);
}

SPECDEC_ALWAYS_INLINE int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The same with int8 activations (AVX-512 VNNI): per chunk of 64 bytes and row one vpdpbusd (4-bit: two, one per
// nibble) adds 64 products into the 16 outputs' int32 block sums; 8-bit weights are read as q + 128 (vpdpbusd
// multiplies unsigned by signed bytes) and 128 sum(r) taken off after.
template <int Bits, int MB, int G>
SPECDEC_VNNI_FN void group_a8(const Rows& x, const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                              const float* bias) {
  using B = Block<Bits>;
  const int64_t stride = x.nb * B::kBytes;
  const uint8_t* wp = w + p * stride;
  const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[G][MB];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i s[G][MB];
    for (int g = 0; g < G; ++g) {
      prefetch_block<Bits>(fetch_ahead(wp + g * stride, b * B::kBytes, stride, G));
      for (int m = 0; m < MB; ++m) s[g][m] = _mm512_setzero_si512();
    }
    const int8_t* rb = x.r + b * kQBlock;
    for (int64_t c = 0; c < B::kChunks; ++c)
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(wp + g * stride + b * B::kBytes + 64 * c);
        if constexpr (Bits == 4) {
          const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
          for (int m = 0; m < MB; ++m) {
            s[g][m] = _mm512_dpbusd_epi32(s[g][m], lo, _mm512_set1_epi32(four_bytes(rb + m * x.K + 4 * c)));
            s[g][m] = _mm512_dpbusd_epi32(s[g][m], hi, _mm512_set1_epi32(four_bytes(rb + m * x.K + 16 + 4 * c)));
          }
        } else {
          const __m512i u = _mm512_xor_si512(v, flip);
          for (int m = 0; m < MB; ++m)
            s[g][m] = _mm512_dpbusd_epi32(s[g][m], u, _mm512_set1_epi32(four_bytes(rb + m * x.K + 4 * c)));
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = wp + g * stride + b * B::kBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + B::kScales)));
      for (int m = 0; m < MB; ++m) {
        __m512i si = s[g][m];
        if constexpr (Bits == 8) si = _mm512_sub_epi32(si, _mm512_set1_epi32(128 * x.rsum[m * x.nb + b]));
        const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(x.a[m * x.nb + b]));
        acc[g][m] = _mm512_fmadd_ps(da, _mm512_cvtepi32_ps(si), acc[g][m]);
      }
      if constexpr (Bits == 4) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + B::kMinima)));
        for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xs[m * x.nb + b]), acc[g][m]);
      }
    }
  }
  store_group<G, MB>(acc, p, N, y, ldy, bias);
}

template <int Bits, bool A8, int MB, int G>
SPECDEC_AVX512_FN void run_group(const Rows& x, const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                                 const float* bias) {
  if constexpr (A8)
    group_a8<Bits, MB, G>(x, w, p, N, y, ldy, bias);
  else
    group<Bits, MB, G>(x, w, p, N, y, ldy, bias);
}

// Panels [begin, end) for MB rows: groups of G panels (MB x G <= 8, and 2 panels for 5 rows), then of fewer. 5 rows
// (a verification of K = 4), 2 panels against 1: SmolLM2-135M's 5-token step 0.95x with int8 activations, 0.96x with
// float ones; 6 rows 0.98x and 1.03x, 8 rows 1.08x (accumulators spilled): 2-core Xeon with AMX, alternated in one
// process.
template <int Bits, bool A8, int MB>
SPECDEC_AVX512_FN void panels_avx512(int64_t begin, int64_t end, const Rows& x, const uint8_t* w, int64_t N, float* y,
                                     int64_t ldy, const float* bias) {
  int64_t p = begin;
  if constexpr (MB == 1)
    for (; p + 8 <= end; p += 8) run_group<Bits, A8, MB, 8>(x, w, p, N, y, ldy, bias);
  if constexpr (MB <= 2)
    for (; p + 4 <= end; p += 4) run_group<Bits, A8, MB, 4>(x, w, p, N, y, ldy, bias);
  if constexpr (MB <= 5)
    for (; p + 2 <= end; p += 2) run_group<Bits, A8, MB, 2>(x, w, p, N, y, ldy, bias);
  for (; p < end; ++p) run_group<Bits, A8, MB, 1>(x, w, p, N, y, ldy, bias);
}

// M rows in blocks of at most 8 (near-equal sizes), each block over panels [begin, end).
template <int Bits, bool A8>
void rows_avx512(int64_t begin, int64_t end, const Rows& x, int64_t M, const uint8_t* w, int64_t N, float* y,
                 int64_t ldy, const float* bias) {
  constexpr int64_t kMax = 8;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t rows = (M - m) / (blocks - b);
    const Rows xm = x.from(m);
    float* ym = y + m * ldy;
    switch (rows) {
      case 1: panels_avx512<Bits, A8, 1>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 2: panels_avx512<Bits, A8, 2>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 3: panels_avx512<Bits, A8, 3>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 4: panels_avx512<Bits, A8, 4>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 5: panels_avx512<Bits, A8, 5>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 6: panels_avx512<Bits, A8, 6>(begin, end, xm, w, N, ym, ldy, bias); break;
      case 7: panels_avx512<Bits, A8, 7>(begin, end, xm, w, N, ym, ldy, bias); break;
      default: panels_avx512<Bits, A8, 8>(begin, end, xm, w, N, ym, ldy, bias); break;
    }
    m += rows;
  }
}
#endif

template <int Bits, bool A8>
void blocks_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                 int64_t ldy, const float* bias, const Team* team) {
  const int64_t P = (N + kPanel - 1) / kPanel, nb = K / kQBlock;
  if (team != nullptr && team->begin(P) == team->end(P)) return;
  std::vector<float> xs(Bits == 4 ? M * nb : 0);
  if (Bits == 4) block_sums(x, ldx, M, nb, xs.data());
  const Activations act = A8 ? Activations(x, ldx, M, K) : Activations(x, ldx, 0, K);
  const Rows rows{x, ldx, K, nb, xs.data(), A8 ? act.r.data() : nullptr, act.a.data(), act.rsum.data()};
  auto panels = [&](int64_t begin, int64_t end) {
#if defined(SPECDEC_AVX512)
    if (A8 ? vnni_usable() : avx512_usable()) return rows_avx512<Bits, A8>(begin, end, rows, M, w, N, y, ldy, bias);
#endif
    panels_generic<Bits, A8>(begin, end, rows, M, w, N, y, ldy, bias);
  };
  if (team != nullptr) return panels(team->begin(P), team->end(P));
  at::parallel_for(0, P, 1, panels);
}

}  // namespace

void q4_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             const float* bias, const Team* team) {
  blocks_gemm<4, false>(x, ldx, M, K, w, N, y, ldy, bias, team);
}

void q8_blocks_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, float* y,
                    int64_t ldy, const float* bias, const Team* team) {
  blocks_gemm<8, false>(x, ldx, M, K, reinterpret_cast<const uint8_t*>(w), N, y, ldy, bias, team);
}

void q4_a8_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                int64_t ldy, const float* bias, const Team* team) {
  blocks_gemm<4, true>(x, ldx, M, K, w, N, y, ldy, bias, team);
}

void q8_a8_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, float* y, int64_t ldy,
                const float* bias, const Team* team) {
  blocks_gemm<8, true>(x, ldx, M, K, reinterpret_cast<const uint8_t*>(w), N, y, ldy, bias, team);
}

}  // namespace cpu
}  // namespace specdec
