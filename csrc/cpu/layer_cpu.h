// CPU kernels of packed_linear and decoder_layer (csrc/cpu/layer_cpu.cpp).
#pragma once
#include "kernels/args.h"

namespace specdec {
namespace cpu {
void packed_linear(const PackedLinearArgs& a);
void decoder_layer(const DecoderLayerArgs& a);
}  // namespace cpu
}  // namespace specdec
