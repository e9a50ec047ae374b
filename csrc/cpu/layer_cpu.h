// CPU kernels of packed_linear and decoder_layer (csrc/cpu/layer_cpu.cpp).
#pragma once
#include "kernels/args.h"

namespace specdec {
namespace cpu {
void packed_linear(const PackedLinearArgs& a);
void decoder_layer(const DecoderLayerArgs& a);
// layers[0 .. L): a stack, layers[l + 1].x being layers[l].out, the bits of L decoder_layer calls in one parallel
// region (csrc/cpu/team.h).
void decoder_layers(const DecoderLayerArgs* layers, int64_t L);
}  // namespace cpu
}  // namespace specdec
