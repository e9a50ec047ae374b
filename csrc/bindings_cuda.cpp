// CUDA registrations of the specdec_ext ops: the only file that needs torch's CUDA headers.
// Checks and tensor->argument conversion are shared with the CPU registrations (ops_common.h);
// the kernels themselves are torch-free (csrc/cuda/*.cu) and run on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <vector>

#include "cuda/launchers.h"
#include "ops_common.h"

namespace specdec {
namespace {

void check_launch(cudaError_t e, const char* op) {
  SPECDEC_CHK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
}

std::tuple<at::Tensor, at::Tensor> chain_verify_cuda(const at::Tensor& ids, const at::Tensor& draft_probs,
                                                     const at::Tensor& target_probs, const std::optional<at::Tensor>& n,
                                                     const std::optional<at::Tensor>& u,
                                                     const std::optional<at::Tensor>& so, bool validate) {
  const c10::cuda::CUDAGuard guard(target_probs.device());
  VerifyTensors t = prepare_verify(ids, draft_probs, target_probs, n, std::nullopt, u, so, false, validate);
  check_launch(cuda::chain_verify(t.args, at::cuda::getCurrentCUDAStream()), "chain_verify");
  return {t.out_ids, t.num_accepted};
}

std::tuple<at::Tensor, at::Tensor> chain_verify_logits_cuda(const at::Tensor& ids, const at::Tensor& draft_logits,
                                                            const at::Tensor& target_logits,
                                                            const at::Tensor& temperature,
                                                            const std::optional<at::Tensor>& n,
                                                            const std::optional<at::Tensor>& u,
                                                            const std::optional<at::Tensor>& so, bool validate) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  VerifyTensors t = prepare_verify(ids, draft_logits, target_logits, n, temperature, u, so, true, validate);
  check_launch(cuda::chain_verify_logits(t.args, at::cuda::getCurrentCUDAStream()), "chain_verify_logits");
  return {t.out_ids, t.num_accepted};
}

std::tuple<at::Tensor, at::Tensor> chain_verify_greedy_cuda(const at::Tensor& ids, const at::Tensor& target_logits,
                                                            const std::optional<at::Tensor>& n) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  VerifyTensors t = prepare_greedy(ids, target_logits, n);
  check_launch(cuda::chain_verify_greedy(t.args, at::cuda::getCurrentCUDAStream()), "chain_verify_greedy");
  return {t.out_ids, t.num_accepted};
}

at::Tensor residual_sample_cuda(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& so) {
  const c10::cuda::CUDAGuard guard(target_probs.device());
  ResidualTensors t = prepare_residual(target_probs, draft_probs, u, so);
  check_launch(cuda::residual_sample(t.args, at::cuda::getCurrentCUDAStream()), "residual_sample");
  return t.out;
}

std::tuple<at::Tensor, at::Tensor> acceptance_head_step_cuda(
    const std::optional<at::Tensor>& hidden, const std::optional<at::Tensor>& features,
    const std::optional<at::Tensor>& feature_weight, const std::optional<at::Tensor>& feature_bias,
    const at::Tensor& block_weight, const at::Tensor& block_bias, const at::Tensor& out_weight,
    const at::Tensor& out_bias, at::Tensor& cum_accept, int64_t candidate_length, int64_t k_min, int64_t k_max,
    double threshold, const std::optional<at::Tensor>& stop_below) {
  const c10::cuda::CUDAGuard guard(out_weight.device());
  HeadTensors t = prepare_head(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                               out_bias, cum_accept, candidate_length, k_min, k_max, threshold, stop_below);
  at::Tensor workspace;  // the split kernels' scratch (wide heads; cuda/launchers.h)
  const int64_t scratch = cuda::acceptance_head_workspace(t.args.batch, t.args.hidden_size, t.args.num_layers);
  SPECDEC_CHK_VALUE(scratch >= 0, "acceptance_head_step: the environment variable SPECDEC_HEAD_KERNEL must be "
                    "unset, 'fused' or 'split', got '", std::getenv("SPECDEC_HEAD_KERNEL"), "'");
  if (scratch > 0) {
    workspace = at::empty({scratch}, t.p_accept.options());
    t.args.workspace = workspace.data_ptr<float>();
  }
  check_launch(cuda::acceptance_head_step(t.args, at::cuda::getCurrentCUDAStream()), "acceptance_head_step");
  return {t.p_accept, t.stop};
}

std::tuple<at::Tensor, at::Tensor> confidence_features_cuda(const at::Tensor& dist, const at::Tensor& tokens, bool logits) {
  const c10::cuda::CUDAGuard guard(dist.device());
  ConfidenceTensors t = prepare_confidence(dist, tokens, logits);
  check_launch(cuda::confidence_features(t.args, at::cuda::getCurrentCUDAStream()), "confidence_features");
  return {t.out, t.code};
}

