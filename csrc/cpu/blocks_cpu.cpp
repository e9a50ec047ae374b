// CPU kernel of the matrix-vector products of a decode step over weights in blocks of 32 inputs of an output row, as
// GGUF files store them: 4-bit (Q4_1: q in [0, 15] with a float16 scale d and minimum m, w = d q + m) or 8-bit (Q8_0:
// q in [-127, 127] with a float16 scale, w = d q).
//
// Why: a GGUF file's weights as the file has them, 5 or 8.5 bits a weight (bfloat16: 16), so a step reads less and the
// model is the file's own.
//
// Layout (ops.pack_linear_weight(w, torch.uint8) / (w, torch.int8, blocks=True)): panels of 16 outputs, [P, K / 32,
// 320 or 544] bytes. 4-bit: block b of panel p is 16 lines of 16 bytes (byte l of line j: output l's q at inputs
// 32 b + 2 j in the low nibble and 32 b + 2 j + 1 in the high one), then the 16 outputs' d, then their m (float16);
// 8-bit: 32 lines of 16 int8 (line j: the outputs' q at input 32 b + j), then their d. A panel's blocks follow each
// other, so its weights stream front to back with their scales.
//
// Arithmetic: y = sum_b (d_b s_b [+ m_b xs_b]) with s_b = sum_{k in b} q_k x_k (one chain of fused multiply-adds in k
// order) and xs_b = sum_{k in b} x_k (the row's block sums, computed once per call in k order); each output's chain is
// the same whatever rows and panels share the call, so a row's result is bitwise the same in a one-token step and in
// a verification of K + 1 tokens.
#include "cpu/blocks_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
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

// A panel's block of Bits-bit weights: its lines (16 weights each; 4-bit lines hold two inputs), the byte offsets of
// its 16 float16 scales and (4-bit) minima, and its size.
template <int Bits>
struct Block {
  static constexpr int64_t kLines = Bits == 4 ? kQBlock / 2 : kQBlock;
  static constexpr int64_t kScales = kLines * kPanel;
  static constexpr int64_t kMinima = kScales + 2 * kPanel;
  static constexpr int64_t kBytes = kScales + (Bits == 4 ? 4 : 2) * kPanel;
};
static_assert(Block<4>::kBytes == 320 && Block<8>::kBytes == 544, "the packed layouts of layer_ops.py");

template <int Bits>
SPECDEC_ALWAYS_INLINE void prefetch_block(const uint8_t* p) {
  for (int64_t c = 0; c < Block<Bits>::kBytes; c += 64) prefetch_line(p + kPrefetchBytes + c);
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
// the compiler vectorises.
template <int Bits, int MB>
SPECDEC_ALWAYS_INLINE void panel_rows(const float* x, int64_t ldx, const float* xs, int64_t nb, const uint8_t* w,
                                      int64_t p, int64_t N, float* y, int64_t ldy, const float* bias) {
  using B = Block<Bits>;
  float acc[MB][kPanel] = {};
  const uint8_t* wp = w + p * nb * B::kBytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wp + b * B::kBytes;
    prefetch_block<Bits>(blk);
    float s[MB][kPanel] = {};
    for (int64_t j = 0; j < B::kLines; ++j) {
      const uint8_t* line = blk + j * kPanel;
      if constexpr (Bits == 4) {
        float lo[kPanel], hi[kPanel];
        for (int l = 0; l < kPanel; ++l) {
          lo[l] = static_cast<float>(line[l] & 15);
          hi[l] = static_cast<float>(line[l] >> 4);
        }
        for (int m = 0; m < MB; ++m) {
          const float x0 = x[m * ldx + b * kQBlock + 2 * j], x1 = x[m * ldx + b * kQBlock + 2 * j + 1];
#pragma omp simd
          for (int l = 0; l < kPanel; ++l) s[m][l] = mul_add(hi[l], x1, mul_add(lo[l], x0, s[m][l]));
        }
      } else {
        float q[kPanel];
        for (int l = 0; l < kPanel; ++l) q[l] = static_cast<float>(static_cast<int8_t>(line[l]));
        for (int m = 0; m < MB; ++m) {
          const float xk = x[m * ldx + b * kQBlock + j];
#pragma omp simd
          for (int l = 0; l < kPanel; ++l) s[m][l] = mul_add(q[l], xk, s[m][l]);
        }
      }
    }
    float d[kPanel], mn[kPanel];
    for (int l = 0; l < kPanel; ++l) {
      d[l] = half_at(blk + B::kScales + 2 * l);
      mn[l] = Bits == 4 ? half_at(blk + B::kMinima + 2 * l) : 0.0f;
    }
    for (int m = 0; m < MB; ++m) {
      const float xsum = Bits == 4 ? xs[m * nb + b] : 0.0f;
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) {
        const float t = mul_add(d[l], s[m][l], acc[m][l]);
        acc[m][l] = Bits == 4 ? mul_add(mn[l], xsum, t) : t;
      }
    }
  }
  const int64_t col = p * kPanel, width = std::min(kPanel, N - col);
  for (int m = 0; m < MB; ++m) store_panel_row(acc[m], y + m * ldy, col, width, bias);
}

template <int Bits, int MB>
SPECDEC_ALWAYS_INLINE void rows_upto(int64_t rows, const float* x, int64_t ldx, const float* xs, int64_t nb,
                                     const uint8_t* w, int64_t p, int64_t N, float* y, int64_t ldy,
                                     const float* bias) {
  if constexpr (MB >= 1) {
    if (rows == MB) return panel_rows<Bits, MB>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
    rows_upto<Bits, MB - 1>(rows, x, ldx, xs, nb, w, p, N, y, ldy, bias);
  }
}

