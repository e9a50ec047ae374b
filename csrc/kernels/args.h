// Torch-free argument blocks of every op: raw pointers and sizes, shared by the CPU
// implementations (csrc/cpu) and the CUDA launchers (csrc/cuda). All tensors are contiguous, except those of
// DecodeAttentionArgs, which carries strides (a KV cache is read where it lies).
#pragma once
#include <stdint.h>

#include "kernels/common.h"

namespace specdec {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// How far a probability row read in full may sum from 1 (kernels/errors.h, from specdec_ext/errors.py).
SPECDEC_HD float sum_tolerance(DType d) {
  return d == DType::kFloat32 ? kSumToleranceF32 : (d == DType::kBFloat16 ? kSumToleranceBF16 : kSumToleranceF16);
}

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
  bool validate;                // check every row the op may read (0..n_b), not only those it does read
};

// philox_uniforms: per-row Philox streams, out[b, j] = philox_uniform(seed_b, offset_b, 0, first_slot + j), so a row's
// draws depend on its own (seed, offset) alone, never on its place in the batch.
struct PhiloxArgs {
  int64_t batch, slots, first_slot;  // B, n, the first counter slot
  const int64_t* seed_offsets;       // [B, 2]: (seed, offset) of each row
  float* out;                        // [B, n] uniforms in (0, 1]
};

// advance_rows: the next round's per-row inputs written from this round's emitted tokens (overlapped rounds):
// row b accepted a = accepted[b] candidates (0 where accepted is null; a negative code counts as 0; at most W - 1)
// and emitted emitted[b, 0 .. a]; its last token becomes emitted[b, a], the token before it emitted[b, a - 1] (the
// old last token where a = 0), its room shrinks by a + 1, its Philox round count (seed_offsets[b, 1]) grows by 1.
struct AdvanceArgs {
  int64_t rows, width;          // rows advanced (the live ones), W (emitted's columns, >= 1)
  const int64_t* emitted;       // [>= rows, W]
  const int64_t* accepted;      // [>= rows] or nullptr (a plain step: none accepted)
  int64_t* last;                // [>= rows], written
  int64_t* prev;                // [>= rows], written, or nullptr
  int64_t* room;                // [>= rows], written, or nullptr
  int64_t* seed_offsets;        // [>= rows, 2], offset written, or nullptr
};

SPECDEC_HD void advance_row(const AdvanceArgs& a, int64_t b) {
  int64_t n = a.accepted != nullptr ? a.accepted[b] : 0;
  n = n < 0 ? 0 : (n > a.width - 1 ? a.width - 1 : n);
  const int64_t* row = a.emitted + b * a.width;
  if (a.prev != nullptr) a.prev[b] = n > 0 ? row[n - 1] : a.last[b];
  if (a.room != nullptr) a.room[b] -= n + 1;
  if (a.seed_offsets != nullptr) a.seed_offsets[2 * b + 1] += 1;
  a.last[b] = row[n];
}

// argmax_tokens: the first index of each row's maximum (NaN counts as the maximum, as in torch.argmax).
struct ArgmaxArgs {
  DType dtype;                  // of logits
  int64_t rows, vocab;          // R (the product of the leading dimensions), V
  const void* logits;           // [R, V]
  int64_t* out;                 // [R]
};

struct ResidualArgs {
  DType dtype;
  int64_t batch, vocab;
  const void* target;           // [B, V]
  const void* draft;            // [B, V]
  UniformSource rng;            // stride 1
  int64_t* out;                 // [B]
};

// confidence_features: q(y), top-1 minus top-2 of q, entropy of q (nats), per row.
struct ConfidenceArgs {
  DType dtype;                  // of dist
  int64_t batch, vocab;         // B, V
  const void* dist;             // [B, V] logits (q = softmax(dist)) or probabilities (q = dist)
  const int64_t* tokens;        // [B] the candidates y
  bool logits;
  float* out;                   // [B, 3]
  int64_t* code;                // [B] 0, or an InvalidInput code (CUDA; the CPU raises)
};