at::Tensor philox_uniforms_cuda(const at::Tensor& seed_offsets, int64_t slots, int64_t first_slot) {
  const c10::cuda::CUDAGuard guard(seed_offsets.device());
  PhiloxTensors t = prepare_philox(seed_offsets, slots, first_slot);
  check_launch(cuda::philox_uniforms(t.args, at::cuda::getCurrentCUDAStream()), "philox_uniforms");
  return t.out;
}

void advance_rows_cuda(at::Tensor& last, const std::optional<at::Tensor>& prev, const std::optional<at::Tensor>& room,
                       const std::optional<at::Tensor>& seed_offsets, const at::Tensor& emitted,
                       const std::optional<at::Tensor>& accepted, int64_t rows) {
  const c10::cuda::CUDAGuard guard(emitted.device());
  AdvanceTensors t = prepare_advance(last, prev, room, seed_offsets, emitted, accepted, rows);
  check_launch(cuda::advance_rows(t.args, at::cuda::getCurrentCUDAStream()), "advance_rows");
}

at::Tensor cache_attention_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& starts, double scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  CacheAttentionTensors t = prepare_cache_attention(query, key, value, starts, scale);
  const CacheAttentionArgs& a = t.args;
  at::Tensor workspace = at::empty({cuda::cache_attention_workspace(a.batch, a.q_heads, a.queries, a.columns,
                                                                    a.head_dim)}, query.options().dtype(at::kFloat));
  t.args.workspace = workspace.data_ptr<float>();
  check_launch(cuda::cache_attention(t.args, at::cuda::getCurrentCUDAStream()), "cache_attention");
  return t.out;
}

int64_t graph_chain_cuda(const at::Tensor& anchor, at::IntArrayRef pieces, at::TensorList flags) {
  SPECDEC_CHK_VALUE(pieces.size() >= 2 && flags.size() + 2 == pieces.size(), "graph_chain: needs n >= 2 pieces and "
                    "n - 2 flags, got ", pieces.size(), " pieces and ", flags.size(), " flags");
  std::vector<cudaGraph_t> graphs;
  std::vector<const bool*> conds;
  for (int64_t p : pieces) {
    SPECDEC_CHK_VALUE(p != 0, "graph_chain: a piece is a null cudaGraph_t (capture with keep_graph=True)");
    graphs.push_back(reinterpret_cast<cudaGraph_t>(static_cast<intptr_t>(p)));
  }
  for (const at::Tensor& f : flags) {
    SPECDEC_CHK_TYPE(f.scalar_type() == at::kBool, "graph_chain: flags must be bool, got ", f.scalar_type());
    SPECDEC_CHK_VALUE(f.numel() == 1 && f.device() == anchor.device(), "graph_chain: each flag is one bool on ",
                      anchor.device(), ", got ", f.sizes(), " on ", f.device());
    conds.push_back(f.data_ptr<bool>());
  }
  const c10::cuda::CUDAGuard guard(anchor.device());
  cudaGraphExec_t exec = nullptr;
  check_launch(cuda::compose_if_chain(graphs.data(), static_cast<int>(graphs.size()), conds.data(), &exec),
               "graph_chain");
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(exec));
}

void graph_launch_cuda(const at::Tensor& anchor, int64_t graph) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  check_launch(cuda::launch_graph(reinterpret_cast<cudaGraphExec_t>(static_cast<intptr_t>(graph)),
                                  at::cuda::getCurrentCUDAStream()), "graph_launch");
}

void graph_destroy_cuda(const at::Tensor& anchor, int64_t graph) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  check_launch(cuda::destroy_graph(reinterpret_cast<cudaGraphExec_t>(static_cast<intptr_t>(graph))), "graph_destroy");
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) {
  m.impl("cache_attention", &cache_attention_cuda);
  m.impl("graph_chain", &graph_chain_cuda);
  m.impl("graph_launch", &graph_launch_cuda);
  m.impl("graph_destroy", &graph_destroy_cuda);
  m.impl("chain_verify", &chain_verify_cuda);
  m.impl("chain_verify_logits", &chain_verify_logits_cuda);
  m.impl("chain_verify_greedy", &chain_verify_greedy_cuda);
  m.impl("residual_sample", &residual_sample_cuda);
  m.impl("acceptance_head_step", &acceptance_head_step_cuda);
  m.impl("confidence_features", &confidence_features_cuda);
  m.impl("philox_uniforms", &philox_uniforms_cuda);
  m.impl("advance_rows", &advance_rows_cuda);
}

}  // namespace specdec