// Panels [begin, end) for M rows in blocks of at most 4 (near-equal sizes), each block reading the panel once.
template <int Bits>
SPECDEC_CPU_CLONES void panels_generic(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs,
                                       int64_t M, int64_t nb, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                                       const float* bias) {
  constexpr int64_t kMax = 4;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t p = begin; p < end; ++p)
    for (int64_t b = 0, m = 0; b < blocks; ++b) {
      const int64_t rows = (M - m) / (blocks - b);
      rows_upto<Bits, kMax>(rows, x + m * ldx, ldx, xs + m * nb, nb, w, p, N, y + m * ldy, ldy, bias);
      m += rows;
    }
}

#if defined(SPECDEC_AVX512)
// Panels p .. p + G - 1 for MB rows with AVX-512 intrinsics: a line of 16 bytes widened once for every row (4-bit:
// vpmovzxbd, then its two inputs' nibbles; 8-bit: vpmovsxbd), G x MB block sums and as many totals in zmm registers
// (at most 16 of each).
template <int Bits, int MB, int G>
SPECDEC_AVX512_FN void group(const float* x, int64_t ldx, const float* xs, int64_t nb, const uint8_t* w, int64_t p,
                             int64_t N, float* y, int64_t ldy, const float* bias) {
  using B = Block<Bits>;
  const int64_t stride = nb * B::kBytes;
  const uint8_t* wp = w + p * stride;
  const __m512i nibble = _mm512_set1_epi32(15);
  __m512 acc[G][MB];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s[G][MB];
    for (int g = 0; g < G; ++g) {
      prefetch_block<Bits>(wp + g * stride + b * B::kBytes);
      for (int m = 0; m < MB; ++m) s[g][m] = _mm512_setzero_ps();
    }
    const float* xb = x + b * kQBlock;
    for (int64_t j = 0; j < B::kLines; ++j)
      for (int g = 0; g < G; ++g) {
        const __m128i bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + g * stride + b * B::kBytes + j * kPanel));
        if constexpr (Bits == 4) {
          const __m512i v = _mm512_cvtepu8_epi32(bytes);
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
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
        for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * nb + b]), acc[g][m]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t col = (p + g) * kPanel, width = std::min(kPanel, N - col);
    for (int m = 0; m < MB; ++m) {
      float sums[kPanel];
      _mm512_storeu_ps(sums, acc[g][m]);
      store_panel_row(sums, y + m * ldy, col, width, bias);
    }
  }
}

// Panels [begin, end) for MB rows: groups of G panels (MB x G <= 8), then of fewer.
template <int Bits, int MB>
SPECDEC_AVX512_FN void panels_avx512(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs,
                                     int64_t nb, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                                     const float* bias) {
  int64_t p = begin;
  if constexpr (MB == 1)
    for (; p + 8 <= end; p += 8) group<Bits, MB, 8>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  if constexpr (MB <= 2)
    for (; p + 4 <= end; p += 4) group<Bits, MB, 4>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  if constexpr (MB <= 4)
    for (; p + 2 <= end; p += 2) group<Bits, MB, 2>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
  for (; p < end; ++p) group<Bits, MB, 1>(x, ldx, xs, nb, w, p, N, y, ldy, bias);
}

// M rows in blocks of at most 8 (near-equal sizes), each block over panels [begin, end).
template <int Bits>
void rows_avx512(int64_t begin, int64_t end, const float* x, int64_t ldx, const float* xs, int64_t M, int64_t nb,
                 const uint8_t* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  constexpr int64_t kMax = 8;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t rows = (M - m) / (blocks - b);
    const float *xm = x + m * ldx, *xsm = xs + m * nb;
    float* ym = y + m * ldy;
    switch (rows) {
      case 1: panels_avx512<Bits, 1>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 2: panels_avx512<Bits, 2>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 3: panels_avx512<Bits, 3>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 4: panels_avx512<Bits, 4>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 5: panels_avx512<Bits, 5>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 6: panels_avx512<Bits, 6>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      case 7: panels_avx512<Bits, 7>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
      default: panels_avx512<Bits, 8>(begin, end, xm, ldx, xsm, nb, w, N, ym, ldy, bias); break;
    }
    m += rows;
  }
}
#endif

template <int Bits>
void blocks_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                 int64_t ldy, const float* bias) {
  const int64_t P = (N + kPanel - 1) / kPanel, nb = K / kQBlock;
  std::vector<float> xs(Bits == 4 ? M * nb : 0);
  if (Bits == 4) block_sums(x, ldx, M, nb, xs.data());
#if defined(SPECDEC_AVX512)
  if (avx512_usable()) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      rows_avx512<Bits>(begin, end, x, ldx, xs.data(), M, nb, w, N, y, ldy, bias);
    });
    return;
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    panels_generic<Bits>(begin, end, x, ldx, xs.data(), M, nb, w, N, y, ldy, bias);
  });
}

}  // namespace

void q4_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             const float* bias) {
  blocks_gemm<4>(x, ldx, M, K, w, N, y, ldy, bias);
}

void q8_blocks_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, float* y,
                    int64_t ldy, const float* bias) {
  blocks_gemm<8>(x, ldx, M, K, reinterpret_cast<const uint8_t*>(w), N, y, ldy, bias);
}

}  // namespace cpu
}  // namespace specdec
