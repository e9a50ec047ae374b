// CPU kernel of the matrix-vector products of a decode step over weights in 4-bit blocks (GGUF's Q4_1): each block
// of 32 inputs of an output row holds q in [0, 15] with a float16 scale d and minimum m, w = d q + m.
//
// Why: a GGUF file's Q4_1 weights as the file has them, 5 bits a weight (int8 rows: 8; bfloat16: 16), so a step reads
// less and the model is the file's own.
//
// Layout (ops.pack_linear_weight(w, torch.uint8)): panels of 16 outputs, [P, K / 32, 320] bytes; block b of panel p is
// 16 lines of 16 bytes (byte l of line j: output l's q at inputs 32 b + 2 j in the low nibble and 32 b + 2 j + 1 in
// the high one), then the 16 outputs' d, then their m (float16). A panel's blocks follow each other, so its weights
// stream front to back with their scales.
//
// Arithmetic: y = sum_b (d_b s_b + m_b xs_b) with s_b = sum_{k in b} q_k x_k (one chain of fused multiply-adds in k
// order) and xs_b = sum_{k in b} x_k (the row's block sums, computed once per call in k order); each output's chain is
// the same whatever rows and panels share the call, so a row's result is bitwise the same in a one-token step and in
// a verification of K + 1 tokens.
#include "cpu/blocks_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/cpu_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specdec {
namespace cpu {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kLines = kQ4Block / 2;            // 16 lines of 16 bytes: two inputs each
constexpr int64_t kScales = kLines * kPanel;        // byte offset of a block's 16 float16 scales
constexpr int64_t kMinima = kScales + 2 * kPanel;   // and of its 16 float16 minima
constexpr int64_t kPrefetchBytes = 2048;            // as layer_cpu.cpp's streams

SPECDEC_ALWAYS_INLINE void prefetch_block(const uint8_t* p) {
  for (int64_t c = 0; c < kQ4BlockBytes; c += 64) __builtin_prefetch(p + kPrefetchBytes + c, 0, 3);
}

// y[col .. col + width) = sums (+ bias[col ..]): one row of a panel's outputs, lanes past N dropped.
SPECDEC_ALWAYS_INLINE void store_row(const float* sums, float* y, int64_t col, int64_t width, const float* bias) {
  for (int64_t l = 0; l < width; ++l) y[col + l] = sums[l] + (bias != nullptr ? bias[col + l] : 0.0f);
}

// xs[m * nb + b] = x[m, 32 b] + ... + x[m, 32 b + 31], in k order.
void block_sums(const float* x, int64_t ldx, int64_t M, int64_t nb, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < kQ4Block; ++k) s += x[m * ldx + b * kQ4Block + k];
      xs[m * nb + b] = s;
    }
}

// Panel p of y for MB rows (compiled for the build's baseline and for AVX-512 by the caller's clones): 16-lane arrays
// the compiler vectorises.
template <int MB>
SPECDEC_ALWAYS_INLINE void panel_rows(const float* x, int64_t ldx, const float* xs, int64_t nb, const uint8_t* w,
                                      int64_t p, int64_t N, float* y, int64_t ldy, const float* bias) {
  float acc[MB][kPanel] = {};
  const uint8_t* wp = w + p * nb * kQ4BlockBytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wp + b * kQ4BlockBytes;
    prefetch_block(blk);
    float s[MB][kPanel] = {};
    for (int64_t j = 0; j < kLines; ++j) {
      float lo[kPanel], hi[kPanel];
      for (int l = 0; l < kPanel; ++l) {
        lo[l] = static_cast<float>(blk[j * kPanel + l] & 15);
        hi[l] = static_cast<float>(blk[j * kPanel + l] >> 4);
      }
      for (int m = 0; m < MB; ++m) {
        const float x0 = x[m * ldx + b * kQ4Block + 2 * j], x1 = x[m * ldx + b * kQ4Block + 2 * j + 1];
#pragma omp simd
        for (int l = 0; l < kPanel; ++l) s[m][l] = mul_add(hi[l], x1, mul_add(lo[l], x0, s[m][l]));
      }
    }
    float d[kPanel], mn[kPanel];
    for (int l = 0; l < kPanel; ++l) {
      c10::Half h;
      std::memcpy(&h, blk + kScales + 2 * l, 2);
      d[l] = static_cast<float>(h);
      std::memcpy(&h, blk + kMinima + 2 * l, 2);
      mn[l] = static_cast<float>(h);
    }
    for (int m = 0; m < MB; ++m) {
      const float xsum = xs[m * nb + b];
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) acc[m][l] = mul_add(mn[l], xsum, mul_add(d[l], s[m][l], acc[m][l]));
    }
  }
  const int64_t col = p * kPanel, width = std::min(kPanel, N - col);
  for (int m = 0; m < MB; ++m) store_row(acc[m], y + m * ldy, col, width, bias);
}

