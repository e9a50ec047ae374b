// CPU attention kernel (csrc/cpu/attention_cpu.cpp).
#pragma once
#include "kernels/args.h"

namespace specdec {
namespace cpu {
void decode_attention(const DecodeAttentionArgs& a);
}  // namespace cpu
}  // namespace specdec
