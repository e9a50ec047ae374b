// CPU attention kernel (csrc/cpu/attention_cpu.cpp).
#pragma once
#include "kernels/args.h"
#include "cpu/team.h"

namespace specdec {
namespace cpu {
// All of a's tasks split among at::parallel_for's threads, or with a team (csrc/cpu/team.h) the calling thread's
// share of them alone (no sync: the caller's).
void decode_attention(const DecodeAttentionArgs& a, const Team* team = nullptr);
}  // namespace cpu
}  // namespace specdec
