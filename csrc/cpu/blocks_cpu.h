// CPU matrix-vector products over weights stored in blocks of 32 inputs with float16 scales, 4-bit (GGUF's Q4_1) or
// 8-bit (Q8_0), with float32 or int8 activations (csrc/cpu/blocks_cpu.cpp), for packed_linear and decoder_layer
// (csrc/cpu/layer_cpu.cpp).
#pragma once
#include <cstdint>

#include "cpu/team.h"

namespace specdec {
namespace cpu {

constexpr int64_t kQBlock = 32;  // inputs per block

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W in 4-bit blocks [ceil(N / 16), K / 32, 320]
// (PackedWeights::kQ4Blocks, kernels/args.h), K a multiple of 32; panels split among at::parallel_for's threads, or
// with a team (csrc/cpu/team.h) the calling thread's share of them alone (no sync: the caller's).
void q4_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             const float* bias, const Team* team = nullptr);

// The same with W in 8-bit blocks [ceil(N / 16), K / 32, 544] (PackedWeights::kQ8Blocks).
void q8_blocks_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, float* y,
                    int64_t ldy, const float* bias, const Team* team = nullptr);

// The same with x's rows quantized to int8 blocks of 32 (W4A8, W8A8), W in the int8 activations' layouts: 4-bit
// [ceil(N / 16), K / 32, 5, 64] (PackedWeights::kQ4BlocksA8), 8-bit [ceil(N / 16), K / 32, 17, 32] (kQ8BlocksA8).
// With a team each thread quantizes x itself (a few hundred nanoseconds), so that no sync waits on one thread's.
void q4_a8_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                int64_t ldy, const float* bias, const Team* team = nullptr);
void q8_a8_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, float* y, int64_t ldy,
                const float* bias, const Team* team = nullptr);

}  // namespace cpu
}  // namespace specdec
