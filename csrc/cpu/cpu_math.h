// Element-wise float math shared by the CPU kernels (csrc/cpu/*.cpp), written with plain arithmetic so that
// element-wise loops vectorise it without -ffast-math.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/args.h"

namespace specdec {
namespace cpu {

// A kernel's hot loops compiled twice on x86-64 with GCC, for AVX-512 and for the build's baseline (AVX2), the loader
// picking one for the processor it runs on (target_clones, an ifunc): 16 lanes a multiply-add where the CPU has them.
// SmolLM2-135M's 5-token forward through decoder_layer took 0.85x the AVX2 build's time on an AMD EPYC with AVX-512
// (bench/fused_layers.py, both builds in one session).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define SPECDEC_CPU_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define SPECDEC_CPU_CLONES
#endif

// A function compiled for AVX-512 only, called where avx512_usable(): for code written with 64-byte GCC vectors (one
// register each with AVX-512), which a baseline clone would lower through memory. ATEN_CPU_CAPABILITY=avx2 or
// default (torch's own switch, read at each call here) keeps the baseline's code, as on a CPU without AVX-512.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define SPECDEC_AVX512 1
#define SPECDEC_AVX512_FN __attribute__((target("avx512f")))
inline bool avx512_usable() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  if (!supported) return false;
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return cap == nullptr || (std::strcmp(cap, "avx2") != 0 && std::strcmp(cap, "default") != 0);
}

// A function compiled for AVX-512 with its 8-bit dot products (VNNI: vpdpbusd, 64 byte products summed 4 by 4 into
// 16 int32 lanes in one instruction), called where vnni_usable(): Intel since Cascade Lake, AMD since Zen 4.
#define SPECDEC_VNNI_FN __attribute__((target("avx512f,avx512vnni")))
inline bool vnni_usable() {
  static const bool supported = __builtin_cpu_supports("avx512vnni");
  return supported && avx512_usable();
}

// A function compiled for AVX-512 with its bfloat16 dot products (vdpbf16ps: 32 bfloat16 pairs multiplied and added
// two by two into 16 float32 lanes), called where bf16_dot_usable(): Intel since Cooper Lake, AMD since Zen 4.
#define SPECDEC_BF16_FN __attribute__((target("avx512f,avx512bf16")))
inline bool bf16_dot_usable() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported && avx512_usable();
}
#endif

// Inlined into its caller whatever its size: a helper of a SPECDEC_CPU_CLONES function is compiled into each clone
// only where it is inlined (a call would run the baseline's code).
#if defined(__GNUC__)
#define SPECDEC_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SPECDEC_ALWAYS_INLINE inline
#endif

// Runs FN<T>(args...) with T the C++ type of `dtype`.
#define SPECDEC_DISPATCH(dtype, FN, ...)                                             \
  switch (dtype) {                                                                  \
    case DType::kFloat32: FN<float>(__VA_ARGS__); break;                            \
    case DType::kBFloat16: FN<c10::BFloat16>(__VA_ARGS__); break;                   \
    case DType::kFloat16: FN<c10::Half>(__VA_ARGS__); break;                        \
  }

// The float32 whose upper 16 bits are u: a bfloat16's value from its bits (a shift that vectorises).
SPECDEC_ALWAYS_INLINE float upper_half(uint16_t u) {
  const uint32_t bits = static_cast<uint32_t>(u) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// a * b + c rounded once where the CPU has fused multiply-add (FP_FAST_FMAF: x86-64 built with -mfma, AArch64), else
// a * b + c. Written out, not left to the compiler's contraction, which it applies or not loop by loop: a sum that must
// round the same way in a one-token step and in a verification (the same row in a scalar tail or a vector body, in a
// block of one row or of four) uses it.
SPECDEC_ALWAYS_INLINE float mul_add(float a, float b, float c) {
#ifdef FP_FAST_FMAF
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// exp(x) for x <= 0 (arguments are always shifted by the row maximum): Cody-Waite range
// reduction and a degree-6 minimax polynomial (Cephes expf coefficients), about 1 ulp;
// written with plain arithmetic so that element-wise loops vectorise it.
inline float exp_nonpos(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}

}  // namespace cpu
}  // namespace specdec
