// CPU matrix-vector products over weights stored in 4-bit blocks (csrc/cpu/blocks_cpu.cpp), for packed_linear and
// decoder_layer (csrc/cpu/layer_cpu.cpp).
#pragma once
#include <cstdint>

namespace specdec {
namespace cpu {

constexpr int64_t kQ4Block = 32;         // inputs per block (GGUF's Q4_1)
constexpr int64_t kQ4BlockBytes = 320;   // a panel's block: 16 lines of 16 bytes, 16 float16 scales, 16 float16 minima

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W in 4-bit blocks [ceil(N / 16), K / 32, 320]
// (PackedWeights::kQ4Blocks, kernels/args.h), K a multiple of 32; panels split among threads.
void q4_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             const float* bias);

}  // namespace cpu
}  // namespace specdec