struct HeadArgs {
  DType dtype;                  // of hidden; weights and features are float32
  int64_t batch, hidden_size, num_layers, num_features;  // B, H, L, F
  const void* hidden;           // [B, H] or nullptr (a head that reads only the features)
  const float* features;        // [B, F] or nullptr (F = 0)
  const float* feature_weight;  // [H, F] (out, in), nullptr when F = 0
  const float* feature_bias;    // [H], nullptr when F = 0
  const float* block_weight;    // [L, H, H] (out, in)
  const float* block_bias;      // [L, H]
  const float* out_weight;      // [H]
  const float* out_bias;        // [1]
  float* cum_accept;            // [B], updated in place
  float* p_accept;              // [B]
  bool* stop;                   // [B]
  int64_t candidate_length, k_min, k_max;
  float threshold;
  float* workspace = nullptr;   // CUDA: [2, B, H] scratch of the split kernels (cuda/launchers.h), else nullptr
  const float* stop_below = nullptr;  // [B] survivals below which a row also stops, or nullptr (none)
};

// SpecDec++'s stop decision for row b of a head step whose running product is now `cum` (specdecpp_stop with the
// step's bounds, threshold and the row's stop_below, -inf without one): the CPU and CUDA kernels' shared last line.
SPECDEC_HD bool head_row_stop(const HeadArgs& a, int64_t b, float cum) {
  return specdecpp_stop(cum, a.candidate_length, a.k_min, a.k_max, a.threshold,
                        a.stop_below != nullptr ? a.stop_below[b] : -INFINITY);
}

// The queries, keys and values of the attention ops: a few queries per row over a KV cache. Strides are in
// elements; the head dimension is contiguous.
struct AttentionQKV {
  DType dtype;                         // of q, k, v and out
  int64_t batch, q_heads, kv_heads;    // B, Hq, Hkv (Hq a multiple of Hkv: grouped-query attention)
  int64_t queries, columns, head_dim;  // n, C, D
  const void* q;                       // [B, Hq, n, D]
  int64_t q_stride[3];                 // of b, h, i
  const void* k;                       // [B, Hkv, C, D]
  int64_t k_stride[3];                 // of b, h, c
  const void* v;                       // [B, Hkv, C, D]
  int64_t v_stride[3];                 // of b, h, c
};

// decode_attention: softmax(q k^T * scale + mask) v, reading only the columns the mask lets some query see.
struct DecodeAttentionArgs : AttentionQKV {
  const bool* mask;                    // [B, 1 or Hq, n, C]: true where query i sees column c; or nullptr:
  int64_t mask_stride[4];              // of b, h (0 when shared by the heads), i, c
  const int64_t* starts = nullptr;     // [B] without a mask: query i sees the columns 0 .. min(starts[b] + i, C - 1)
  const int64_t* rows = nullptr;       // [B] row of k and v that query row b reads (nullptr: row b)
  float scale;                         // multiplies q.k (usually 1 / sqrt(D))
  void* out;                           // [B, n, Hq, D], contiguous (the layout attention layers reshape from)
  int64_t out_row_stride = 0;          // elements between out's (b, i) rows (0: Hq * D, contiguous)
};

// cache_attention: decode_attention over a static KV cache whose rows are read only up to their live length: query i
// of row b sits at position starts[b] + i and sees the columns 0 .. min(starts[b] + i, C - 1) (causal, without a
// mask; a row whose position is negative sees none). The CUDA kernel splits the columns into chunks of `chunk` (one
// block per row, KV head and chunk: flash-decoding), each block reading its columns once for every query of the
// heads that share the KV head, and merges the chunks' partial softmaxes; chunks past a row's length exit at once.
struct CacheAttentionArgs : AttentionQKV {
  const int64_t* starts;               // [B]: each row's first query's position
  float scale;                         // multiplies q.k
  void* out;                           // [B, n, Hq, D], contiguous
  float* workspace;                    // the chunks' partial softmaxes (cache_attention_workspace() floats)
};

// How a packed weight stores its values: in the activations' dtype; int8 panels [P, K + 4, 16] (16 float32 scales
// last, one per output); 4-bit blocks [P, K / 32, 320] bytes (per block of 32 inputs, 16 lines of 16 bytes holding
// inputs 2j and 2j + 1 of each output in the low and high nibble, then 16 float16 scales d and 16 float16 minima m:
// w = d q + m, GGUF's Q4_1); 8-bit blocks [P, K / 32, 544] int8 (32 lines of 16 int8, then 16 float16 scales d: w =
// d q, GGUF's Q8_0). The same blocks for int8 activations (W4A8, W8A8: each row's inputs quantized to int8 blocks of
// 32 before the products): [P, K / 32, 5, 64] uint8 and [P, K / 32, 17, 32] int8, whose chunks of 64 bytes hold 4
// consecutive inputs of each output (csrc/cpu/blocks_cpu.cpp).
enum class PackedWeights { kFloat, kInt8Rows, kQ4Blocks, kQ8Blocks, kQ4BlocksA8, kQ8BlocksA8 };

