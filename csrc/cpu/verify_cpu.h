// CPU implementations (csrc/cpu/verify_cpu.cpp). Raise c10::ValueError for invalid values they read.
#pragma once
#include "kernels/args.h"

namespace specdec {
namespace cpu {
void chain_verify(const VerifyArgs& a);
void chain_verify_logits(const VerifyArgs& a);
void chain_verify_greedy(const VerifyArgs& a);
void argmax_tokens(const ArgmaxArgs& a);
void advance_rows(const AdvanceArgs& a);
void residual_sample(const ResidualArgs& a);
void acceptance_head_step(const HeadArgs& a);
void confidence_features(const ConfidenceArgs& a);
void philox_uniforms(const PhiloxArgs& a);
}  // namespace cpu
}  // namespace specdec
