// CPU kernel of unpack_linear_weight: the float weights a quantized packing stands for (int8 rows with a float32 scale
// each, GGUF-style 4-bit and 8-bit blocks of 32 inputs with float16 scales, in either of their layouts), written as
// W^T [K, N].
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

#include "panels.h"

namespace specdec {
namespace cpu {
namespace {

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// One panel's 16 outputs (rows of W past N skipped) into columns p * 16 .. p * 16 + 15 of out = W^T [K, N].
template <typename T>
void unpack_panel(const UnpackArgs& a, int64_t p) {
  const int64_t N = a.out_features, K = a.in_features, nb = K / 32;
  const int64_t rows = std::min<int64_t>(kPanel, N - p * kPanel);
  T* col = static_cast<T*>(a.out) + p * kPanel;
  const uint8_t* base = static_cast<const uint8_t*>(a.weight);
  float v[kPanel];
  auto put = [&](int64_t k) {
    T* dst = col + k * N;
    for (int64_t l = 0; l < rows; ++l) dst[l] = static_cast<T>(v[l]);
  };
  float d[kPanel], m[kPanel];
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
    case PackedWeights::kQ4BlocksA8:  // 320 bytes a block: 256 of nibbles, 16 float16 d, 16 float16 m
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (p * nb + b) * 320;
        for (int64_t l = 0; l < kPanel; ++l) d[l] = half_at(blk + 256 + 2 * l), m[l] = half_at(blk + 288 + 2 * l);
        for (int64_t j = 0; j < 16; ++j) {
          // kQ4Blocks: line j (16 bytes) holds inputs 2j (low nibble) and 2j + 1 (high) of each output l;
          // kQ4BlocksA8: chunk c = j / 4 (64 bytes), byte 4 l + i (i = j % 4) holds inputs 4c + i and 16 + 4c + i
          const bool a8 = a.weights == PackedWeights::kQ4BlocksA8;
          const int64_t lo = a8 ? 4 * (j / 4) + j % 4 : 2 * j, hi = a8 ? lo + 16 : lo + 1;
          for (int64_t l = 0; l < kPanel; ++l) {
            const uint8_t q = a8 ? blk[(j / 4) * 64 + 4 * l + j % 4] : blk[j * kPanel + l];
            v[l] = d[l] * static_cast<float>(q & 15) + m[l];
          }
          put(b * 32 + lo);
          for (int64_t l = 0; l < kPanel; ++l) {
            const uint8_t q = a8 ? blk[(j / 4) * 64 + 4 * l + j % 4] : blk[j * kPanel + l];
            v[l] = d[l] * static_cast<float>(q >> 4) + m[l];
          }
          put(b * 32 + hi);
        }
      }
      return;
    case PackedWeights::kQ8Blocks:
    case PackedWeights::kQ8BlocksA8:  // 544 bytes a block: 512 of int8, then 16 float16 d
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (p * nb + b) * 544;
        for (int64_t l = 0; l < kPanel; ++l) d[l] = half_at(blk + 512 + 2 * l);
        for (int64_t k = 0; k < 32; ++k) {
          // kQ8Blocks: line k holds input k of each output; kQ8BlocksA8: chunk k / 4, byte 4 l + k % 4
          const bool a8 = a.weights == PackedWeights::kQ8BlocksA8;
          for (int64_t l = 0; l < kPanel; ++l) {
            const uint8_t q = a8 ? blk[(k / 4) * 64 + 4 * l + k % 4] : blk[k * kPanel + l];
            v[l] = d[l] * static_cast<float>(static_cast<int8_t>(q));
          }
          put(b * 32 + k);
        }
      }
      return;
    case PackedWeights::kFloat:
      return;  // (float panels are unpacked by a view: layer_ops.unpack_linear_weight)
  }
}

}  // namespace

void unpack_linear_weight(const UnpackArgs& a) {
  at::parallel_for(0, a.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      if (a.dtype == DType::kBFloat16) {
        unpack_panel<c10::BFloat16>(a, p);
      } else {
        unpack_panel<float>(a, p);
      }
    }
  });
}

}  // namespace cpu
}  // namespace specdec