// packed_linear: y = x W^T with W [N, K] stored as panels of 16 output features, [P = ceil(N / 16), K, 16] (row
// p * 16 + l of W at [p, :, l], rows past N zero): a matrix-vector product for the few rows of a decode step streams
// the weight once, front to back, 16 outputs per load. x, W, bias and y share the dtype (float32 or bfloat16).
struct PackedLinearArgs {
  DType dtype;                                      // kFloat32 or kBFloat16 (x, bias, out)
  PackedWeights weights;                            // the weight's storage (PackedWeights)
  int64_t rows, in_features, out_features, panels;  // M, K, N, P
  const void* x;                                    // [M, K], contiguous
  const void* weight;                               // [P, K, 16] in dtype, int8 [P, K + 4, 16] or uint8 blocks
  const void* bias;                                 // [N] or nullptr
  void* out;                                        // [M, N], contiguous
};

// unpack_linear_weight: the float weights W [N, K] that a quantized packing (any PackedWeights but kFloat) stands for,
// written transposed, out = W^T [K, N] row-major, in dtype: a prefill multiplies them with a library's matmul.
struct UnpackArgs {
  DType dtype;                              // kFloat32 or kBFloat16 (out)
  PackedWeights weights;                    // the packing's layout (not kFloat)
  int64_t in_features, out_features, panels;  // K, N, P
  const void* weight;                       // packed as PackedWeights says
  void* out;                                // [K, N], contiguous
};

// packed_rows: rows ids of the float weights W [N, K] that a quantized packing stands for (unpack_linear_weight's
// values, rounded to its dtype), written as [count, K]: an input embedding tied to a quantized output layer reads its
// rows so, without a float copy of the matrix.
struct PackedRowsArgs {
  UnpackArgs packing;   // the packing, K, N, P and the rows' dtype (its out unused)
  int64_t panel_bytes;  // bytes from one panel to the next
  const int64_t* ids;   // [count], each in [0, N)
  int64_t count;
  void* out;            // [count, K], contiguous
};

// decoder_layer: one Llama/Qwen2/Qwen3 decoder layer for a few tokens per row over a static KV cache: x + attention(
// RoPE(norm(x) Wqkv)) Wo, then + MLP, writing the tokens' keys and values into the cache. Every floating tensor has
// the layer's dtype (float32 or bfloat16), the four packed weights too, or all four int8 panels or blocks of one kind;
// the arithmetic is float32.
struct DecoderLayerArgs {
  DType dtype;                           // kFloat32 or kBFloat16
  PackedWeights weights;                 // how qkv, o, gate_up and down are stored (all four the same)
  int64_t batch, tokens, hidden;         // B rows of n tokens, H
  int64_t heads, kv_heads, head_dim;     // Hq, Hkv, D
  int64_t intermediate;                  // I (the MLP's width)
  int64_t slots, columns, positions;     // S cache rows, C cache columns (the last one scratch), RoPE table rows
  float eps;                             // of the RMS norms
  const void* x;                         // [B, n, H]
  const void* input_norm;                // [H]
  const void* qkv;                       // packed [(Hq + 2 Hkv) D / 16, H, 16]
  const void* qkv_bias;                  // [(Hq + 2 Hkv) D] or nullptr
  const void* q_norm;                    // [D] or nullptr (Qwen3: RMS norm of each head's q and k)
  const void* k_norm;                    // [D] or nullptr
  const void* o;                         // packed [H / 16, Hq D, 16]
  const void* post_norm;                 // [H]
  const void* gate_up;                   // packed [2 I / 16, H, 16]
  const void* down;                      // packed [H / 16, I, 16]
  void* key_cache;                       // [S, Hkv, C, D]
  void* value_cache;                     // [S, Hkv, C, D]
  const int64_t* lengths;                // [S]: each slot's filled columns before this forward
  const int64_t* row_slots;              // [B] slot of each row, or nullptr (row b in slot b)
  const void* cos;                       // [positions, D]
  const void* sin;                       // [positions, D]
  void* out;                             // [B, n, H]
};

}  // namespace specdec