template <int MB>
SPECDEC_ALWAYS_INLINE void rows_upto(int64_t rows, const float* x, int64_t ldx, const float* xs, int64_t nb,
                                     const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                                     const float* bias) {
  if constexpr (MB >= 1) {
    if (rows == MB) return panel_rows<MB>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
    rows_upto<MB - 1>(rows, x, ldx, xs, nb, w, p, N, y, ldy, bias);
  }
}

// Panels [begin, end) for M rows in blocks of at most 4 (near-equal sizes), each block reading the panel once.
SPECDEC_CPU_CLONES void panels_generic(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs,
                                       int64_t M, int64_t nb, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                                       const float* bias) {
  constexpr int64_t kMax = 4;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t p = begin; p < end; ++p)
    for (int64_t b = 0, m = 0; b < blocks; ++b) {
      const int64_t rows = (M - m) / (blocks - b);
      rows_upto<kMax>(rows, x + m * ldx, ldx, xs + m * nb, nb, w, p, N, y + m * ldy, ldy, bias);
      m += rows;
    }
}

#if defined(SPECDEC_AVX512)
// Panels p .. p + G - 1 for MB rows with AVX-512 intrinsics: a line of 16 bytes widened once (vpmovzxbd) into its two
// inputs' 16 values for every row, G x MB block sums and as many totals in zmm registers (at most 16 of each).
template <int MB, int G>
SPECDEC_AVX512_FN void group(const float* x, int64_t ldx, const float* xs, int64_t nb, const uint8_t* w, int64_t p,
                             int64_t N, float* y, int64_t ldy, const float* bias) {
  const int64_t stride = nb * kQ4BlockBytes;
  const uint8_t* wp = w + p * stride;
  const __m512i nibble = _mm512_set1_epi32(15);
  __m512 acc[G][MB];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s[G][MB];
    for (int g = 0; g < G; ++g) {
      prefetch_block(wp + g * stride + b * kQ4BlockBytes);
      for (int m = 0; m < MB; ++m) s[g][m] = _mm512_setzero_ps();
    }
    const float* xb = x + b * kQ4Block;
    for (int64_t j = 0; j < kLines; ++j)
      for (int g = 0; g < G; ++g) {
        const __m128i bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + g * stride + b * kQ4BlockBytes + j * kPanel));
        const __m512i v = _mm512_cvtepu8_epi32(bytes);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        for (int m = 0; m < MB; ++m) {
          s[g][m] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[m * ldx + 2 * j]), s[g][m]);
          s[g][m] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[m * ldx + 2 * j + 1]), s[g][m]);
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = wp + g * stride + b * kQ4BlockBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kScales)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kMinima)));
      for (int m = 0; m < MB; ++m) {
        acc[g][m] = _mm512_fmadd_ps(d, s[g][m], acc[g][m]);
        acc[g][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * nb + b]), acc[g][m]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t col = (p + g) * kPanel, width = std::min(kPanel, N - col);
    for (int m = 0; m < MB; ++m) {
      float sums[kPanel];
      _mm512_storeu_ps(sums, acc[g][m]);
      store_row(sums, y + m * ldy, col, width, bias);
    }
  }
}

// Panels [begin, end) for MB rows: groups of G panels (MB x G <= 8), then of fewer.
template <int MB>
SPECDEC_AVX512_FN void panels_avx512(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs,
                                     int64_t nb, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                                     const float* bias) {
  int64_t p = begin;
  if constexpr (MB == 1)
    for (; p + 8 <= end; p += 8) group<MB, 8>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  if constexpr (MB <= 2)
    for (; p + 4 <= end; p += 4) group<MB, 4>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  if constexpr (MB <= 4)
    for (; p + 2 <= end; p += 2) group<MB, 2>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  for (; p < end; ++p) group<MB, 1>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
}

// M rows in blocks of at most 8 (near-equal sizes), each block over panels [begin, end).
void rows_avx512(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs, int64_t M, int64_t nb,
                 const uint8_t* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  constexpr int64_t kMax = 8;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t rows = (M - m) / (blocks - b);
    const float *xm = x + m * ldx, *xsm = xs + m * nb;
    float* ym = y + m * ldy;
    switch (rows) {
      case 1: panels_avx512<1>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 2: panels_avx512<2>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 3: panels_avx512<3>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 4: panels_avx512<4>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 5: panels_avx512<5>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 6: panels_avx512<6>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 7: panels_avx512<7>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      default: panels_avx512<8>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
    }
    m += rows;
  }
}
#endif

}  // namespace

void q4_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             const float* bias) {
  const int64_t P = (N + kPanel - 1) / kPanel, nb = K / kQ4Block;
  std::vector<float> xs(M * nb);
  block_sums(x, ldx, M, nb, xs.data());
#if defined(SPECDEC_AVX512)
  if (avx512_usable()) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      rows_avx512(begin, end, x, ldx, xs.data(), M, nb, w, N, y, ldy, bias);
    });
    return;
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    panels_generic(begin, end, x, ldx, xs.data(), M, nb, w, N, y, ldy, bias);
  });
}

}  // namespace cpu
}  // namespace specdec
