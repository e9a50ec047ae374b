// Host launchers of the CUDA kernels (csrc/cuda/*.cu). Torch-free: raw pointers in the argument
// blocks of kernels/args.h, a stream, a cudaError_t back. Philox seed/offset are read from device
// memory inside the kernels, so every launch can be captured in a CUDA graph.
//
// CUDA kernels cannot raise: a row with invalid input gets num_accepted[b] (or out[b]) set to a
// negative InvalidInput code (kernels/errors.h), which the Python wrapper turns into a ValueError.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/args.h"

namespace specdec {
namespace cuda {
cudaError_t chain_verify(const VerifyArgs& a, cudaStream_t stream);
cudaError_t chain_verify_logits(const VerifyArgs& a, cudaStream_t stream);
cudaError_t chain_verify_greedy(const VerifyArgs& a, cudaStream_t stream);
cudaError_t residual_sample(const ResidualArgs& a, cudaStream_t stream);
// The head step runs fused (one block per row; a.workspace = nullptr) or split over the GPU (a launch per stage,
// a.workspace holding acceptance_head_workspace() floats). Narrow heads run fused, heads at least
// kHeadSplitWidth wide split; the environment variable SPECDEC_HEAD_KERNEL=fused|split overrides the rule
// (tests, benchmarks). Returns the floats of device scratch to pass, 0 for the fused kernel, -1 when
// SPECDEC_HEAD_KERNEL is set (non-empty) to anything else.
int64_t acceptance_head_workspace(int64_t batch, int64_t hidden_size, int64_t num_layers);
cudaError_t acceptance_head_step(const HeadArgs& a, cudaStream_t stream);
cudaError_t confidence_features(const ConfidenceArgs& a, cudaStream_t stream);
cudaError_t philox_uniforms(const PhiloxArgs& a, cudaStream_t stream);
cudaError_t advance_rows(const AdvanceArgs& a, cudaStream_t stream);
// cache_attention (attention.cu): the floats of device scratch its chunks' partial softmaxes take, for
// B rows, Hq query heads, n queries, C columns and head dimension D; and the kernels (on a.workspace).
int64_t cache_attention_workspace(int64_t batch, int64_t q_heads, int64_t queries, int64_t columns, int64_t head_dim);
cudaError_t cache_attention(const CacheAttentionArgs& a, cudaStream_t stream);
// A graph of num_pieces captured pieces (graphs.cu): pieces[0], then pieces[i] (0 < i < num_pieces - 1) under a
// conditional IF node that runs it where the device bool *flags[i - 1] holds, then pieces[num_pieces - 1];
// instantiated into *exec (the pieces are cloned: the caller keeps owning them and what they point to).
cudaError_t compose_if_chain(const cudaGraph_t* pieces, int num_pieces, const bool* const* flags,
                             cudaGraphExec_t* exec);
cudaError_t launch_graph(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t destroy_graph(cudaGraphExec_t exec);
}  // namespace cuda
}  // namespace specdec
