// CPU kernel of unpack_linear_weight: the float weights a quantized packing stands for (int8 rows with a float32 scale
// each, GGUF-style 4-bit and 8-bit blocks of 32 inputs with float16 scales, in either of their layouts), written as
// W^T [K, N]; and of packed_rows: a few rows of those weights (a tied embedding's, read from its output layer's
// blocks), each id's panel unpacked alone.
//
// Why: a quantized model holds only its packed weights (engine/weights.py). A decode step multiplies them as they are
// (layer_cpu.cpp, blocks_cpu.cpp), but a prefill of hundreds of tokens reuses each weight across its rows, where a
// library's matmul (oneDNN, AMX on CPUs that have it) is 2-3x faster than widening 4-bit weights per group of 16
// rows: a layer's weights are unpacked into a short-lived float matrix just before its products.
//
// Written transposed because each packed line holds one input of 16 consecutive outputs: a line becomes 16
// contiguous values of W^T's row k, and x W^T is x times a row-major [K, N] matrix.

#include "unpack_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/cpu_math.h"
#include "panels.h"

namespace specdec {
namespace cpu {
namespace {

SPECDEC_ALWAYS_INLINE float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// 16 values into dst: float32 as they are; bfloat16 rounded to nearest even as c10::BFloat16 rounds (NaN to its
// quiet NaN), written branch-free so that the loop vectorises.
SPECDEC_ALWAYS_INLINE void store16(const float* v, float* dst) { std::memcpy(dst, v, kPanel * sizeof(float)); }
SPECDEC_ALWAYS_INLINE void store16(const float* v, c10::BFloat16* dst) {
  uint16_t out[kPanel];
  for (int64_t l = 0; l < kPanel; ++l) {
    uint32_t u;
    std::memcpy(&u, &v[l], 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[l] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
  std::memcpy(dst, out, sizeof(out));
}

// One panel's 16 outputs (rows of W past N skipped) into columns p * 16 .. p * 16 + 15 of out = W^T [K, N]: each
// packed line of 16 outputs' input k computed in 16 lanes (loops of 16 that vectorise), then stored.
template <typename T>
SPECDEC_CPU_CLONES void unpack_panel(const UnpackArgs& a, int64_t p) {
  const int64_t N = a.out_features, K = a.in_features, nb = K / 32;
  const int64_t rows = std::min<int64_t>(kPanel, N - p * kPanel);
  T* col = static_cast<T*>(a.out) + p * kPanel;
  const uint8_t* base = static_cast<const uint8_t*>(a.weight);
  float v[kPanel], d[kPanel], m[kPanel];
  auto put = [&](int64_t k) {
    T* dst = col + k * N;
    if (rows == kPanel) {
      store16(v, dst);
    } else {
      for (int64_t l = 0; l < rows; ++l) dst[l] = static_cast<T>(v[l]);
    }
  };
  switch (a.weights) {
    case PackedWeights::kInt8Rows: {  // [P, K + 4, 16]: K lines of 16 int8, then 16 float32 scales
      const int8_t* w = reinterpret_cast<const int8_t*>(base) + p * (K + 4) * kPanel;
      std::memcpy(d, w + K * kPanel, sizeof(d));
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t l = 0; l < kPanel; ++l) v[l] = static_cast<float>(w[k * kPanel + l]) * d[l];
        put(k);
      }
      return;
    }
    case PackedWeights::kQ4Blocks:
    case PackedWeights::kQ4BlocksA8: {  // 320 bytes a block: 256 of nibbles, 16 float16 d, 16 float16 m
      const bool a8 = a.weights == PackedWeights::kQ4BlocksA8;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (p * nb + b) * 320;
        for (int64_t l = 0; l < kPanel; ++l) d[l] = half_at(blk + 256 + 2 * l), m[l] = half_at(blk + 288 + 2 * l);
        for (int64_t j = 0; j < 16; ++j) {
          // kQ4Blocks: line j (16 bytes) holds inputs 2j (low nibble) and 2j + 1 (high) of each output l;
          // kQ4BlocksA8: chunk c = j / 4 (64 bytes), byte 4 l + i (i = j % 4) holds inputs 4c + i and 16 + 4c + i
          uint8_t q[kPanel];
          for (int64_t l = 0; l < kPanel; ++l) q[l] = a8 ? blk[(j / 4) * 64 + 4 * l + j % 4] : blk[j * kPanel + l];
          const int64_t lo = a8 ? 4 * (j / 4) + j % 4 : 2 * j, hi = a8 ? lo + 16 : lo + 1;
          for (int64_t l = 0; l < kPanel; ++l) v[l] = d[l] * static_cast<float>(q[l] & 15) + m[l];
          put(b * 32 + lo);
          for (int64_t l = 0; l < kPanel; ++l) v[l] = d[l] * static_cast<float>(q[l] >> 4) + m[l];
          put(b * 32 + hi);
        }
      }
      return;
    }
    case PackedWeights::kQ8Blocks:
    case PackedWeights::kQ8BlocksA8: {  // 544 bytes a block: 512 of int8, then 16 float16 d
      const bool a8 = a.weights == PackedWeights::kQ8BlocksA8;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (p * nb + b) * 544;
        for (int64_t l = 0; l < kPanel; ++l) d[l] = half_at(blk + 512 + 2 * l);
        for (int64_t k = 0; k < 32; ++k) {
          // kQ8Blocks: line k holds input k of each output; kQ8BlocksA8: chunk k / 4, byte 4 l + k % 4
          for (int64_t l = 0; l < kPanel; ++l) {
            const uint8_t q = a8 ? blk[(k / 4) * 64 + 4 * l + k % 4] : blk[k * kPanel + l];
            v[l] = d[l] * static_cast<float>(static_cast<int8_t>(q));
          }
          put(b * 32 + k);
        }
      }
      return;
    }
    case PackedWeights::kFloat:
      return;  // (float panels are unpacked by a view: layer_ops.unpack_linear_weight)
  }
}

#if defined(SPECDEC_AVX512)
// The AVX-512 kernel of full panels in the layouts a prefill unpacks (int8 rows, 4-bit and 8-bit blocks without the
// int8 activations' chunks): a line of 16 outputs is one zmm of 16 lanes. The values are exact float32 products (a
// float16 scale times a 4- or 8-bit integer, plus a float16 minimum; or an int8 times a float32 scale: one
// rounding), as the baseline loops compute them, and bfloat16 rounds to nearest even as store16 does.
template <typename T>
SPECDEC_AVX512_FN SPECDEC_ALWAYS_INLINE void store_zmm(__m512 v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
}

template <typename T>
SPECDEC_AVX512_FN void unpack_panel_avx512(const UnpackArgs& a, int64_t p) {
  const int64_t N = a.out_features, K = a.in_features, nb = K / 32;
  T* col = static_cast<T*>(a.out) + p * kPanel;
  const uint8_t* base = static_cast<const uint8_t*>(a.weight);
  if (a.weights == PackedWeights::kInt8Rows) {
    const uint8_t* w = base + p * (K + 4) * kPanel;
    const __m512 scale = _mm512_loadu_ps(w + K * kPanel);
    for (int64_t k = 0; k < K; ++k) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel)));
      store_zmm(_mm512_mul_ps(_mm512_cvtepi32_ps(q), scale), col + k * N);
    }
    return;
  }
  const bool q4 = a.weights == PackedWeights::kQ4Blocks;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = base + (p * nb + b) * (q4 ? 320 : 544);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (q4 ? 256 : 512))));
    T* dst = col + b * 32 * N;
    if (q4) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      for (int64_t j = 0; j < 16; ++j) {  // line j: inputs 2j (low nibbles) and 2j + 1 (high)
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + j * kPanel)));
        const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(q, 4);
        store_zmm(_mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m), dst + 2 * j * N);
        store_zmm(_mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m), dst + (2 * j + 1) * N);
      }
    } else {
      for (int64_t k = 0; k < 32; ++k) {  // line k: input k
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * kPanel)));
        store_zmm(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), dst + k * N);
      }
    }
  }
}
#endif

