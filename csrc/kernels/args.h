// Torch-free argument blocks of every op: raw pointers and sizes, shared by the CPU
// implementations (csrc/cpu) and the CUDA launchers (csrc/cuda). All tensors are contiguous.
#pragma once
#include <stdint.h>

#include "kernels/common.h"

namespace specdec {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// chain_verify (probabilities) and chain_verify_logits (logits + per-row temperature).
struct VerifyArgs {
  DType dtype;                  // of draft / target
  int64_t batch, k, vocab;      // B, K, V
  const int64_t* ids;           // [B, K] draft_token_ids
  const void* draft;            // [B, K, V] draft_probs or draft_logits
  const void* target;           // [B, K+1, V] target_probs or target_logits
  const int64_t* num_draft;     // [B] or nullptr (every row has K candidates)
  const float* temperature;     // [B] (logits op only; 0 = greedy row)
  UniformSource rng;            // stride K+1
  int64_t* out_ids;             // [B, K+1]
  int64_t* num_accepted;        // [B]
};

struct ResidualArgs {
  DType dtype;
  int64_t batch, vocab;
  const void* target;           // [B, V]
  const void* draft;            // [B, V]
  UniformSource rng;            // stride 1
  int64_t* out;                 // [B]
};

struct HeadArgs {
  DType dtype;                  // of hidden; weights are float32
  int64_t batch, hidden_size, num_layers;
  const void* hidden;           // [B, H]
  const float* block_weight;    // [L, H, H] (out, in)
  const float* block_bias;      // [L, H]
  const float* out_weight;      // [H]
  const float* out_bias;        // [1]
  float* cum_accept;            // [B], updated in place
  float* p_accept;              // [B]
  bool* stop;                   // [B]
  int64_t step, k_min, k_max;
  float threshold;
};

}  // namespace specdec
