// What the CPU kernels over packed weights share (csrc/cpu/layer_cpu.cpp: float and int8-row panels;
// csrc/cpu/blocks_cpu.cpp: blocks of 32): the panel width, how far ahead the weight stream is fetched, and the store of
// one row of a panel's outputs.
#pragma once
#include <cstdint>

#include "cpu/cpu_math.h"

namespace specdec {
namespace cpu {

constexpr int64_t kPanel = 16;            // output features per panel: one 64-byte line of float32 per k
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the line being read the next lines are fetched

// Fetches the weight line at p into every cache level (prefetcht0). The non-temporal hint (prefetchnta), which
// bypasses L2 on Intel server cores, made SmolLM2-135M's float32 one-token step 2.4x slower on a 2-core Xeon with AMX
// (56 against 23 ms, bench/fused_layers.py; 1,024 to 4,096 bytes ahead within 5% of each other).
SPECDEC_ALWAYS_INLINE void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

// Where to fetch ahead of byte `offset` of a panel's stream (the panel at `panel`, `stride` bytes long) that a thread
// reads beside G - 1 others, panels side by side: kPrefetchBytes on, and past the panel's end into the panel G on,
// the same stream of the group the thread reads next, so that group's G streams start fetched, not cold (SmolLM2-135M's
// one-token step 5.45 -> 5.20 ms with int8 activations, 7.11 -> 6.73 with float ones, 2-core Xeon with AMX, alternated
// in one process). Past the weights' end it only wastes a fetch (a prefetch never faults).
SPECDEC_ALWAYS_INLINE const char* fetch_ahead(const void* panel, int64_t offset, int64_t stride, int G) {
  const int64_t at = offset + kPrefetchBytes;
  return static_cast<const char*>(panel) + at + (at >= stride ? (G - 1) * stride : 0);
}

// y[col .. col + width) = sums[0 .. width) (x scale[0 .. width) for int8 rows) (+ bias[col ..]): one row of a panel's
// outputs, the rest of its 16 lanes (past N) dropped.
SPECDEC_ALWAYS_INLINE void store_panel_row(const float* sums, float* y, int64_t col, int64_t width, const float* bias,
                                           const float* scale = nullptr) {
  for (int64_t l = 0; l < width; ++l) {
    const float s = scale != nullptr ? sums[l] * scale[l] : sums[l];
    y[col + l] = s + (bias != nullptr ? bias[col + l] : 0.0f);
  }
}

}  // namespace cpu
}  // namespace specdec
