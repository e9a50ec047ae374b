// CPU kernel of unpack_linear_weight (csrc/cpu/unpack_cpu.cpp).
#pragma once
#include "../kernels/args.h"

namespace specdec {
namespace cpu {

void unpack_linear_weight(const UnpackArgs& a);

}  // namespace cpu
}  // namespace specdec