// Panel p of a.weight unpacked into a.out (AVX-512 for the full panels of the layouts it reads).
void unpack_one(const UnpackArgs& a, int64_t p) {
  const bool full = (p + 1) * kPanel <= a.out_features;
  const bool bf16 = a.dtype == DType::kBFloat16;
#if defined(SPECDEC_AVX512)
  if (full && avx512_usable() &&
      (a.weights == PackedWeights::kInt8Rows || a.weights == PackedWeights::kQ4Blocks ||
       a.weights == PackedWeights::kQ8Blocks)) {
    bf16 ? unpack_panel_avx512<c10::BFloat16>(a, p) : unpack_panel_avx512<float>(a, p);
    return;
  }
#endif
  bf16 ? unpack_panel<c10::BFloat16>(a, p) : unpack_panel<float>(a, p);
}

}  // namespace

void unpack_linear_weight(const UnpackArgs& a) {
  at::parallel_for(0, a.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) unpack_one(a, p);
  });
}

// Each id's panel unpacked alone into a [K, width] buffer (its 16 rows: a few us for K = 576), then the id's lane
// copied out; blocks of ids in parallel (a decode step's few ids stay on the calling thread).
void packed_rows(const PackedRowsArgs& a) {
  const int64_t K = a.packing.in_features, N = a.packing.out_features;
  const int64_t bytes = a.packing.dtype == DType::kBFloat16 ? 2 : 4;
  at::parallel_for(0, a.count, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(K * kPanel * bytes);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = a.ids[i] / kPanel, lane = a.ids[i] % kPanel;
      UnpackArgs one = a.packing;
      one.out_features = std::min(kPanel, N - p * kPanel);
      one.panels = 1;
      one.weight = static_cast<const uint8_t*>(a.packing.weight) + p * a.panel_bytes;
      one.out = panel.data();
      unpack_one(one, 0);
      uint8_t* row = static_cast<uint8_t*>(a.out) + i * K * bytes;
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(row + k * bytes, panel.data() + (k * one.out_features + lane) * bytes, bytes);
    }
  });
}

}  // namespace cpu
}  // namespace specdec
