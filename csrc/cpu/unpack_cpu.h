// CPU kernels of unpack_linear_weight and packed_rows (csrc/cpu/unpack_cpu.cpp).
#pragma once
#include "../kernels/args.h"

namespace specdec {
namespace cpu {

void unpack_linear_weight(const UnpackArgs& a);
void packed_rows(const PackedRowsArgs& a);

}  // namespace cpu
}  // namespace specdec
