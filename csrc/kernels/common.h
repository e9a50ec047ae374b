// Torch-free math shared by the CPU and CUDA implementations of every specdec_ext op.
//
// Everything here is __host__ __device__ and depends on nothing but <stdint.h>, so the CPU
// kernels (compiled by the host compiler) and the CUDA kernels (compiled by nvcc) make the
// same decisions from the same numbers: the same Philox uniforms, the same acceptance test,
// the same stopping rule.
#pragma once
#include <math.h>
#include <stdint.h>

#include "kernels/errors.h"

#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#else
#define SPECDEC_HD inline
#endif

namespace specdec {

// ---------------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al., SC'11), counter-based: uniform number `slot` of row `row` for a
// call with (seed, offset) is a pure function of those four integers, on any device.
// ---------------------------------------------------------------------------------------------
SPECDEC_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

SPECDEC_HD uint32_t philox4x32_10_first(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo32(M0, c0, &hi0);
    uint32_t lo1 = mulhilo32(M1, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += W0; k1 += W1;
  }
  return c0;
}

// A uniform in (0, 1] with 24 random bits. Never 0, so that the acceptance test u*q <= p can
// never accept a token with p = 0, and the inverse-CDF threshold u*Z is always > 0, so a bin
// with zero mass is never chosen.
SPECDEC_HD float philox_uniform(uint64_t seed, uint64_t offset, uint32_t row, uint32_t slot) {
  uint32_t x = philox4x32_10_first(slot, row, static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                                   static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<float>((x >> 8) + 1u) * (1.0f / 16777216.0f);
}

// Rejection-sampling acceptance test (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2):
// accept candidate x with probability min(1, p(x)/q(x)), written without a division. A token the
// target gives zero probability is never accepted (u * q <= p alone would accept p = q = 0).
SPECDEC_HD bool accept_candidate(float u, float q, float p) { return p > 0.0f && u * q <= p; }

// SpecDec++ stopping rule (Huang et al. 2024, Sec. 3.2, Eq. 4): with running product cum_accept
// of predicted acceptance probabilities, stop drafting when the predicted probability that at
// least one candidate is rejected exceeds the stop threshold h, keeping the round's candidate
// length K within [k_min, k_max]. `candidate_length` is K if drafting stopped now (1-based). `stop_below`:
// a survival below which the row also stops within those bounds (the goodput rule of threshold="auto",
// policies/goodput.py; -inf where there is none).
SPECDEC_HD bool specdecpp_stop(float cum_accept, int64_t candidate_length, int64_t k_min, int64_t k_max,
                               float threshold, float stop_below) {
  if (candidate_length >= k_max) return true;
  if (candidate_length < k_min) return false;
  return (1.0f - cum_accept) > threshold || cum_accept < stop_below;
}

SPECDEC_HD float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }



// A finite float (false for NaN and +-Inf).
SPECDEC_HD bool finite_f(float x) { return x - x == 0.0f; }

}  // namespace specdec

namespace specdec {

// Where a kernel's uniforms come from: an explicit [B, stride] float32 array (tests, replay), or
// Philox with (seed, offset). Slot convention (shared by every op and the reference):
// slot i < n_b is the acceptance draw of candidate i; slot n_b draws the final token.
struct UniformSource {
  const float* explicit_u;      // nullptr: use Philox
  int64_t stride;
  const int64_t* seed_offset;   // Philox (seed, offset), 2 int64 in the kernel's memory space (device on CUDA)
  uint64_t seed;                // filled from seed_offset by resolve() inside the kernel
  uint64_t offset;
  SPECDEC_HD UniformSource resolve() const {
    UniformSource r = *this;
    if (explicit_u == nullptr && seed_offset != nullptr) {
      r.seed = static_cast<uint64_t>(seed_offset[0]);
      r.offset = static_cast<uint64_t>(seed_offset[1]);
    }
    return r;
  }
  SPECDEC_HD float at(int64_t row, int64_t slot) const {
    return explicit_u != nullptr ? explicit_u[row * stride + slot]
                                 : philox_uniform(seed, offset, static_cast<uint32_t>(row), static_cast<uint32_t>(slot));
  }
};

// Inputs valid for a probability: finite and >= 0 (false for NaN).
SPECDEC_HD bool valid_prob(float x) { return x >= 0.0f && x <= 3.4028234663852886e38f; }

}  // namespace specdec
